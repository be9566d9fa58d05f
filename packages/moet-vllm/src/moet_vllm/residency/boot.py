"""Starting tiered residency in a worker, once the last MoE layer's experts reached the packs:
the pool's size and the boot floor, the host tier, the manager on the layers' device, and the
hooks that size a `gpu_pool=auto` pool before any CUDA graph is captured."""

from __future__ import annotations

import torch

from .. import compat
from ..config import MoetConfig, fp4_pool_slots, pool_slots
from . import manager as residency
from .fp4pool import Fp4Pool
from .manager import AutoPool, MoetResidencyError, ResidencyManager
from .sizing import GIB, boot_floor


def start_residency(
    cfg: MoetConfig,
    session,
    top_k: int,
    rank: int,
    serving: tuple[int, int],
    device: torch.device,
    predict: bool,
    read_in_place: bool,
) -> ResidencyManager:
    """The manager of this worker (activated): a pool of `cfg.gpu_pool` slots on `device` over
    the session's packs. `serving` = (max_num_seqs, speculative tokens per step): the floor."""
    src, moe_layers, mtp = session.source, session.moe_layers, session.mtp_layers
    n_moe = len(moe_layers) - len(mtp)  # the tiered MoE layers (MTP's are pinned)
    n_tiered_keys = n_moe * src.n_experts
    max_num_seqs, num_spec = serving
    floor = boot_floor(n_moe, top_k, 1 + num_spec, max_num_seqs)
    if cfg.gpu_pool == "auto":  # sized once vLLM's KV budget is known; until then one slot
        n_slots = 1  # and the staging area serve vLLM's profiling passes (streamed)
    else:
        n_slots = pool_slots(cfg, n_tiered_keys) or n_tiered_keys
        if n_slots < min(floor, n_tiered_keys) and not cfg.below_floor_ok:  # all: never below
            raise MoetResidencyError(
                f"moet: gpu_pool={cfg.gpu_pool!r} gives {n_slots} expert slots, below the "
                f"boot floor of {floor} (1.15 x {n_moe} MoE layers x top-{top_k} x "
                f"{1 + num_spec} tokens/step x min(max_num_seqs, 4)): set gpu_pool >= "
                f"{floor}, lower max_num_seqs, or accept replays on most steps with "
                "below_floor_ok=true"
            )
    store = session.cache.open_store(cfg.host_tier, cfg.host_arena)
    fp4 = None
    if session.fp4_cache is not None:  # the FP4 tier: its pool and its own pack
        n_moe_all = len(moe_layers)
        tiered = [o for o in range(n_moe_all) if moe_layers[o] not in mtp]
        n_fp4, auto = fp4_pool_slots(cfg, n_tiered_keys), cfg.fp4_pool == "auto"
        fp4 = Fp4Pool(
            session.fp4_layout, session.fp4_cache.open_store(cfg.host_tier, cfg.host_arena),
            n_moe_all, tiered, src.n_experts, 1 if auto else n_fp4, device,
            hot_path=session.fp4_cache.hot_path(),
        )  # fmt: skip
        if auto:  # at most n_fp4, sized with the W2 pool's memory before graph capture
            fp4.auto_cap = n_fp4
    mgr = ResidencyManager(
        session.layout,
        moe_layers,
        src.n_experts,
        n_slots,
        store,
        pinned_layers=mtp,
        miss_mode=cfg.miss_mode,
        miss_tolerance=cfg.miss_tolerance,
        max_replays=cfg.max_replays,
        kpi_every=cfg.kpi_every,
        hot_path=session.cache.hot_path(),
        predict=predict,
        rank=rank,
        device=device,
        read_in_place=read_in_place,
        fp4=fp4,
        gate=cfg.gate,
        gate_metric=cfg.gate_metric,
        gate_tau=cfg.gate_tau,
    )
    if cfg.gpu_pool == "all":  # every W2 expert resident (a manager for the FP4 tier): filled now
        mgr.hold_every_expert()
    if cfg.gpu_pool == "auto":
        mgr.auto = AutoPool(int(cfg.pool_reserve_gib * GIB), floor, cfg.below_floor_ok)
    if cfg.gpu_pool == "auto" or (fp4 is not None and fp4.auto_cap is not None):
        mgr.reserve_bytes = int(cfg.pool_reserve_gib * GIB)
        if device.type == "cuda":
            compat.carve_available_memory(residency.carve_auto_pool)
        compat.before_warm_up(residency.size_auto_pool)
    session.source.close()
    residency.activate(mgr)
    return mgr
