"""vLLM's own fused-MoE kernels on one GLM-5.2 MoE layer, timed like bench/kernels.py times ours.

    python3 bench/h200/vllm_moe.py [--out DIR] [--batches 1 8 32] [--layers 2]

On the H200 machine with vLLM 0.24.0 staged as in ../shared/gpu/vllm-0.24/README.md (first
`export PYTHONPATH=~/site PATH=~/site/bin:$PATH`). Writes DIR/vllm_moe.json (DIR defaults to $OUT,
else .) and prints one line per path and batch. As a module: `vllm_moe_times(batches)`.

Layer: hidden 6144, intermediate 2048 per expert (w13 [2I, H], gate then up; w2 [H, I]), 256
experts, top-8, SiLU-and-mul. Routing is an input (no router GEMM): per token the top-8 of uniform
random scores (distinct experts), random weights normalized to sum 1. Paths:

- "bf16 Triton fused_moe": `fused_experts`, bf16 weights (19.3 GB a layer);
- "FP8 block-128": `fused_experts` on e4m3 weights with 128x128 block scales and per-token-group
  (128) FP8 activation quantization, as vLLM runs DeepSeek-style FP8 checkpoints with Triton;
- "Marlin W4A16": `fused_marlin_moe`, GPTQ int4 (uint4b8, group 128, bf16 scales) repacked by
  `ops.gptq_marlin_moe_repack` / `marlin_moe_permute_scales`, bf16 activations.

Weights are random normal * 0.02 (bf16), quantized with plain torch code (values do not matter for
speed). Timing: `--layers` distinct weight sets (layers), each with its own inputs and routing, are
called one after another inside one CUDA graph, captured after warm-up; the graph is replayed many
times and the median replay time (CUDA events) divided by the layer count is the us per layer.
A batch-1 layer reads ~8 experts (>= 150 MB even in int4), so the L2 (50 MB) holds nothing of a
layer when its turn comes again. Checked against the vLLM 0.24.0 sources (fused_moe.py,
config.py, experts/marlin_moe.py, oracle/int_wna16.py, _custom_ops.py); older and newer call
forms are handled where they differ (quant_config vs keyword flags, the Marlin kernel's module,
gptq_marlin_moe_repack's perm argument, fused_marlin_moe's gating_output).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import statistics
from pathlib import Path

import torch

H, INTER, E, TOP_K = 6144, 2048, 256, 8
BLOCK = 128  # FP8 block edge and int4 group size
CHUNK = 16  # experts quantized at a time (bounds the float temporaries)
REPLAYS = 100


def _randn(shape, gen):
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(0.02)


def _routing(n_tok, gen):
    ids = torch.rand(n_tok, E, device="cuda", generator=gen).topk(TOP_K, dim=1).indices
    w = torch.rand(n_tok, TOP_K, device="cuda", generator=gen)
    return ids.to(torch.int32), w / w.sum(dim=1, keepdim=True)


def _quantized(shape, gen, quant):
    """quant() over CHUNK experts at a time of random [E, n, k] weights; outputs joined on E."""
    parts = [quant(_randn((min(CHUNK, E - e0), *shape[1:]), gen)) for e0 in range(0, E, CHUNK)]
    return tuple(torch.cat(p) for p in zip(*parts))


def _fp8_block(w):
    """[e, n, k] -> e4m3 [e, n, k], float32 scales [e, n/128, k/128] (per 128x128 block)."""
    e, n, k = w.shape
    fmax = torch.finfo(torch.float8_e4m3fn).max
    b = w.float().view(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    s = b.abs().amax(dim=(2, 4), keepdim=True).clamp(min=1e-12) / fmax
    q = (b / s).clamp(-fmax, fmax).to(torch.float8_e4m3fn).view(e, n, k)
    return q, s.reshape(e, n // BLOCK, k // BLOCK).contiguous()


def _gptq_int4(w):
    """[e, n, k] -> GPTQ int32 [e, k/8, n] (8 codes along k, +8 offset), bf16 scales [e, k/128, n]."""
    e, n, k = w.shape
    g = w.float().transpose(1, 2).reshape(e, k // BLOCK, BLOCK, n)
    s = g.abs().amax(dim=2, keepdim=True).clamp(min=1e-8) / 7
    q = ((g / s).round().clamp(-8, 7) + 8).to(torch.int64).view(e, k // 8, 8, n)
    shifts = torch.arange(0, 32, 4, device=w.device, dtype=torch.int64).view(1, 1, 8, 1)
    packed = (q << shifts).sum(dim=2)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed, s.view(e, k // BLOCK, n).to(torch.bfloat16)


def _fused_experts():
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    return fused_experts


def _bf16_path():
    fused_experts = _fused_experts()

    def make(gen):
        return _randn((E, 2 * INTER, H), gen), _randn((E, H, INTER), gen)

    def run(layer, x, ids, w):
        return fused_experts(
            hidden_states=x, w1=layer[0], w2=layer[1], topk_weights=w, topk_ids=ids
        )

    return make, run


def _fp8_path():
    fused_experts = _fused_experts()

    def make(gen):
        w13, s13 = _quantized((E, 2 * INTER, H), gen, _fp8_block)
        w2, s2 = _quantized((E, H, INTER), gen, _fp8_block)
        if "quant_config" in inspect.signature(fused_experts).parameters:  # modular-kernel era
            from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

            qc = fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2, block_shape=[BLOCK, BLOCK])
            kw = {"quant_config": qc}
        else:  # the older keyword style
            kw = {"use_fp8_w8a8": True, "w1_scale": s13, "w2_scale": s2, "block_shape": [BLOCK] * 2}
        return w13, w2, kw

    def run(layer, x, ids, w):
        w13, w2, kw = layer
        return fused_experts(hidden_states=x, w1=w13, w2=w2, topk_weights=w, topk_ids=ids, **kw)

    return make, run


def _marlin_path():
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        marlin_moe_permute_scales,
    )
    from vllm.scalar_type import scalar_types

    try:  # vLLM >= the experts/ split (0.24 has it here)
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
    except ImportError:
        from vllm.model_executor.layers.fused_moe.fused_marlin_moe import fused_marlin_moe

    repack_params = inspect.signature(ops.gptq_marlin_moe_repack).parameters
    marlin_params = inspect.signature(fused_marlin_moe).parameters

    def repack(qw, s, size_k, size_n):
        kw = {"b_q_weight": qw, "size_k": size_k, "size_n": size_n, "num_bits": 4}
        if "perm" in repack_params:  # no act-order: an empty permutation per expert
            kw["perm"] = torch.empty((qw.shape[0], 0), dtype=torch.int32, device=qw.device)
        q = ops.gptq_marlin_moe_repack(**kw)
        s = marlin_moe_permute_scales(s=s, size_k=size_k, size_n=size_n, group_size=BLOCK)
        return q, s

    def make(gen):
        w13, s13 = repack(*_quantized((E, 2 * INTER, H), gen, _gptq_int4), H, 2 * INTER)
        w2, s2 = repack(*_quantized((E, H, INTER), gen, _gptq_int4), INTER, H)
        return w13, w2, s13, s2

    extra = {}
    if "gating_output" in marlin_params:  # a positional parameter before topk_weights until ~0.2x
        extra["gating_output"] = None
    if "moe_sum" in marlin_params:  # the CUDA reduction vLLM's MarlinExperts passes
        extra["moe_sum"] = lambda inp, out, *_: ops.moe_sum(inp, out)

    def run(layer, x, ids, w):
        w13, w2, s13, s2 = layer
        return fused_marlin_moe(
            hidden_states=x, w1=w13, w2=w2, bias1=None, bias2=None, w1_scale=s13, w2_scale=s2,
            topk_weights=w, topk_ids=ids, quant_type_id=scalar_types.uint4b8.id, **extra,
        )  # fmt: skip

    return make, run


PATHS = {
    "bf16 Triton fused_moe": _bf16_path,
    "FP8 block-128": _fp8_path,
    "Marlin W4A16": _marlin_path,
}


def _graph_us(step, n_calls, warmup=3):
    """Median us per call of step() (n_calls layer calls) replayed in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (Triton JIT, lazy inits)
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(warmup):
        graph.replay()
    events = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return 1e3 * statistics.median(s.elapsed_time(e) for s, e in events) / n_calls


def _time_path(factory, batches, n_layers, seed) -> dict:
    make, run = factory()
    wgen = torch.Generator(device="cuda").manual_seed(seed + 1)
    layers = [make(wgen) for _ in range(n_layers)]
    torch.cuda.synchronize()
    gen = torch.Generator(device="cuda").manual_seed(seed)  # same inputs and routing every path
    out = {}
    for n_tok in batches:
        xs = [
            torch.randn(n_tok, H, device="cuda", generator=gen).to(torch.bfloat16) for _ in layers
        ]
        routes = [_routing(n_tok, gen) for _ in layers]

        def step(xs=xs, routes=routes):
            for layer, x, (ids, w) in zip(layers, xs, routes):
                run(layer, x, ids, w)

        out[n_tok] = _graph_us(step, n_layers)
    return out


def versions() -> dict:
    v = {"vllm": None, "torch": torch.__version__, "triton": None, "cuda": torch.version.cuda}
    with contextlib.suppress(Exception):
        import vllm

        v["vllm"] = vllm.__version__
        from vllm import _version

        v["vllm_commit"] = _version.__commit_id__
    with contextlib.suppress(Exception):
        import triton

        v["triton"] = triton.__version__
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name()
    return v


def _vllm_config_context():
    """vLLM's kernel tests run inside a default VllmConfig (avoids its 'config not set' warnings)."""
    try:
        from vllm.config import VllmConfig, set_current_vllm_config

        return set_current_vllm_config(VllmConfig())
    except Exception:
        return contextlib.nullcontext()


@torch.inference_mode()
def vllm_moe_times(batches=(1, 8, 32), n_layers=2, seed=0) -> dict:
    """{path: {batch: us per layer} or {"error": repr}, ..., "versions": {...}}."""
    results = {}
    with _vllm_config_context():
        for name, factory in PATHS.items():
            try:
                results[name] = _time_path(factory, batches, n_layers, seed)
            except Exception as exc:  # one failing path must not stop the others
                results[name] = {"error": repr(exc)}
            gc.collect()
            torch.cuda.empty_cache()
    results["versions"] = versions()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or ".", help="result folder")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--layers", type=int, default=2, help="distinct weight sets in the graph")
    args = ap.parse_args()
    res = vllm_moe_times(tuple(args.batches), n_layers=args.layers)
    for name in PATHS:
        if "error" in res[name]:
            print(f"{name:22s} error: {res[name]['error']}", flush=True)
            continue
        for n_tok, us in res[name].items():
            print(f"{name:22s} T={n_tok:3d}: {us:8.1f} us/layer", flush=True)
    print(json.dumps(res["versions"]))
    res["setup"] = {"shape": {"hidden": H, "inter": INTER, "experts": E, "top_k": TOP_K},
                    "layers_in_graph": args.layers, "replays": REPLAYS}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_moe.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out / 'vllm_moe.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
