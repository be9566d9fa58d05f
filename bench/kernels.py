"""moet-kernels on a GPU: build and time the W2 MoE op (issue 5); validation runs from here too.

    python bench/kernels.py [--out DIR] [--only validate|time|refine] [--sanitize] [--seed N]
        [--shape glm-5.2|glm-4.5-air|...] [--batches 1 8 32 512]

Run by `nox -s bench -- kernels-vs-vllm` or directly on the GPU machine (bench/h200/kernels.sh). Builds the
cubin for the GPU with nvcc (unless MOET_KERNELS_CUBIN_DIR points at built ones), then:

- validate: the kernels' validation lives in moet_kernels.testing (synthetic layers, the cases,
  the checks; what they check: docs/kernels.md "Validation"); the GPU test suite asserts it, one
  test per case (`pytest -m gpu packages/moet-kernels/tests/test_gpu_kernels.py`). Here it runs
  the same cases (`VALIDATION_CASES`) to put their measurements in the result file; the run's
  seed (--seed, or fresh) is the suite's GPU_TEST_SEED: the same seed draws the same inputs.
- time: a GLM-5.2 MoE layer (H 6144, I 2048, 256 experts, top-8; `--shape` another of SHAPES,
  e.g. glm-4.5-air, the serving benchmark's) at batch 1, 8, 32 and a prefill size, one graph over 8 layers of distinct pools (L2 defeated), uniform routing, weight scales
  shaped like trained weights' (moet_kernels.testing.SCALES; again at batch 1 and 8 with "wide"
  scales, the slow path's worst case; and at batch 1, 8, 32 with fp4r and with NVFP4 rows; with
  --prefill N..., those token counts with jobs of 8 pairs against jobs of 16, W2 and fp4r rows);
  effective bandwidth on routed expert bytes as a share of the device-to-device copy bandwidth
  measured in the same run; per-kernel times from the profiler; vLLM 0.24's kernels from
  design.md, marked "not same run" (bench/h200/vllm_moe.py times them in the same device run
  where vLLM is staged: bench/h200/kernels.sh runs it).
- --sanitize: the reduced validation (`SANITIZER_CASES`, no float64 stages) for compute-sanitizer
  (memcheck, racecheck): the sanitizer wraps this process, which pytest would not fit in.

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
from provenance import machine, provenance  # noqa: E402  (bench/, the script's folder)
from results_io import write_result  # noqa: E402

# The synthetic layers and the validation live in moet_kernels.testing, shared with the GPU test
# suite; bench/h200's probes and bench/residency_gpu.py import Layer, routing, run_op, SHAPES and
# random_scales from here.
from moet_kernels.testing import (  # noqa: E402
    SANITIZER_CASES,
    SHAPES,
    VALIDATION_CASES,
    random_scales,  # noqa: F401  (re-exported: bench/residency_gpu.py)
    refinement_check,
    routing,
    run_op,
    validate,
)
from moet_kernels.testing import SyntheticLayer as Layer  # noqa: E402

# vLLM 0.24 on the H200, GLM-5.2 layer, graph replays, uniform routing (design.md): not same run.
VLLM_US = {
    "bf16 Triton fused_moe": {1: 175, 8: 1090, 32: 2738},
    "FP8 block-128": {1: 107, 8: 596, 32: 1473},
    "Marlin W4A16": {1: 82, 8: 409, 32: 1063},
}


def nvcc_cubin(flags: str, source: Path | None = None) -> tuple[subprocess.Popen, Path]:
    """Starts nvcc on csrc/w2_moe.cu (or `source`, another version of it) for this GPU with extra
    `flags` (-D ...), into a new folder: (the process, the folder), which `wait_cubin` finishes.
    Several can compile side by side."""
    out = Path(tempfile.mkdtemp(prefix="moet-cubins-"))
    major, minor = torch.cuda.get_device_capability()
    arch = {(9, 0): "90a", (10, 0): "100a", (12, 0): "120a"}[(major, minor)]
    src = source or ROOT / "packages" / "moet-kernels" / "csrc" / "w2_moe.cu"
    cmd = ["nvcc", "-cubin", "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas",
           "-v", *flags.split(), "-o", str(out / f"w2_moe.sm_{arch}.cubin"), str(src)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out


def wait_cubin(job: tuple[subprocess.Popen, Path]) -> Path:
    """The folder of a cubin `nvcc_cubin` started; exits with nvcc's errors if it failed."""
    proc, out = job
    _, err = proc.communicate()
    if proc.returncode:
        sys.exit(f"nvcc failed:\n{err}")
    return out


def build_cubin() -> None:
    """The cubin of this checkout (with $MOET_NVCC_FLAGS) for the loader, unless
    MOET_KERNELS_CUBIN_DIR already names built ones."""
    if os.environ.get("MOET_KERNELS_CUBIN_DIR"):
        return
    t0 = time.time()
    out = wait_cubin(nvcc_cubin(os.environ.get("MOET_NVCC_FLAGS", "")))
    print(f"built the cubin in {time.time() - t0:.1f} s")
    os.environ["MOET_KERNELS_CUBIN_DIR"] = str(out)


def _print(line: str) -> None:
    print(line, flush=True)


def refinement() -> dict:
    """moet_kernels.testing.refinement_check, with its line."""
    r = refinement_check()
    print(f"refinement expansion on the GPU: equal={r['equal_to_moet_quant']}, "
          f"{r['ms_per_projection']:.2f} ms per {r['shape'][0]}x{r['shape'][1]} projection")  # fmt: skip
    return r


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


def glm_layers(gen, n_layers=8, scales="trained", tier="w2", shape="glm-5.2") -> list:
    """`n_layers` MoE layers of `shape` (SHAPES; GLM-5.2's by default) with distinct pools (one
    graph over all of them defeats L2)."""
    h, i, e, _ = SHAPES[shape]
    return [
        Layer(h, i, e, gen, keep_logical=False, scales=scales, tier=tier) for _ in range(n_layers)
    ]


def graph_seconds(step, rounds: int = 5, reps: int = 20) -> tuple:
    """`step` (CUDA work, run once eagerly, once on a side stream, then captured) as a CUDA
    graph, replayed: (the graph, the median seconds of a replay over `rounds` rounds of `reps`)."""
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
    times = []
    for _ in range(rounds):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(reps):
            g.replay()
        en.record()
        en.synchronize()
        times.append(st.elapsed_time(en) / 1e3 / reps)
    return g, sorted(times)[len(times) // 2]


def time_batch(layers, n_tok, gen, bw, shape="glm-5.2") -> dict:
    """One CUDA graph over `layers` at `n_tok` tokens (uniform routing), replayed: the median
    time per layer, routed bytes, their share of the copy bandwidth `bw`, and per-kernel spans."""
    from moet_kernels import ops

    h, _, e, k = SHAPES[shape]
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

    g, t_step = graph_seconds(step)
    t_layer = t_step / n_layers
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


def time_layers(
    gen, n_layers=8, batches=(1, 8, 32, 512), scales="trained", tier="w2", shape="glm-5.2"
) -> dict:
    layers = glm_layers(gen, n_layers, scales, tier, shape)
    bw = copy_bandwidth()
    out = {"copy_bandwidth_GBps": bw / 1e9, "layers_in_graph": n_layers, "scales": scales,
           "shape": shape,
           "tier": tier,
           "kernel_us": "profiler span per kernel: with PDL it includes the wait for the previous "
                        "kernel, so only us_per_layer is a time",
           "slow_tiles": layers[0].lay.slow_tile_fractions(layers[0].pool[0]),
           "batches": {n_tok: time_batch(layers, n_tok, gen, bw, shape)
                       for n_tok in batches}}  # fmt: skip
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
    ap.add_argument("--shape", choices=sorted(SHAPES), default="glm-5.2",
                    help="the timed layers' shape (moet_kernels.testing.SHAPES)")  # fmt: skip
    ap.add_argument("--no-wide", action="store_true", help="skip the wide-scales timing")
    ap.add_argument("--no-fp4", action="store_true", help="skip the FP4 (fp4r, NVFP4) timing")
    ap.add_argument("--prefill", type=int, nargs="*", default=[],
                    help="also time these token counts with jobs of 8 and of 16 pairs")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU; none here", file=sys.stderr)
        return 2
    build_cubin()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device="cuda").manual_seed(seed)  # the timing's layers and routings
    report = {"environment": provenance([sys.executable, *sys.argv]), "seed": seed}
    if args.sanitize:  # float64 stages left out: they would dominate the sanitizer's time
        res = validate(SANITIZER_CASES, seed, staged=False, log=_print)
        return 0 if all(r["ok"] for r in res) else 1
    ok = True
    if args.only == "refine":
        report["refinement"] = refinement()
        ok = report["refinement"]["equal_to_moet_quant"]
    if args.only in (None, "validate"):
        report["validation"] = validate(VALIDATION_CASES, seed, log=_print)
        report["refinement"] = refinement()
        ok = (
            all(r["ok"] for r in report["validation"])
            and report["refinement"]["equal_to_moet_quant"]
        )
        print(f"validation: {sum(r['ok'] for r in report['validation'])}/"
              f"{len(report['validation'])} cases ok (seed {seed})")  # fmt: skip
    if args.only in (None, "time"):
        report["timing"] = time_layers(gen, batches=args.batches, shape=args.shape)
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
