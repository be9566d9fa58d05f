"""How large the pool and the host arena are (design.md, "Residency and replay"): the boot floor,
`gpu_pool=auto` from the memory left once the KV cache is allocated, `host_arena=auto`."""

from __future__ import annotations

import math

import torch

from ..compat import MoetVllmError

GIB = 1 << 30


class MoetSizingError(MoetVllmError):
    """A pool that cannot serve: below the boot floor without consent, or larger than memory."""


def boot_floor(moe_layers: int, top_k: int, tokens_per_step: int, max_num_seqs: int) -> int:
    """Slots below which most decode steps replay: 1.15 x what one step of min(max_num_seqs, 4)
    sequences routes (tokens_per_step = 1 + speculative tokens)."""
    return math.ceil(1.15 * moe_layers * top_k * tokens_per_step * min(max_num_seqs, 4))


def free_bytes(device: torch.device) -> int:
    """Memory a pool could still take on `device`: the driver's free memory plus what torch's
    caching allocator holds unused (CUDA), or the host's available memory (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    import psutil  # a vLLM dependency

    return psutil.virtual_memory().available


def auto_slots(
    free: int,
    reserve: int,
    row_bytes: int,
    current_slots: int,
    n_keys: int,
    floor: int,
    below_floor_ok: bool,
) -> int:
    """Policy slots of a `gpu_pool=auto` pool: what `free` bytes (after the KV cache) less
    `reserve` hold, plus the `current_slots` of the load-time pool (given back first), at most
    one per key; below `floor` refused unless consented."""
    n = min(n_keys, max(0, free - reserve) // row_bytes + current_slots)
    if n < floor and not below_floor_ok:
        need = (floor - current_slots) * row_bytes + reserve
        raise MoetSizingError(
            f"moet: gpu_pool='auto': {free / GIB:.2f} GiB free after the KV cache, less "
            f"pool_reserve_gib={reserve / GIB:g}, hold {n} expert slots of {row_bytes / 2**20:.1f} "
            f"MiB, below the boot floor of {floor}: leave at least {need / GIB:.2f} GiB free "
            "(lower gpu_memory_utilization or --kv-cache-memory-bytes; on CPU "
            "VLLM_CPU_KVCACHE_SPACE), lower pool_reserve_gib, set gpu_pool to a number of slots, "
            "or accept replays on most steps with below_floor_ok=true"
        )
    return max(n, 1)


def arena_bytes(host_arena: str, pack_bytes: int) -> int:
    """The pinned arena of the `tiered` host tier: `host_arena` GiB, or for "auto" the whole
    pack, at most half of the host's available memory (the page cache serves the rest)."""
    if host_arena != "auto":
        return int(float(host_arena) * GIB)
    return min(pack_bytes, free_bytes(torch.device("cpu")) // 2)
