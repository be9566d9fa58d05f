"""The sm_90a wgmma probe (bench/probes/wgmma_probe.cu) against moet_w13, same run, on the H200.

    python3 bench/probes/wgmma_probe.py [--out DIR]

moet_w13 runs a GLM-5.2 layer's gate/up at batch 8 (the route kernel's jobs for a uniform routing);
the probe runs the same number of jobs x 64-row units x 48 chunks of 128 over random codes and
exponent fields (the shipped layout's code bytes and scale-word size). Both are timed as 20
back-to-back launches; the probe's output is checked against float64 on four work items. The
result goes to <out>/wgmma-probe.json with the run's provenance.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT / "bench")]
import kernels as kb  # noqa: E402  (bench/kernels.py: sys.path for the packages, Layer, routing)
import torch  # noqa: E402
from provenance import provenance  # noqa: E402

CODE_CHUNK, SCALE_CHUNK, UNITS, LEVELS = 2048, 264, 64, (-4.0, -1.0, 1.0, 4.0)


def events_us(launch, reps=20) -> float:
    launch()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(reps):
        launch()
    en.record()
    en.synchronize()
    return st.elapsed_time(en) * 1e3 / reps


def baseline(gen) -> dict:
    """moet_w13 alone on the route kernel's jobs for a GLM-5.2 layer at batch 8."""
    from moet_kernels import ops
    from moet_kernels.loader import load

    h, i, e, k = kb.SHAPES["glm-5.2"]
    layer = kb.Layer(h, i, e, gen, keep_logical=False)
    ids, w = kb.routing(8, e, k, gen)
    x = torch.randn(8, h, device="cuda", generator=gen).to(torch.bfloat16)
    nr = torch.tensor([8], dtype=torch.int32, device="cuda")
    miss = torch.zeros(1, dtype=torch.int32, device="cuda")
    routed = torch.zeros(e, dtype=torch.uint8, device="cuda")
    kb.run_op(layer, x, ids, w, nr, miss, routed)
    torch.cuda.synchronize()
    (ws,) = ops._workspaces.values()
    lay, mod = layer.lay, load()
    i32, i64 = ctypes.c_int, ctypes.c_longlong

    def p(t, off=0):
        return ctypes.c_void_p(t.data_ptr() + off)

    args = [p(layer.pool), i64(layer.pool.stride(0)), ctypes.c_void_p(None), i64(0),
            i64(lay.offsets["w13_codes"]), i64(lay.offsets["w13_scales"]), i32(i // 32),
            i32(lay.hidden_p // 128), p(ws.xq), p(ws.xs), i32(lay.hidden_p), i32(k),
            p(ws.n_jobs, 4), p(ws.job_slot), p(ws.job_pairs), p(ws.h), i32(lay.inter_p)]  # fmt: skip
    grid = mod.persistent_grid("moet_w13", 128, ws.max_jobs * (i // 32))
    us = events_us(lambda: mod.launch("moet_w13", grid, 128, args))
    jobs = int(ws.n_jobs[2])
    nbytes = jobs * (lay.sizes["w13_codes"] + lay.sizes["w13_scales"])
    return {"kernel": "moet_w13", "jobs": jobs, "us": us, "bytes": nbytes, "grid": grid}


def decode_map():
    """Per (64-row group, chunk) code position: byte, bit, row 0..63, k 0..127, scale word byte."""
    rows = []
    for rt in range(4):
        for g in range(8):
            for t in range(4):
                for tt in range(4):
                    for j in range(4):
                        for i in range(4):
                            byte = rt * 512 + (4 * g + t) * 16 + tt * 4
                            bit = 16 * (j // 2) + 4 * i + 2 * (j % 2)
                            row, kk = 16 * rt + g + 8 * (j % 2), 32 * t + 8 * tt + 4 * (j // 2) + i
                            word = rt * 64 + g * 8 + 4 * (j % 2)
                            rows.append((byte + bit // 8, bit % 8, row, kk, word, t))
    return np.array(rows, dtype=np.int64).T


def reference(codes, scales, x, job, u, nchunks, dmap) -> np.ndarray:
    """float64 [8, 64]: the probe's item (job, u) from its bytes."""
    byte, shift, row, kk, word, t = dmap
    c = codes[job, u].cpu().numpy().astype(np.int64)  # [nchunks, 2048]
    s = scales[job, u].cpu().numpy()  # [nchunks, 264]
    words = s[:, :256].copy().view("<u4").astype(np.int64)  # [nchunks, 64]
    w = np.zeros((64, nchunks * 128))
    for ch in range(nchunks):
        code = (c[ch, byte] >> shift) & 3
        field = (words[ch, word // 4] >> (5 * t)) & 31
        w[row, ch * 128 + kk] = np.array(LEVELS)[code] * np.exp2(field - 6.0)
    xf = x[job].float().cpu().numpy().astype(np.float64)  # [8, K]
    return xf @ w.T


def probe(n_jobs: int, hidden: int, gen) -> dict:
    import cupy

    nchunks = hidden // 128
    assert nchunks % 8 == 0, "the probe streams chunks in pairs of 4"
    cubin = Path(tempfile.mkdtemp(prefix="wgmma-probe-")) / "probe.cubin"
    cmd = ["nvcc", "-cubin", "-O3", "-arch=sm_90a", "-Xptxas", "-v", "-o", str(cubin),
           str(HERE / "wgmma_probe.cu")]  # fmt: skip
    ptxas = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    fn = cupy.RawModule(path=str(cubin)).get_function("probe_w13")
    smem = nchunks * 1024
    fn.max_dynamic_shared_size_bytes = smem
    dev = "cuda"
    codes = torch.randint(0, 256, (n_jobs, UNITS, nchunks, CODE_CHUNK), dtype=torch.uint8,
                          device=dev, generator=gen)  # fmt: skip
    fields = torch.randint(0, 13, (n_jobs, UNITS, nchunks, 64, 4), device=dev, generator=gen)
    words = (fields << (5 * torch.arange(4, device=dev))).sum(-1).to(torch.int32)
    scales = torch.zeros(n_jobs, UNITS, nchunks, SCALE_CHUNK, dtype=torch.uint8, device=dev)
    scales[..., :256] = words.view(torch.uint8).view(n_jobs, UNITS, nchunks, 256)
    x = torch.randn(n_jobs, 8, hidden, device=dev, generator=gen).to(torch.float8_e4m3fn)
    xperm = (
        x.view(torch.uint8)
        .view(n_jobs, 8, nchunks, 4, 4, 2, 4)  # k = 128 c + 32 t + 8 tt + 4 kh + i
        .permute(0, 2, 4, 5, 1, 3, 6)  # [job, c, tt, kh, n, t, i]
        .contiguous()
    )
    xscale = torch.rand(n_jobs, 8, device=dev, generator=gen) + 0.5
    out = torch.full((n_jobs, 8, UNITS * 64), float("nan"), device=dev)
    grid = 3 * torch.cuda.get_device_properties(0).multi_processor_count
    args = tuple(np.uint64(t.data_ptr()) for t in (codes, scales, xperm, xscale)) + (
        np.int32(n_jobs),
        np.int32(UNITS),
        np.int32(nchunks),
        np.uint64(out.data_ptr()),
    )

    def launch():
        fn((grid,), (128,), args, shared_mem=smem)

    us = events_us(launch)
    dmap = decode_map()
    errs = []
    for job, u in ((0, 0), (0, UNITS - 1), (n_jobs - 1, 1), (n_jobs // 2, UNITS // 2)):
        want = reference(codes, scales, x, job, u, nchunks, dmap) * xscale[job].cpu().double()[
            :, None].numpy()  # fmt: skip
        got = out[job, :, u * 64 : (u + 1) * 64].cpu().double().numpy()
        errs.append(float(np.linalg.norm(got - want) / np.linalg.norm(want)))
    nbytes = n_jobs * UNITS * nchunks * (CODE_CHUNK + SCALE_CHUNK)
    regs = [line.strip() for line in ptxas.splitlines() if "registers" in line]
    return {"kernel": "probe_w13 (wgmma e4m3)", "jobs": n_jobs, "us": us, "bytes": nbytes,
            "grid": grid, "rel_err_vs_float64": errs, "finite": bool(torch.isfinite(out).all()),
            "ptxas": regs}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    kb.build_cubin()
    gen = torch.Generator(device="cuda").manual_seed(1)
    bw = kb.copy_bandwidth()
    base = baseline(gen)
    pr = probe(base["jobs"], kb.SHAPES["glm-5.2"][0], gen)
    for r in (base, pr):
        r["GBps"] = r["bytes"] / r["us"] / 1e3
        r["share_of_copy_bw"] = r["bytes"] / (r["us"] * 1e-6) / bw
        print(f"{r['kernel']:24s} {r['jobs']} jobs: {r['us']:8.1f} us, {r['GBps']:7.1f} GB/s = "
              f"{r['share_of_copy_bw']:.2f} of copy")  # fmt: skip
    print(f"probe vs float64: {pr['rel_err_vs_float64']}, finite={pr['finite']}, {pr['ptxas']}")
    report = {"environment": provenance([sys.executable, *sys.argv]), "copy_GBps": bw / 1e9,
              "baseline": base, "probe": pr, "probe_over_baseline_time": pr["us"] / base["us"]}  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "wgmma-probe.json").write_text(json.dumps(report, indent=1))
    # ~1.5e-3 is Hopper's FP8 wgmma accumulation over K = 6144 without promotion (docs/kernels-design.md);
    # a wrong fragment or B layout gives errors of order 1
    ok = pr["finite"] and max(pr["rel_err_vs_float64"]) < 1e-2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
