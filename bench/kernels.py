"""moet-kernels on a GPU: build, validate and time the W2 MoE op in one run (issue 5).

    python bench/kernels.py [--out DIR] [--only validate|time] [--sanitize]

Run by `nox -s "bench(kernels)"` or directly on the GPU machine (bench/h200/kernels.sh). Builds the
cubin for the GPU with nvcc (unless MOET_KERNELS_CUBIN_DIR points at built ones), then:

- validate (W2 rows, FP4 rows of the fp4r, fp4x-mxfp4 and fp4x-nvfp4 tiers, and an FP4 pool
  preferred over a W2 one: tier "fp4r>w2"): every case draws fresh random weights, activations and routings; each
  stage of the op is compared with its reference given the previous stage's own output (`stages`:
  the int8 steps and the combine bit-equal, the GEMMs within float32 rounding of float64), and the
  op's output with the kernel-mode reference (float64 GEMMs over the kernels' int8 activations)
  and the exact reference; buffers are poisoned before each run; a rerun must be
  byte-identical, also on fewer CTAs; a CUDA graph replay must equal the eager run; with random
  slot tables the miss counter and the routed mask must be exact, counting real rows only.
- time: a GLM-5.2 MoE layer (H 6144, I 2048, 256 experts, top-8) at batch 1, 8, 32 and a prefill
  size, one graph over 8 layers of distinct pools (L2 defeated), uniform routing, weight scales
  shaped like trained weights' (`SCALES`; again at batch 1 and 8 with "wide" scales, the slow
  path's worst case; and at batch 1, 8, 32 with fp4r and with NVFP4 rows; with --prefill N...,
  those token counts with jobs of 8 pairs against jobs of 16, W2 and fp4r rows); effective
  bandwidth on routed expert bytes as a share of the device-to-device copy bandwidth measured in
  the same run; per-kernel times from the profiler; vLLM 0.24's kernels from design.md, marked
  "not same run" (bench/h200/vllm_moe.py times them in the same device run where vLLM is staged:
  bench/h200/kernels.sh runs it).
- --sanitize: a reduced validation for compute-sanitizer (memcheck, racecheck).

Writes <gpu>-<date>.json to --out (default bench/results/kernels/), with the run's provenance
(GPU, driver, torch, commit, command: bench/provenance.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _pkg in ("moet-kernels", "moet-quant"):  # the references decode with moet-quant's tables
    sys.path.insert(0, str(ROOT / "packages" / _pkg / "src"))

import torch  # noqa: E402
from provenance import provenance  # noqa: E402  (bench/, the script's folder)
from results_io import machine, write_result  # noqa: E402

# vLLM 0.24 on the H200, GLM-5.2 layer, graph replays, uniform routing (design.md): not same run.
VLLM_US = {
    "bf16 Triton fused_moe": {1: 175, 8: 1090, 32: 2738},
    "FP8 block-128": {1: 107, 8: 596, 32: 1473},
    "Marlin W4A16": {1: 82, 8: 409, 32: 1063},
}
SHAPES = {  # name: (hidden, inter, experts, top_k)
    "glm-5.2": (6144, 2048, 256, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "kimi-k2": (7168, 2048, 384, 8),
    "qwen3-235b": (4096, 1536, 128, 8),
    "glm-5.2-tp2": (6144, 1024, 256, 8),
    "deepseek-v3-tp4": (7168, 512, 256, 8),
    "qwen3-235b-tp4": (4096, 384, 128, 8),
    "fixture": (128, 32, 64, 4),
    "fixture-e16": (128, 32, 16, 4),  # prefill jobs (16 pairs per expert) from 64 tokens
}


def build_cubin() -> None:
    if os.environ.get("MOET_KERNELS_CUBIN_DIR"):
        return
    out = Path(tempfile.mkdtemp(prefix="moet-cubins-"))
    major, minor = torch.cuda.get_device_capability()
    arch = {(9, 0): "90a", (10, 0): "100a", (12, 0): "120a"}[(major, minor)]
    src = ROOT / "packages" / "moet-kernels" / "csrc" / "w2_moe.cu"
    cmd = ["nvcc", "-cubin", "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas",
           "-v", *os.environ.get("MOET_NVCC_FLAGS", "").split(), "-o",
           str(out / f"w2_moe.sm_{arch}.cubin"), str(src)]  # fmt: skip
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"nvcc failed:\n{r.stderr}")
    print(f"built sm_{arch} cubin in {time.time() - t0:.1f} s")
    os.environ["MOET_KERNELS_CUBIN_DIR"] = str(out)


# Within-chunk spread of the block exponents (max - min over a row's four 32-blocks of a K chunk of
# 128) in the trained fixture's W2 gate/up weights: 0 in 88%, 1 in 12%, 2 in 0.4% of row chunks.
# "trained" draws that shape (a row exponent, plus 1 with p 0.12 and 2 with p 0.004 per block);
# "wide" draws every block independently from 2^-9 .. 2^-3, so most row tiles take the kernels'
# slow path (a chunk whose exponents spread over more than 4).
SCALES = ("trained", "wide")


def random_scales(shape, kind, gen, dev="cuda"):
    if kind == "wide":
        return torch.randint(118, 125, shape, dtype=torch.uint8, device=dev, generator=gen)
    row = torch.randint(116, 124, (*shape[:-1], 1), device=dev, generator=gen)
    u = torch.rand(shape, device=dev, generator=gen)
    return (row + (u < 0.12).int() + (u < 0.004).int()).to(torch.uint8)


def random_e4m3_scales(shape, kind, gen, dev="cuda"):
    """NVFP4 block scales: "trained" like a checkpoint's (block amax / 6 over a global scale that
    maps the tensor's amax to 448: e4m3 8..448, bytes 0x50..0x7e); "wide" every finite
    non-negative e4m3 byte (0x00..0x7e: zero, subnormals, normals)."""
    lo = 0x50 if kind == "trained" else 0
    return torch.randint(lo, 0x7F, shape, dtype=torch.uint8, device=dev, generator=gen)


class Layer:
    """Random experts of one MoE layer in one tier's rows: logical sections (for the references)
    and a native pool on the GPU whose slots hold the experts in a random order."""

    def __init__(
        self,
        hidden,
        inter,
        n_experts,
        gen,
        resident=1.0,
        keep_logical=True,
        scales="trained",
        tier="w2",
    ):
        from moet_kernels.layout import NativeRowLayout, RowLayout

        dev = "cuda"
        self.hidden, self.inter, self.n_experts, self.tier = hidden, inter, n_experts, tier
        logical = RowLayout(hidden, inter, tier)
        self.weight_parts = logical.tier.weight_parts

        def draw(name, shape):
            shape = (n_experts, *shape)
            if name.endswith("_codes"):
                return torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=gen)
            if name.endswith("_scale_2"):  # NVFP4's global scale per row
                return torch.rand(shape, device=dev, generator=gen) * 3e-5 + 1e-5
            if logical.tier.scale == "e4m3-16":
                return random_e4m3_scales(shape, scales, gen)
            return random_scales(shape, scales, gen)

        self.sections = {n: draw(n, shape) for n, (_, shape) in logical.sections.items()}
        self.lay = NativeRowLayout(hidden, inter, tier)
        rows = torch.cat(
            [
                self.lay.pack(**{n: t[a : a + 16] for n, t in self.sections.items()})
                for a in range(0, n_experts, 16)
            ]
        )
        order = torch.randperm(n_experts, device=dev, generator=gen)
        self.pool = torch.empty_like(rows)
        self.pool[order] = rows  # expert x lives in slot order[x]
        self.slots = order.to(torch.int32)
        if resident < 1.0:
            gone = torch.rand(n_experts, device=dev, generator=gen) >= resident
            self.slots[gone] = -1
        if not keep_logical:
            del self.sections

    def expert(self, e) -> tuple:
        """Expert e's weights as the references take them (`Tier.weight_parts`, w13 then w2)."""
        return tuple(
            self.sections[f"{p}_{part}"][e] for p in ("w13", "w2") for part in self.weight_parts
        )

    def expert_bytes(self) -> int:
        """Bytes of one expert: 2.25 (W2), 4.25 (fp4r, MXFP4) or 4.5 (NVFP4) bits per weight."""
        bits32 = {"w2": 72, "fp4x-nvfp4": 144}.get(self.tier, 136)  # bits per 32 weights
        return 3 * self.hidden * self.inter * bits32 // 256


def routing(n_tok, n_experts, top_k, gen, dev="cuda"):
    scores = torch.rand(n_tok, n_experts, device=dev, generator=gen)
    ids = scores.topk(top_k, dim=1).indices.to(torch.int32)  # distinct, uniform
    w = torch.rand(n_tok, top_k, device=dev, generator=gen)
    return ids, w / w.sum(dim=1, keepdim=True)


def run_op(layers, x, ids, w, n_real, miss, routed):
    """The op over `layers` (Layer, or [FP4 Layer, Layer]: the first preferred)."""
    from moet_kernels.ops import w2_moe_slots

    layers = layers if isinstance(layers, list) else [layers]
    last = layers[-1]
    fp4 = (layers[0].pool, layers[0].slots, layers[0].tier) if len(layers) == 2 else ()
    return w2_moe_slots(
        x, ids, w, last.pool, last.slots, last.hidden, last.inter, n_real, miss, routed,
        last.tier, *fp4,
    )  # fmt: skip


def poison_workspaces(layer) -> None:
    from moet_kernels import ops

    for ws in ops._workspaces.values():
        ws.y.fill_(float("nan"))
        ws.xq.fill_(0x55)
        ws.xs.fill_(float("nan"))
        ws.job_pairs.fill_(0x7FFFFFFF)
        ws.job_slot.fill_(0x7FFFFFFF)
        ws.h.fill_(float("nan"))
        ws.aq.fill_(0x55)
        ws.as_.fill_(float("nan"))


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def rel_rows(a, b) -> float:
    """The largest error of any element, relative to the largest magnitude in its row."""
    a, b = a.double(), b.double()
    if not len(b):
        return 0.0
    return float(((a - b).abs().amax(-1) / b.abs().amax(-1).clamp_min(1e-300)).max())


def stages(ws, held, holder, inter, x, ids, w, out) -> dict:
    """Each stage of the op against its reference given the previous stage's own output (read
    from the workspace), so a rounding flip upstream cannot hide or fake an error downstream:
    route's activation quantization and pair mask exactly; w13 (GEMM + SiLU·up) within float32
    rounding of float64 over the kernel's int8 activations; requant exactly on the kernel's h;
    w2 within float32 rounding of float64 over the kernel's requantized activations (each
    element relative to its row's largest, so one wrong weight shows); the combine exactly, in
    float32 in slot order over the kernel's w2 outputs. `ws` is the op's workspace for this batch,
    `held[e]` whether any tier holds expert e, `holder(e)` the first tier's Layer that does."""
    from moet_kernels.layout import tier_of
    from moet_kernels.reference import _dequant_activations as dequant
    from moet_kernels.reference import _tier_kernel_weights as kernel_weights
    from moet_kernels.reference import quantize_activations

    def quantized_exactly(values, q_buf, s_buf) -> bool:
        """The kernel's int8 rows and scales equal the reference's, padding zero."""
        q, s = quantize_activations(values)
        k, nb = q.shape[1], s.shape[1]
        return bool(
            torch.equal(q_buf[:, :k], q) and not q_buf[:, k:].any()
            and torch.equal(s_buf[:, :nb], s) and not s_buf[:, nb:].any()
        )  # fmt: skip

    n_tok, h_dim = x.shape
    top_k = ids.shape[1]
    r = {"activations_exact": quantized_exactly(x.float(), ws.xq, ws.xs)}
    ok = held[ids.long()].flatten()
    r["pair_mask_exact"] = bool(torch.equal(ws.pair_ok.bool(), ok))
    pairs = ok.nonzero().flatten()
    xk = dequant(ws.xq[:, :h_dim], ws.xs)
    h_ref = torch.zeros(len(pairs), inter, dtype=torch.float64, device=x.device)
    y_ref = torch.zeros(len(pairs), h_dim, dtype=torch.float64, device=x.device)
    aq, as_ = ws.aq[pairs], ws.as_[pairs]
    ak = dequant(aq[:, :inter], as_)
    flat = ids.flatten()[pairs]
    for e in flat.unique().tolist():
        lr = holder(e)
        tier = tier_of(lr.tier)
        parts = lr.expert(e)
        n13 = len(tier.weight_parts)
        sel = (flat == e).nonzero().flatten()
        gate_up = xk[pairs[sel] // top_k] @ kernel_weights(tier, parts[:n13]).T
        h_ref[sel] = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y_ref[sel] = ak[sel] @ kernel_weights(tier, parts[n13:]).T
    r["rel_w13"] = rel_rows(ws.h[pairs, :inter], h_ref)
    r["requant_exact"] = quantized_exactly(ws.h[pairs, :inter], aq, as_)
    r["rel_w2"] = rel_rows(ws.y[pairs], y_ref)
    acc = torch.zeros(n_tok, h_dim, dtype=torch.float32, device=x.device)
    y = ws.y.view(n_tok, top_k, h_dim)
    for j in range(top_k):  # the combine's order and float32 roundings: rn(acc + rn(w * y))
        keep = ok.view(n_tok, top_k)[:, j : j + 1]
        acc = torch.where(keep, acc + w[:, j : j + 1].float() * y[:, j], acc)
    r["combine_exact"] = bool(
        torch.equal(acc.to(out.dtype).view(torch.uint8), out.view(torch.uint8))
    )
    r["stages_ok"] = bool(
        r["activations_exact"] and r["pair_mask_exact"] and r["requant_exact"]
        and r["combine_exact"] and r["rel_w13"] <= 1e-5 and r["rel_w2"] <= 1e-5
    )  # fmt: skip
    return r


def validate_case(
    name, hidden, inter, n_experts, top_k, n_tok, gen, dtype, resident, pad, scales, tier,
    staged=True,
):  # fmt: skip
    from moet_kernels import ops
    from moet_kernels.loader import load
    from moet_kernels.reference import _moe

    # tier "a>b": an `a` pool (half the experts, drawn independently) preferred over a `b` one
    layers = [
        Layer(hidden, inter, n_experts, gen, resident=0.5 if t != tier.split(">")[-1] else resident,
              scales=scales, tier=t)
        for t in tier.split(">")
    ]  # fmt: skip
    layer = layers[-1]
    ids, w = routing(n_tok, n_experts, top_k, gen)
    x = (torch.randn(n_tok, hidden, device="cuda", generator=gen) * 0.5).to(dtype)
    n_real = max(1, n_tok - pad)
    nr = torch.tensor([n_real], dtype=torch.int32, device="cuda")
    result = {"case": name, "hidden": hidden, "inter": inter, "experts": n_experts,
              "top_k": top_k, "tokens": n_tok, "real_tokens": n_real, "dtype": str(dtype),
              "job_pairs": ops.job_size(n_tok * top_k, n_experts, tier.split(">")),
              "resident": resident, "scales": scales, "tier": tier,
              "slow_tiles": layer.lay.slow_tile_fractions(layer.pool[0])}  # fmt: skip
    miss = torch.zeros(1, dtype=torch.int32, device="cuda")
    routed = torch.zeros(n_experts, dtype=torch.uint8, device="cuda")
    run_op(layers, x, ids, w, nr, miss, routed)  # allocates the workspace
    poison_workspaces(layer)
    miss.zero_()
    routed.zero_()
    out = run_op(layers, x, ids, w, nr, miss, routed)
    torch.cuda.synchronize()
    held = torch.stack([lr.slots >= 0 for lr in layers]).any(0)
    real_ids = ids[:n_real].long()
    want_miss = int((~held[real_ids]).sum())
    want_routed = torch.zeros(n_experts, dtype=torch.uint8, device="cuda")
    want_routed[real_ids.unique()] = 1
    result["miss_count"] = [int(miss.item()), want_miss]
    result["routed_exact"] = bool(torch.equal(routed, want_routed))
    result["finite"] = bool(torch.isfinite(out).all())

    def holder(e):  # the first tier's layer holding expert e
        return next(lr for lr in layers if lr.slots[e] >= 0)

    def experts(e):
        return holder(e).expert(e)

    def skip(e):
        return not bool(held[e])

    def tier_of(e):
        return holder(e).tier

    # the stages' float64 GEMMs are left out under compute-sanitizer (--sanitize), for time
    result["stages"] = None
    if staged:
        key = ops.workspace_key(x.device, n_tok, top_k, layer.lay, n_experts, result["job_pairs"])
        result["stages"] = stages(ops._workspaces[key], held, holder, inter, x, ids, w, out)
    xf = x.float()
    ref_k = _moe(xf, ids.long(), w, inter, experts, skip=skip, mode="kernel", tier=tier_of)
    ref_x = _moe(xf.double(), ids.long(), w, inter, experts, skip=skip, mode="exact", tier=tier_of)
    result["rel_vs_kernel_ref"] = rel(out.float(), ref_k)
    result["rel_vs_exact_ref"] = rel(out.float(), ref_x)
    result["rel_kernel_ref_vs_exact_ref"] = rel(ref_k, ref_x)
    # rerun: byte-identical
    miss.zero_()
    out2 = run_op(layers, x, ids, w, nr, miss, routed)
    result["rerun_identical"] = bool(torch.equal(out.view(torch.uint8), out2.view(torch.uint8)))
    # fewer CTAs in the persistent kernels: byte-identical (no sum depends on the grid)
    result["grid_independent"] = True
    for ctas in (13, 131):
        with load().grid_cap(ctas):
            out_c = run_op(layers, x, ids, w, nr, miss, routed)
        same = torch.equal(out.view(torch.uint8), out_c.view(torch.uint8))
        result["grid_independent"] &= bool(same)
    # graph replay equals eager
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_op(layers, x, ids, w, nr, miss, routed)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out_g = run_op(layers, x, ids, w, nr, miss, routed)
    poison_workspaces(layer)
    miss.zero_()
    g.replay()
    torch.cuda.synchronize()
    result["graph_equals_eager"] = bool(torch.equal(out_g.view(torch.uint8), out.view(torch.uint8)))
    result["graph_miss_count"] = int(miss.item())
    # vs exact: the int8 activations' error, which the kernel-mode reference shares (H200, 7
    # runs: 1.3-1.9e-2 in 728 cases at model shapes; the fixtures' single chunk of 32
    # intermediates spreads wider: 6.6e-2 in 1 of 196 cases, at one token, the rest <= 2.4e-2)
    result["ok"] = bool(
        result["finite"]
        and result["miss_count"][0] == want_miss
        and result["graph_miss_count"] == want_miss
        and result["routed_exact"]
        and (result["stages"] is None or result["stages"]["stages_ok"])
        and result["rel_vs_kernel_ref"] <= 1e-2  # end to end: requant flips included
        and result["rel_vs_exact_ref"] <= (5e-2 if hidden >= 1024 else 0.15)
        and result["rerun_identical"]
        and result["grid_independent"]
        and result["graph_equals_eager"]
    )
    return result


def validate(gen, reduced: bool) -> list[dict]:
    results = []
    if reduced:
        plan = [
            ("fixture", 5, torch.float32, 0.7, 2, "wide", "w2"),
            ("qwen3-235b-tp4", 3, torch.bfloat16, 1.0, 0, "trained", "w2"),
            ("fixture", 80, torch.bfloat16, 0.9, 3, "trained", "w2"),  # 320 pairs: 2 tiles of
            # the job sort (a model shape this large does not finish under racecheck in 10 min)
            ("fixture", 5, torch.float32, 0.7, 2, "wide", "fp4r"),
            ("qwen3-235b-tp4", 3, torch.bfloat16, 1.0, 0, "trained", "fp4r"),
            ("fixture", 80, torch.bfloat16, 0.6, 3, "trained", "fp4r>w2"),
            ("fixture", 5, torch.float32, 0.7, 2, "wide", "fp4x-nvfp4"),
            ("fixture", 80, torch.bfloat16, 0.6, 3, "trained", "fp4x-nvfp4>w2"),
            ("fixture-e16", 64, torch.float32, 0.8, 3, "wide", "w2"),  # prefill jobs
            ("fixture-e16", 64, torch.bfloat16, 0.8, 3, "trained", "fp4r>w2"),
            ("fixture-e16", 64, torch.bfloat16, 0.8, 3, "trained", "fp4x-nvfp4>w2"),
        ]
    else:
        plan = []
        for name in (n for n in SHAPES if n != "fixture-e16"):
            small = name in ("fixture", "qwen3-235b-tp4", "deepseek-v3-tp4")
            for n_tok in (1, 3, 8, 32, 100) if small else (1, 8, 32):
                plan.append((name, n_tok, torch.float32, 1.0, 0, "trained", "w2"))
            plan.append((name, 8, torch.float32, 1.0, 0, "wide", "w2"))  # the slow path
            plan.append((name, 8, torch.bfloat16, 0.6, 3, "wide", "w2"))  # misses, padding, bf16
            plan.append((name, 33, torch.float32, 0.8, 5, "trained", "w2"))
            # a prefill size (many jobs per expert, several tiles of the job sort), with misses
            plan.append((name, 300 if small else 256, torch.bfloat16, 0.9, 7, "trained", "w2"))
        for name in ("glm-5.2", "deepseek-v3-tp4", "qwen3-235b-tp4", "fixture"):  # FP4 rows
            plan.append((name, 1, torch.float32, 1.0, 0, "trained", "fp4r"))
            plan.append((name, 8, torch.float32, 1.0, 0, "wide", "fp4r"))
            plan.append((name, 8, torch.bfloat16, 0.6, 3, "trained", "fp4x-mxfp4"))
            plan.append((name, 33, torch.float32, 0.8, 5, "wide", "fp4r"))
            plan.append((name, 256, torch.bfloat16, 0.9, 7, "trained", "fp4r"))
        for name in ("glm-5.2", "deepseek-v3", "deepseek-v3-tp4", "qwen3-235b-tp4", "fixture"):
            plan.append((name, 1, torch.float32, 1.0, 0, "trained", "fp4x-nvfp4"))  # NVFP4 rows
            plan.append((name, 8, torch.float32, 1.0, 0, "wide", "fp4x-nvfp4"))
            plan.append((name, 8, torch.bfloat16, 0.6, 3, "trained", "fp4x-nvfp4"))
            plan.append((name, 33, torch.float32, 0.8, 5, "wide", "fp4x-nvfp4"))
            plan.append((name, 256, torch.bfloat16, 0.9, 7, "trained", "fp4x-nvfp4"))
        for name in ("glm-5.2", "qwen3-235b-tp4", "fixture"):  # an FP4 pool preferred over W2
            plan.append((name, 1, torch.float32, 0.7, 0, "trained", "fp4r>w2"))
            plan.append((name, 8, torch.bfloat16, 0.6, 3, "wide", "fp4x-mxfp4>w2"))
            plan.append((name, 8, torch.bfloat16, 0.6, 3, "trained", "fp4x-nvfp4>w2"))
            plan.append((name, 33, torch.float32, 0.5, 5, "trained", "fp4r>w2"))
            plan.append((name, 256, torch.bfloat16, 0.8, 7, "trained", "fp4r>w2"))
        # prefill jobs (16 pairs per expert on average): the kernels' _t16 variants; the small
        # shapes' 300- and 256-token cases above take them too
        for tier in ("w2", "fp4r", "fp4x-nvfp4", "fp4r>w2", "fp4x-nvfp4>w2"):
            plan.append(("glm-5.2", 512, torch.bfloat16, 0.9, 7, "trained", tier))
        for tier in ("w2", "fp4r", "fp4x-nvfp4", "fp4x-mxfp4>w2"):
            plan.append(("fixture-e16", 64, torch.float32, 0.8, 5, "wide", tier))
        plan.append(("qwen3-235b-tp4", 300, torch.float32, 1.0, 0, "wide", "w2"))
    for name, n_tok, dtype, resident, pad, scales, tier in plan:
        h, i, e, k = SHAPES[name]
        t0 = time.time()
        r = validate_case(
            name, h, i, e, k, n_tok, gen, dtype, resident, pad, scales, tier, staged=not reduced
        )
        r["seconds"] = round(time.time() - t0, 2)
        results.append(r)
        st = r["stages"] or {"stages_ok": "not checked"}
        print(
            f"{'ok  ' if r['ok'] else 'FAIL'} {tier:10s} {name:16s} T={n_tok:3d} job={r['job_pairs']:2d} {str(dtype)[6:]:8s} "
            f"{scales:7s} slow={r['slow_tiles']['w13']:.2f} res={resident:.1f} rel_k={r['rel_vs_kernel_ref']:.2e} "
            f"rel_x={r['rel_vs_exact_ref']:.2e} (ref_k vs ref_x {r['rel_kernel_ref_vs_exact_ref']:.2e}) "
            f"stages={'ok' if st['stages_ok'] is True else st} w13={st.get('rel_w13', 0):.1e} "
            f"w2={st.get('rel_w2', 0):.1e} "
            f"miss={r['miss_count']} rerun={r['rerun_identical']} grid={r['grid_independent']} "
            f"graph={r['graph_equals_eager']}",
            flush=True,
        )
        torch.cuda.empty_cache()
    return results


def refinement_check() -> dict:
    """The refinement tier's fetch-time expansion (layout.expand_refinement) on the GPU: equal to
    moet-quant's CPU inverse on a GLM-5.2-shaped gate/up projection (2I x H), and its time."""
    import numpy as np

    from moet_kernels.layout import expand_refinement
    from moet_quant import fp4 as qfp4
    from moet_quant.numerics import pack_nibbles

    h, i = SHAPES["glm-5.2"][:2]
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, h))
    w[rng.random(w.shape) < 0.05] = 0.0
    base, nib = qfp4.fp4r(w, "auto")
    rows = 2 * i // 256  # the 256 rows tiled to a whole projection: still a valid plane
    codes = torch.from_numpy(np.tile(base.codes, (rows, 1))).cuda()
    plane = torch.from_numpy(np.tile(qfp4.refinement_plane(nib), (rows, 1))).cuda()
    got = expand_refinement(codes, plane)
    equal = bool(np.array_equal(got.cpu().numpy(), np.tile(pack_nibbles(nib), (rows, 1))))
    times = []
    for _ in range(7):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        expand_refinement(codes, plane)
        en.record()
        en.synchronize()
        times.append(st.elapsed_time(en))
    ms = sorted(times[2:])[2]
    out = {"shape": [2 * i, h], "equal_to_moet_quant": equal, "ms_per_projection": ms,
           "ms_per_expert_estimate": ms * 1.5,  # w2 [H, I] has half w13's weights
           "plane_bytes": int(plane.numel())}  # fmt: skip
    print(f"refinement expansion on the GPU: equal={equal}, {ms:.2f} ms per {2 * i}x{h} projection")
    return out


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_()
    times = []
    for _ in range(25):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n / sorted(times[5:])[len(times[5:]) // 2]


def glm_layers(gen, n_layers=8, scales="trained", tier="w2") -> list:
    """`n_layers` GLM-5.2 MoE layers of distinct pools (one graph over all of them defeats L2)."""
    h, i, e, _ = SHAPES["glm-5.2"]
    return [
        Layer(h, i, e, gen, keep_logical=False, scales=scales, tier=tier) for _ in range(n_layers)
    ]


def time_batch(layers, n_tok, gen, bw) -> dict:
    """One CUDA graph over `layers` at `n_tok` tokens (uniform routing), replayed: the median
    time per layer, routed bytes, their share of the copy bandwidth `bw`, and per-kernel spans."""
    from moet_kernels import ops

    h, _, e, k = SHAPES["glm-5.2"]
    n_layers = len(layers)
    ops._workspaces.clear()
    xs = [torch.randn(n_tok, h, device="cuda", generator=gen).to(torch.bfloat16) for _ in layers]
    routes = [routing(n_tok, e, k, gen) for _ in layers]
    nr = torch.tensor([n_tok], dtype=torch.int32, device="cuda")
    miss = torch.zeros(1, dtype=torch.int32, device="cuda")
    routed = torch.zeros(e, dtype=torch.uint8, device="cuda")

    def step():
        for layer, x, (ids, w) in zip(layers, xs, routes):
            run_op(layer, x, ids, w, nr, miss, routed)

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        g.replay()
    reps = 20
    times = []
    for _ in range(5):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(reps):
            g.replay()
        en.record()
        en.synchronize()
        times.append(st.elapsed_time(en) / 1e3 / (reps * n_layers))
    t_layer = sorted(times)[len(times) // 2]
    distinct = sum(int(ids.unique().numel()) for ids, _ in routes) / n_layers
    bytes_routed = distinct * layers[0].expert_bytes()
    # per-kernel split from the profiler over a few replays
    kernels = {}
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                g.replay()
            torch.cuda.synchronize()
        for evt in prof.key_averages():
            if evt.key.startswith("moet_"):
                dev_total = getattr(evt, "device_time_total", None)
                if dev_total is None:
                    dev_total = evt.cuda_time_total
                kernels[evt.key] = dev_total / max(1, evt.count)
    except Exception as exc:  # the split is informative; the timing above is the result
        kernels = {"error": repr(exc)}
    row = {
        "us_per_layer": t_layer * 1e6,
        "distinct_experts": distinct,
        "routed_bytes": bytes_routed,
        "effective_GBps": bytes_routed / t_layer / 1e9,
        "share_of_copy_bw": bytes_routed / t_layer / bw,
        "kernel_us": kernels,
    }
    for name, figs in VLLM_US.items():
        if n_tok in figs:
            row[f"vs {name} (not same run)"] = t_layer * 1e6 / figs[n_tok]
    print(
        f"T={n_tok:4d}: {t_layer * 1e6:8.1f} us/layer, {distinct:6.1f} experts, "
        f"{bytes_routed / t_layer / 1e9:7.1f} GB/s = {bytes_routed / t_layer / bw:.2f} of copy; "
        + " ".join(f"{kk}={v:.1f}" for kk, v in kernels.items() if isinstance(v, float)),
        flush=True,
    )
    return row


def time_layers(gen, n_layers=8, batches=(1, 8, 32, 512), scales="trained", tier="w2") -> dict:
    layers = glm_layers(gen, n_layers, scales, tier)
    bw = copy_bandwidth()
    out = {"copy_bandwidth_GBps": bw / 1e9, "layers_in_graph": n_layers, "scales": scales,
           "tier": tier,
           "kernel_us": "profiler span per kernel: with PDL it includes the wait for the previous "
                        "kernel, so only us_per_layer is a time",
           "slow_tiles": layers[0].lay.slow_tile_fractions(layers[0].pool[0]),
           "batches": {n_tok: time_batch(layers, n_tok, gen, bw) for n_tok in batches}}  # fmt: skip
    return out


def prefill_ab(gen, tokens, tiers=("w2", "fp4r")) -> dict:
    """Prefill sizes timed with the kernels' decode jobs (8 pairs, forced) and with their prefill
    jobs (16 pairs: two n-tiles per decoded fragment), same run, same layers."""
    from moet_kernels import ops

    out = {}
    for tier in tiers:
        layers = glm_layers(gen, tier=tier)
        bw = copy_bandwidth()
        rows = out[tier] = {"copy_bandwidth_GBps": bw / 1e9}
        default = ops.PREFILL_PAIRS_PER_EXPERT
        for n_tok in tokens:
            for label, threshold in (("jobs of 8", 1 << 30), ("jobs of 16", default)):
                ops.PREFILL_PAIRS_PER_EXPERT = threshold  # 1 << 30: never prefill jobs
                try:
                    print(f"{tier} {label}:", end=" ")
                    rows[f"{n_tok} tokens, {label}"] = time_batch(layers, n_tok, gen, bw)
                finally:
                    ops.PREFILL_PAIRS_PER_EXPERT = default
        del layers
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="result folder (default bench/results/kernels/)")
    ap.add_argument("--only", choices=("validate", "time", "refine"))
    ap.add_argument("--sanitize", action="store_true", help="reduced validation only")
    ap.add_argument("--seed", type=int, default=None, help="default: fresh each run")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 512], help="time these")
    ap.add_argument("--no-wide", action="store_true", help="skip the wide-scales timing")
    ap.add_argument("--no-fp4", action="store_true", help="skip the FP4 (fp4r, NVFP4) timing")
    ap.add_argument("--prefill", type=int, nargs="*", default=[],
                    help="also time these token counts with jobs of 8 and of 16 pairs")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench(kernels) needs a CUDA GPU; none here", file=sys.stderr)
        return 2
    build_cubin()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    report = {"environment": provenance([sys.executable, *sys.argv]), "seed": seed}
    if args.sanitize:
        res = validate(gen, reduced=True)
        return 0 if all(r["ok"] for r in res) else 1
    ok = True
    if args.only == "refine":
        report["refinement"] = refinement_check()
        ok = report["refinement"]["equal_to_moet_quant"]
    if args.only in (None, "validate"):
        report["validation"] = validate(gen, reduced=False)
        report["refinement"] = refinement_check()
        ok = (
            all(r["ok"] for r in report["validation"])
            and report["refinement"]["equal_to_moet_quant"]
        )
        print(f"validation: {sum(r['ok'] for r in report['validation'])}/"
              f"{len(report['validation'])} cases ok")  # fmt: skip
    if args.only in (None, "time"):
        report["timing"] = time_layers(gen, batches=args.batches)
        if not args.no_wide:
            print("worst case: every block exponent drawn independently (mostly slow tiles)")
            report["timing_wide_scales"] = time_layers(gen, batches=(1, 8), scales="wide")
        if not args.no_fp4:
            print("FP4 rows (fp4r: e2m1, UE8M0 per 32; 4.25 bits per weight)")
            report["timing_fp4r"] = time_layers(gen, batches=(1, 8, 32), tier="fp4r")
            print(
                "NVFP4 rows (fp4x-nvfp4: e2m1, e4m3 per 16, float32 per row; 4.5 bits per weight)"
            )
            report["timing_nvfp4"] = time_layers(gen, batches=(1, 8, 32), tier="fp4x-nvfp4")
        if args.prefill:
            report["timing_prefill"] = prefill_ab(gen, args.prefill)
    report["nvcc_flags"] = os.environ.get("MOET_NVCC_FLAGS", "")
    write_result("kernels", report, machine(), args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
