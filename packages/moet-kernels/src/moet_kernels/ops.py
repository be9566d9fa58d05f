"""The MoE op: the GPU kernels where they run, the torch reference elsewhere.

`w2_moe_slots(x, topk_ids, topk_weights, pool, slot_table, hidden, inter, n_real_tokens,
miss_count, routed, tier="w2", fp4_pool=None, fp4_slot_table=None, fp4_tier="fp4r",
host_pool=None, host_slot_table=None)` has the semantics of
`reference.tiered_moe_slots_reference` (tiered residency, design.md) over pools of expert rows in
`layout.NativeRowLayout(hidden, inter, tier)`: W2 rows, or FP4 rows of the `fp4r` / `fp4x-mxfp4`
tiers (e2m1 with UE8M0 scales per 32) or the `fp4x-nvfp4` tier (e2m1 with e4m3 scales per 16 and
a float32 scale per row), optionally an FP4 pool preferred over them, and optionally rows of
`tier` in pinned host memory that the GPU reads in place where the device pool lacks an expert
(FP4 slot > device slot > host row > miss: a host row is computed, never a miss, at the bus's
speed). On a CUDA device with the kernels it runs route (job lists
by tier, miss counter, routed mask, int8 activations), w13 per tier (SiLU(gate) * up in float32),
requant (the down projection's int8 input), w2 per tier, combine; all buffers have fixed
addresses per batch shape, so the op is CUDA-graph capturable once it has run eagerly for that
shape (vLLM's warm-up does this). Elsewhere it runs the reference in `exact` mode and says so
once.

It is registered as the torch custom op `moet::w2_moe_slots` with a fake (meta) implementation."""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from .layout import NativeRowLayout
from .loader import kernels_available, load
from .reference import Routing, route_reference, tiered_moe_slots_reference

log = logging.getLogger("moet_kernels")

TOK = 8  # pairs per mma n-tile (the kernels' TOK): a decode job's pairs
PREFILL_JOB = 16  # pairs per prefill job: two n-tiles share each decoded weight fragment
PREFILL_PAIRS_PER_EXPERT = 16  # prefill jobs from this many (token, expert) pairs per expert
CHUNK = 128  # K per activation scale (the kernels' KCHUNK)
MAX_EXPERTS = 1024  # the route and select kernels' limit
MAX_GROUPS = 32  # the select kernel's limit: a group score per lane of a warp
SELECT_WARPS = 4  # tokens per CTA of the select kernel (its TOPK_WARPS)
OUT_KERNELS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


@dataclass
class _Workspace:
    """One batch shape's buffers: views of its `_Arena`, so their addresses stay fixed."""

    ids: torch.Tensor
    weights: torch.Tensor
    xq: torch.Tensor
    xs: torch.Tensor
    n_jobs: torch.Tensor
    job_slot: torch.Tensor
    job_pairs: torch.Tensor
    pair_ok: torch.Tensor
    h: torch.Tensor
    aq: torch.Tensor
    as_: torch.Tensor
    y: torch.Tensor
    job_tok: int
    max_jobs: int


class _Arena:
    """The flat buffers every batch size of one layer shape shares (per device, top-k, hidden,
    inter, experts): sized for `tokens`, the largest batch so far, so GPU memory stays bounded
    whatever mix of batch sizes arrives. A batch's `_Workspace` is a set of views of them."""

    def __init__(self, dev, tokens: int, top_k: int, lay, n_experts: int):
        self.tokens = tokens
        self.captured = False  # a CUDA graph holds these addresses: never free them
        pairs = tokens * top_k
        jobs = -(-pairs // TOK) + min(n_experts, pairs)  # the most jobs: decode jobs of 8 pairs

        def z(n, dtype):
            return torch.zeros(n, dtype=dtype, device=dev)

        self.ids = z(pairs, torch.int32)
        self.weights = z(pairs, torch.float32)
        self.xq = z(tokens * lay.hidden_p, torch.int8)
        self.xs = z(tokens * (lay.hidden_p // CHUNK), torch.float32)
        self.n_jobs = z(4, torch.int32)  # {0, FP4 jobs, + device jobs, + host jobs}
        self.job_slot = z(jobs, torch.int32)
        # either job size: (ceil(P / t) + min(E, P)) * t <= P + t + t * E
        self.job_pairs = z(pairs + PREFILL_JOB * (1 + n_experts), torch.int32)
        self.pair_ok = z(pairs, torch.uint8)
        self.h = z(pairs * lay.inter_p, torch.float32)  # columns past inter are never read
        self.aq = z(pairs * lay.inter_p, torch.int8)
        self.as_ = z(pairs * (lay.inter_p // CHUNK), torch.float32)
        self.y = z(pairs * lay.hidden, torch.float32)

    def view(self, n_tok: int, top_k: int, lay, job_tok: int, max_jobs: int) -> _Workspace:
        pairs = n_tok * top_k

        def v(buf, *shape):
            n = 1
            for d in shape:
                n *= d
            return buf[:n].view(*shape)

        return _Workspace(
            ids=v(self.ids, n_tok, top_k),
            weights=v(self.weights, n_tok, top_k),
            xq=v(self.xq, n_tok, lay.hidden_p),
            xs=v(self.xs, n_tok, lay.hidden_p // CHUNK),
            n_jobs=self.n_jobs,
            job_slot=v(self.job_slot, max_jobs),
            job_pairs=v(self.job_pairs, max_jobs, job_tok),
            pair_ok=v(self.pair_ok, pairs),
            h=v(self.h, pairs, lay.inter_p),
            aq=v(self.aq, pairs, lay.inter_p),
            as_=v(self.as_, pairs, lay.inter_p // CHUNK),
            y=v(self.y, pairs, lay.hidden),
            job_tok=job_tok,
            max_jobs=max_jobs,
        )


_arenas: dict[tuple, _Arena] = {}  # per (device, top-k, layer shape): the shared buffers
_retired: list[_Arena] = []  # outgrown arenas a captured CUDA graph still reads
_workspaces: dict[tuple, _Workspace] = {}  # per batch shape (workspace_key): views of its arena
_noted_fallback = False


# the route kernel's tiers, by preference: its jobs come in this order (n_jobs)
TIER_JOBS = ("fp4", "device", "host")
# tier -> the GEMM kernels' name suffix
GEMM_KERNELS = {"w2": "", "fp4r": "_fp4", "fp4x-mxfp4": "_fp4", "fp4x-nvfp4": "_nvfp4"}
FP4_TIERS = tuple(t for t in GEMM_KERNELS if t != "w2")  # what fp4_pool may hold
PREFILL_TIERS = ("w2", "fp4r", "fp4x-mxfp4")  # tiers whose GEMMs have _t16 (prefill) variants


@functools.cache
def native_layout(hidden: int, inter: int, tier: str = "w2") -> NativeRowLayout:
    return NativeRowLayout(hidden, inter, tier)


def job_size(n_pairs: int, n_experts: int, tiers=("w2",)) -> int:
    """Pairs per job: `TOK`, or `PREFILL_JOB` once the batch routes `PREFILL_PAIRS_PER_EXPERT`
    pairs per expert on average (prefill), where the kernels decode each weight fragment once for
    two n-tiles instead of once per job of 8; only where every tier (by name) has those kernels
    (`PREFILL_TIERS`: two n-tiles of NVFP4 would spill)."""
    prefill = n_pairs >= PREFILL_PAIRS_PER_EXPERT * n_experts
    return PREFILL_JOB if prefill and set(tiers) <= set(PREFILL_TIERS) else TOK


def workspace_key(dev, n_tok: int, top_k: int, lay, n_experts: int, job_tok: int) -> tuple:
    """Which `_workspaces` entry a batch uses (any tier's buffers: they depend on the shapes)."""
    return (dev, n_tok, top_k, lay.hidden, lay.inter, n_experts, job_tok)


def _workspace(dev, n_tok: int, top_k: int, tiers, n_experts: int) -> _Workspace:
    """The fixed buffers of one batch shape and job size (tiers: [(pool, slot_table, layout)]):
    views of the layer shape's arena, which grows (outside a capture) to the largest batch."""
    lay = tiers[-1][2]
    job_tok = job_size(n_tok * top_k, n_experts, [tl.tier.name for _, _, tl in tiers])
    key = workspace_key(dev, n_tok, top_k, lay, n_experts, job_tok)
    capturing = torch.cuda.is_current_stream_capturing()
    ws = _workspaces.get(key)
    if ws is None:
        shape = (dev, top_k, lay.hidden, lay.inter, n_experts)
        arena = _arenas.get(shape)
        if arena is None or arena.tokens < n_tok:
            if capturing:
                raise RuntimeError(
                    f"moet::w2_moe_slots: no buffers for {n_tok} tokens yet; run the op once "
                    "eagerly with this batch size (or a larger one) before capturing a CUDA graph"
                )
            if arena is not None:  # outgrown: its views go; a graph may still read it
                if arena.captured:
                    _retired.append(arena)
                for k in [k for k in _workspaces if k[0] == dev and k[2:6] == shape[1:]]:
                    del _workspaces[k]
            arena = _arenas[shape] = _Arena(dev, n_tok, top_k, lay, n_experts)
        pairs = n_tok * top_k
        max_jobs = -(-pairs // job_tok) + min(n_experts, pairs)
        ws = _workspaces[key] = arena.view(n_tok, top_k, lay, job_tok, max_jobs)
    if capturing:
        _arenas[(dev, top_k, lay.hidden, lay.inter, n_experts)].captured = True
    return ws


@functools.cache
def _available(device_index: int | None) -> tuple[bool, str]:
    """kernels_available, asked once per device (it lists the cubin folder)."""
    return kernels_available(torch.device("cuda", device_index))


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _as(t: torch.Tensor, dtype: torch.dtype, buffer: torch.Tensor) -> torch.Tensor:
    """t itself where the kernels can read it (no copy node in the graph: vLLM's router gives
    int32 ids and float32 weights), else copied into the workspace's fixed buffer."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    buffer.copy_(t)
    return buffer


def _gpu(x, topk_ids, topk_weights, tiers, n_real_tokens, miss_count, routed):
    """The kernels over `tiers`: {"fp4" | "device" | "host": (pool, slot_table, layout)}."""
    dev = x.device
    n_tok, hidden = x.shape
    top_k = topk_ids.shape[1]
    slot_table = tiers["device"][1]
    n_experts = slot_table.shape[0]
    if n_experts > MAX_EXPERTS:
        raise ValueError(f"the route kernel handles up to {MAX_EXPERTS} experts, got {n_experts}")
    if x.dtype not in OUT_KERNELS:
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    lay = tiers["device"][2]
    mod = load(dev)
    ws = _workspace(dev, n_tok, top_k, list(tiers.values()), n_experts)
    ids = _as(topk_ids, torch.int32, ws.ids)
    weights = _as(topk_weights, torch.float32, ws.weights)
    x = x.contiguous()
    out = torch.empty(n_tok, hidden, dtype=x.dtype, device=dev)
    i32, i64 = ctypes.c_int, ctypes.c_longlong
    kind = OUT_KERNELS[x.dtype]
    warps = n_tok * (lay.hidden_p // CHUNK)  # activation quantization: a warp per chunk

    def table(name):
        return _ptr(tiers[name][1]) if name in tiers else ctypes.c_void_p(0)

    mod.launch(
        f"moet_route_{kind}",
        1 + min(-(-warps // 8), 4 * mod.sms),
        256,
        [_ptr(x), i32(n_tok), i32(hidden), i32(lay.hidden_p), _ptr(ids), i32(top_k),
         _ptr(slot_table), table("fp4"), table("host"), i32(n_experts), _ptr(n_real_tokens),
         _ptr(miss_count),
         _ptr(routed), _ptr(ws.xq), _ptr(ws.xs), i32(ws.job_tok.bit_length() - 1), _ptr(ws.n_jobs),
         _ptr(ws.job_slot),
         _ptr(ws.job_pairs), _ptr(ws.pair_ok)],
    )  # fmt: skip

    def gemms(proj: str, units: int, k: int, inputs: list, outputs: list) -> None:
        """moet_w13 or moet_w2 once per row format: route's n_jobs holds {0, FP4 jobs, + device
        jobs, + host jobs} (TIER_JOBS), so the FP4 tier's launch takes its jobs from n_jobs[0] and
        the W2 launch the device pool's from n_jobs[1], then the host rows' (its second pool), as
        one launch: a launch per tier costs each layer a kernel even where that tier has no work.
        Prefill jobs (16 pairs) take the kernels' _t16 variants."""
        prefill = "_t16" if ws.job_tok == PREFILL_JOB else ""
        host = tiers["host"][0] if "host" in tiers else None
        for where in ("fp4", "device"):
            if where not in tiers:
                continue
            pool, _, tl = tiers[where]
            pool2 = host if where == "device" else None
            name = f"moet_{proj}{GEMM_KERNELS[tl.tier.name]}{prefill}"
            first = TIER_JOBS.index(where)
            mod.launch(
                name,
                mod.persistent_grid(name, 128, ws.max_jobs * units),
                128,
                [_ptr(pool), i64(pool.stride(0)),
                 ctypes.c_void_p(None) if pool2 is None else _ptr(pool2),
                 i64(0 if pool2 is None else pool2.stride(0)), i64(tl.offsets[f"{proj}_codes"]),
                 i64(tl.offsets[f"{proj}_scales"]), i32(units), i32(k // CHUNK), *inputs,
                 ctypes.c_void_p(ws.n_jobs.data_ptr() + 4 * first), _ptr(ws.job_slot),
                 _ptr(ws.job_pairs), *outputs],
            )  # fmt: skip

    gemms("w13", lay.inter // 32, lay.hidden_p,
          [_ptr(ws.xq), _ptr(ws.xs), i32(lay.hidden_p), i32(top_k)], [_ptr(ws.h), i32(lay.inter_p)])  # fmt: skip
    pairs = n_tok * top_k
    mod.launch(
        "moet_requant",
        min(-(-(pairs * (lay.inter_p // CHUNK)) // 8), 8 * mod.sms),
        256,
        [_ptr(ws.h), _ptr(ws.pair_ok), i32(pairs), i32(lay.inter), i32(lay.inter_p), _ptr(ws.aq),
         _ptr(ws.as_)],
    )  # fmt: skip
    gemms("w2", lay.w2_rows // 64, lay.inter_p, [_ptr(ws.aq), _ptr(ws.as_), i32(lay.inter_p)],
          [_ptr(ws.y), i32(hidden)])  # fmt: skip
    mod.launch(
        f"moet_combine_{kind}",
        min(-(-(n_tok * hidden) // 256), 8 * mod.sms),
        256,
        [_ptr(ws.y), _ptr(weights), _ptr(ws.pair_ok), i32(n_tok), i32(top_k), i32(hidden),
         _ptr(out)],
    )  # fmt: skip
    return out


def _check_args(x, topk_ids, topk_weights, tiers, n_real_tokens, miss_count, routed):
    lay = tiers["device"][2]
    if x.dim() != 2 or x.shape[1] != lay.hidden:
        raise ValueError(f"x must be [T, {lay.hidden}], got {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
            f"both be [T={x.shape[0]}, k]"
        )
    checks = [("n_real_tokens", n_real_tokens, torch.int32), ("miss_count", miss_count, torch.int32),
              ("routed", routed, torch.uint8)]  # fmt: skip
    prefixes = {"fp4": "fp4_", "device": "", "host": "host_"}
    named = [(prefixes[where], *t) for where, t in tiers.items()]
    for prefix, pool, table, tl in named:
        if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] < tl.row_bytes:
            raise ValueError(
                f"{prefix}pool must be uint8 [n_slots, >= {tl.row_bytes}] (NativeRowLayout rows "
                f"of tier {tl.tier.name}), got {pool.dtype} {tuple(pool.shape)}"
            )
        if pool.stride(1) != 1:
            raise ValueError(f"{prefix}pool rows must be contiguous")
        if table.shape != routed.shape:
            raise ValueError(
                f"{prefix}slot_table has {table.shape[0]} experts, routed {routed.shape[0]}: "
                "both are [E]"
            )
        checks.append((f"{prefix}slot_table", table, torch.int32))
    for name, t, dtype in checks:
        if t.dtype != dtype or not t.is_contiguous():
            raise TypeError(f"{name} must be a contiguous {dtype} tensor, got {t.dtype}")
    pools = [(f"{prefix}pool", pool) for prefix, pool, _, _ in named if prefix != "host_"]
    for name, t in [("topk_ids", topk_ids), ("topk_weights", topk_weights), *pools,
                    *((n, t) for n, t, _ in checks)]:  # fmt: skip
        if t.device != x.device:
            raise ValueError(
                f"{name} is on {t.device} but x is on {x.device}: the op reads every tensor on "
                "x's device; move it there (a pool fetched to the GPU lives there)"
            )
    if "host" in tiers:
        host = tiers["host"][0]
        # (is_pinned asks the driver; a capture checked at the eager run before it)
        unpinned = (
            x.is_cuda and not torch.cuda.is_current_stream_capturing() and not host.is_pinned()
        )
        if host.device.type != "cpu" or unpinned:
            raise ValueError(
                f"host_pool must be host memory{', pinned' if x.is_cuda else ''} (the GPU reads "
                f"its rows in place), got a tensor on {host.device}"
                f"{'' if host.device.type != 'cpu' else ' not pinned'}"
            )


@torch.library.custom_op("moet::w2_moe_slots", mutates_args=("miss_count", "routed"))
def w2_moe_slots(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    pool: torch.Tensor,
    slot_table: torch.Tensor,
    hidden: int,
    inter: int,
    n_real_tokens: torch.Tensor,
    miss_count: torch.Tensor,
    routed: torch.Tensor,
    tier: str = "w2",
    fp4_pool: torch.Tensor | None = None,
    fp4_slot_table: torch.Tensor | None = None,
    fp4_tier: str = "fp4r",
    host_pool: torch.Tensor | None = None,
    host_slot_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed-experts output [T, H] in x's dtype (module docstring). With `fp4_pool` and
    `fp4_slot_table`, an expert with an FP4 slot is computed from it (rows of `fp4_tier`), else
    from its `slot_table` slot; with `host_pool` (pinned host memory, rows of `tier`) and
    `host_slot_table` (on x's device), else from its host row; else it is a miss: FP4 slot >
    device slot > host row > miss."""
    global _noted_fallback
    for name, t in (("tier", tier), ("fp4_tier", fp4_tier)):
        if t not in GEMM_KERNELS:
            raise ValueError(
                f"{name} {t!r} has no kernels; kernel tiers: {', '.join(GEMM_KERNELS)}"
            )
    tiers = {}  # by preference (TIER_JOBS)
    for name, p, t in (("fp4", fp4_pool, fp4_slot_table), ("host", host_pool, host_slot_table)):
        if (p is None) != (t is None):
            raise ValueError(f"{name}_pool and {name}_slot_table go together: pass both or neither")
    if fp4_pool is not None:
        if fp4_tier not in FP4_TIERS:
            raise ValueError(f"fp4_tier must be one of {', '.join(FP4_TIERS)}, got {fp4_tier!r}")
        tiers["fp4"] = (fp4_pool, fp4_slot_table, native_layout(hidden, inter, fp4_tier))
    tiers["device"] = (pool, slot_table, native_layout(hidden, inter, tier))
    if host_pool is not None:
        tiers["host"] = (host_pool, host_slot_table, native_layout(hidden, inter, tier))
    _check_args(x, topk_ids, topk_weights, tiers, n_real_tokens, miss_count, routed)
    if x.is_cuda:
        ok, why = _available(x.device.index)
        if ok:
            return _gpu(x, topk_ids, topk_weights, tiers, n_real_tokens, miss_count, routed)
        if "host" in tiers:
            raise RuntimeError(
                f"moet::w2_moe_slots: host rows are read in place by the kernels only ({why}); "
                "without them pass no host_pool (misses are then fetched and replayed)"
            )
    else:
        why = "tensors are on the CPU"
    if not _noted_fallback:
        log.info("moet-kernels: %s; using the torch reference (exact mode)", why)
        _noted_fallback = True
    return tiered_moe_slots_reference(
        x, topk_ids, topk_weights, list(tiers.values()), int(n_real_tokens[0]), miss_count, routed
    ).to(x.dtype)


@w2_moe_slots.register_fake
def _(
    x, topk_ids, topk_weights, pool, slot_table, hidden, inter, n_real_tokens, miss_count, routed,
    tier="w2", fp4_pool=None, fp4_slot_table=None, fp4_tier="fp4r", host_pool=None,
    host_slot_table=None,
):  # fmt: skip
    return x.new_empty(x.shape[0], hidden)


def select_experts(
    logits: torch.Tensor, routing: Routing, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (topk_weights float32 [T, k], topk_ids int32 [T, k]) by
    `reference.route_reference`'s rules: on a CUDA device with the kernels one kernel (sigmoid
    scores bit for bit, softmax scores and renormalized weights within float32 ulps of the
    reference's, the same experts wherever their scores do not tie within those ulps), elsewhere
    the reference itself."""
    e = logits.shape[-1]
    if logits.dim() != 2 or logits.dtype not in OUT_KERNELS:
        raise ValueError(
            f"router logits must be a bfloat16, float16 or float32 [T, E] tensor, got "
            f"{logits.dtype} {tuple(logits.shape)}"
        )
    if e > MAX_EXPERTS or routing.n_group > MAX_GROUPS or e % routing.n_group or routing.top_k > e:
        raise ValueError(
            f"{e} experts do not fit {routing} (the select kernel: at most {MAX_EXPERTS} experts "
            f"in at most {MAX_GROUPS} equal groups)"
        )
    bias = None
    if correction_bias is not None:
        bias = correction_bias.to(device=logits.device, dtype=torch.float32).contiguous()
        if bias.shape != (e,):
            raise ValueError(f"the correction bias must be [{e}], got {tuple(bias.shape)}")
    r = routing
    return _select_experts(
        logits, bias, r.top_k, r.scoring, r.renormalize, r.n_group, r.topk_group, r.scaling
    )


@torch.library.custom_op("moet::select_experts", mutates_args=())
def _select_experts(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    routing = Routing(top_k, scoring, renormalize, n_group, topk_group, scaling)
    if not (logits.is_cuda and _available(logits.device.index)[0]):
        weights, ids = route_reference(logits, routing, bias)
        return weights, ids.to(torch.int32)
    t, e = logits.shape
    logits = logits.contiguous()
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t:
        i32 = ctypes.c_int
        load(logits.device).launch(
            f"moet_select_{OUT_KERNELS[logits.dtype]}",
            -(-t // SELECT_WARPS),
            32 * SELECT_WARPS,
            [_ptr(logits), ctypes.c_void_p(0 if bias is None else bias.data_ptr()), i32(t), i32(e),
             i32(top_k), i32(scoring == "softmax"), i32(renormalize), i32(n_group),
             i32(topk_group), ctypes.c_float(scaling), _ptr(ids), _ptr(weights)],
        )  # fmt: skip
    return weights, ids


@_select_experts.register_fake
def _(logits, bias, top_k, scoring, renormalize, n_group, topk_group, scaling):
    t = logits.shape[0]
    return (
        logits.new_empty(t, top_k, dtype=torch.float32),
        logits.new_empty(t, top_k, dtype=torch.int32),
    )


__all__ = ["native_layout", "select_experts", "w2_moe_slots"]
