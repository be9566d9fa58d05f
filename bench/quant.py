"""Re-quantization throughput (source MB/s per core) vs a cold read of the same bytes.

Run through nox: `nox -s bench -- quant-throughput`. For each source format it writes one synthetic
Qwen3-235B-shaped MoE layer (H 4096, I 1536, 4 experts), then in the same run measures:
  cold read   the shards read after evicting them from the page cache (posix_fadvise DONTNEED)
  spec path   the literal float64 quantizer on the decoded weights (the baseline)
  fast path   moet-quant's integer quantizer (what `convert` uses), from the page cache
  convert     `moet-quant convert` end to end (read, quantize, write, fsync)
on one core. Results: bench/results/quant/<host>-<date>.json and a table on stdout.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"

import numpy as np  # noqa: E402
from results_io import write_result  # noqa: E402

from moet_quant import __version__, checkpoint, convert, synth, w2  # noqa: E402

TARGET_MB_S = 200.0
FORMATS = ["bf16", "fp8-block", "nvfp4", "int4-pack", "mxfp4"]
SHAPE = {"hidden": 4096, "inter": 1536, "n_experts": 4, "n_layers": 1}


def evict(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_read(paths) -> tuple[int, float]:
    evict(paths)
    n, t0 = 0, time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                n += len(chunk)
    return n, time.perf_counter() - t0


def best(fn, repeat=3) -> float:
    """Best-of CPU time of this process (one thread): per-core cost, robust to other load."""
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def bench_format(fmt: str, root: Path) -> dict:
    family = "gpt-oss" if fmt == "mxfp4" else "qwen3-moe"
    src = synth.write_checkpoint(root / fmt, family, fmt, shards=1, **SHAPE)
    ck = checkpoint.open_checkpoint(src)
    shards = [ck.path / s for s in ck.st.shard_names()]
    expert_bytes = ck.info.bytes["source_experts"]
    read_bytes, read_s = cold_read(shards)

    def fast():
        for s in ck.sources:
            if fmt == "mxfp4":
                convert._quantize_projection(s, convert.ConvertOptions())
            else:
                w2.quantize(s.load())

    def spec():
        for s in ck.sources:
            w2.quantize_f64(s.dequant())

    fast()  # warm the page cache and the tables
    fast_s = best(fast)
    spec_s = best(spec, repeat=1)
    out = root / f"{fmt}-out"
    t0 = time.perf_counter()
    convert.convert(src, out, progress=False)
    convert_s = time.perf_counter() - t0
    ck.close()
    mb = expert_bytes / 1e6
    return {
        "format": fmt,
        "projections": ck.info.n_projections,
        "expert_source_bytes": expert_bytes,
        "cold_read_MB_s": read_bytes / 1e6 / read_s,
        "spec_path_MB_s": mb / spec_s,
        "fast_path_MB_s": mb / fast_s,
        "fast_vs_spec": spec_s / fast_s,
        "fast_vs_target": mb / fast_s / TARGET_MB_S,
        "fast_vs_cold_read": (mb / fast_s) / (read_bytes / 1e6 / read_s),
        "convert_end_to_end_MB_s": (ck.info.bytes["source_experts"] + ck.info.bytes["dense"])
        / 1e6
        / convert_s,
    }


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory(
        prefix="moet-bench-quant-", dir=os.environ.get("BENCH_DIR")
    ) as d:
        for fmt in FORMATS:
            rows.append(bench_format(fmt, Path(d)))
            r = rows[-1]
            print(
                f"{fmt:>10}: fast {r['fast_path_MB_s']:7.1f} MB/s/core "
                f"({r['fast_vs_target']:.2f}x target, {r['fast_vs_spec']:.1f}x spec path "
                f"{r['spec_path_MB_s']:.1f}); cold read {r['cold_read_MB_s']:.0f} MB/s; "
                f"convert end to end {r['convert_end_to_end_MB_s']:.1f} MB/s",
                flush=True,
            )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "bench": "quant",
        "moet_quant": __version__,
        "commit": commit,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "host": platform.node(),
            "cpu": platform.processor() or platform.machine(),
            "cores_used": 1,
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "command": "nox -s bench -- quant-throughput",
        "shape": SHAPE,
        "target_MB_s_per_core": TARGET_MB_S,
        "results": rows,
    }
    write_result("quant", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
