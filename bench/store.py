"""moet-store benchmark (not a timed test): run by `nox -s bench -- store-reads`.

Measures, in one run, against baselines measured in the same run:
  1. arena hit path: 64-row batch fetch+release (zero copy, proven by pointer identity);
  2. page-cache miss path into the (pinnable) stage with N reader threads vs a multi-threaded
     memcpy of the same bytes (target >= 80%);
  3. O_DIRECT pack reads vs `dd iflag=direct` of the same file (target >= 90%);
  4. with CUDA: arena hit -> pinned H2D vs a plain pinned torch copy (skipped on CPU).
Writes bench/results/store/<cpu|gpu>-<date>.json with machine info and the command.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import moet_store
from moet_store import _core

ROOT = Path(__file__).resolve().parents[1]


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        git = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        commit = git.stdout.strip() if git.returncode == 0 else ""
    except OSError:
        commit = ""
    info = {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "mem_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "moet_store": moet_store.__version__,
        "commit": commit or os.environ.get("MOET_COMMIT") or None,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            )
            info["driver"] = smi.stdout.strip() or None
    except ImportError:
        pass
    return info


def write_pack(d: Path, n_layers: int, n_experts: int, row_bytes: int, tag: str = "w2"):
    spec = moet_store.PackSpec(tag, 0, 0, n_layers, n_experts, row_bytes, {"bench": tag})
    rng = np.random.default_rng(0)
    layer = rng.integers(0, 256, size=(n_experts, row_bytes), dtype=np.uint8)
    with moet_store.open_pack_for_write(d, spec, min_free_bytes=0, durable=False) as w:
        for i in range(n_layers):
            layer[:, :8] = i  # distinct rows
            w.write_layer(i, layer)
    os.sync()
    return spec


def bench_hit(d: Path, iters: int) -> dict:
    spec = write_pack(d, 4, 64, 64 << 10, tag="hit")
    keys = np.array([(1, e) for e in range(64)], dtype=np.int64)
    out = {}
    with moet_store.open_store(d, spec, arena_bytes=256 * spec.stride, preheat=False) as st:
        st.fetch(keys).release()
        b1 = st.fetch(keys)
        ptrs = b1.ptrs
        same_ptr = all(
            np.frombuffer(v, dtype=np.uint8).ctypes.data == p for v, p in zip(b1.views, ptrs)
        )
        b1.release()
        for name, with_views in (("fetch_release", False), ("fetch_views_release", True)):
            times = []
            for _ in range(iters):
                t0 = time.perf_counter_ns()
                b = st.fetch(keys)
                if with_views:
                    _ = b.views
                b.release()
                times.append(time.perf_counter_ns() - t0)
            times.sort()
            out[name] = {
                "p50_us": times[len(times) // 2] / 1e3,
                "p99_us": times[int(len(times) * 0.99)] / 1e3,
            }
        b2 = st.fetch(keys)
        out["pointer_identity"] = same_ptr and b2.ptrs == ptrs
        out["all_hits"] = all(b2.hits)
        b2.release()
    out["batch_rows"] = 64
    out["target_us"] = 20.0
    out["meets_target"] = out["fetch_release"]["p50_us"] <= 20.0
    return out


def bench_pagecache(d: Path, mib: int, readers_list: list[int], reps: int) -> dict:
    row = 1 << 20
    n_rows = mib
    spec = write_pack(d, n_rows // 64, 64, row, tag="pc")
    path = spec.paths(d).pack
    with open(path, "rb") as f:  # warm the page cache
        while f.read(64 << 20):
            pass
    batch = 64
    keys_all = [(layer, e) for layer in range(spec.n_layers) for e in range(64)]
    nbytes = len(keys_all) * row
    res = {"bytes_per_sweep": nbytes, "batch_rows": batch, "row_bytes": row, "runs": []}
    src = _core.aligned_buffer(batch * row)
    dst = _core.aligned_buffer(batch * row)
    np.frombuffer(src, dtype=np.uint8)[:] = 1
    np.frombuffer(dst, dtype=np.uint8)[:] = 0
    for readers in readers_list:
        for engine in ("pread", "io_uring"):
            if engine == "io_uring" and not _core.probe_uring()["ok"]:
                continue
            for verify in (False, True):
                # baseline measured right next to each store run: this machine's memory
                # bandwidth drifts from minute to minute
                secs = min(_core.memcpy_mt(dst, src, readers, n_rows // batch) for _ in range(reps))
                memcpy_gbs = nbytes / secs / 1e9
                with moet_store.open_store(
                    d,
                    spec,
                    backend="pagecache",
                    stage_bytes=batch * spec.stride,
                    readers=readers,
                    engine=engine,
                    verify=verify,
                    populate=True,
                ) as st:
                    best = float("inf")
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        for i in range(0, len(keys_all), batch):
                            st.fetch(keys_all[i : i + batch]).release()
                        best = min(best, time.perf_counter() - t0)
                gbs = nbytes / best / 1e9
                res["runs"].append(
                    {
                        "readers": readers,
                        "engine": engine,
                        "verify_crc32c": verify,
                        "store_GBps": round(gbs, 3),
                        "memcpy_GBps": round(memcpy_gbs, 3),
                        "ratio": round(gbs / memcpy_gbs, 3),
                    }
                )
    res["target_ratio"] = 0.8
    return res


def dd_direct(path: Path, bs: int, count: int) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", f"bs={bs}", f"count={count}", "iflag=direct"],
        capture_output=True,
        text=True,
    )
    secs = time.perf_counter() - t0
    m = re.search(r"copied, ([0-9.]+) s", r.stderr)
    if m:
        secs = float(m.group(1))
    return bs * count / secs / 1e9


def bench_direct(d: Path, mib: int, reps: int) -> dict:
    row = 1 << 20
    spec = write_pack(d, mib // 64, 64, row, tag="od")
    path = spec.paths(d).pack
    count = spec.n_rows
    nbytes = count * spec.stride
    keys_all = [(layer, e) for layer in range(spec.n_layers) for e in range(64)]
    res = {"bytes": nbytes, "row_bytes": row, "runs": []}
    dd = max(dd_direct(path, spec.stride, count) for _ in range(reps))
    res["dd_iflag_direct_GBps"] = round(dd, 3)
    res["dd_command"] = f"dd if=PACK of=/dev/null bs={spec.stride} count={count} iflag=direct"
    for engine in ("io_uring", "pread"):
        if engine == "io_uring" and not _core.probe_uring()["ok"]:
            continue
        for readers, batch in ((1, 1), (2, 64), (8, 64)):
            best = 0.0
            dd = max(dd, dd_direct(path, spec.stride, count))  # dd again, next to this run
            for _ in range(reps):
                with moet_store.open_store(
                    d,
                    spec,
                    backend="tiered",
                    arena_bytes=batch * spec.stride,
                    direct=True,
                    engine=engine,
                    readers=readers,
                    verify=False,
                    preheat=False,
                    populate=True,
                ) as st:
                    assert st.runtime_info()["direct"] is True
                    t0 = time.perf_counter()
                    for i in range(0, len(keys_all), batch):
                        st.fetch(keys_all[i : i + batch]).release()
                    best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
            res["runs"].append(
                {
                    "dd_GBps_so_far": round(dd, 3),
                    "engine": engine,
                    "readers": readers,
                    "batch_rows": batch,
                    "store_GBps": round(best, 3),
                    "ratio_vs_dd": round(best / dd, 3),
                }
            )
    res["target_ratio"] = 0.9
    return res


def bench_cuda(d: Path) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch not installed"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device (CPU machine)"}
    row = 6 << 20
    spec = write_pack(d, 2, 64, row, tag="gpu")
    keys = np.array([(0, e) for e in range(64)], dtype=np.int64)
    out = {}
    with moet_store.open_store(d, spec, arena_bytes=128 * spec.stride, preheat=False) as st:
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(st.arena_address, st.arena_bytes, 0)
        out["cudaHostRegister"] = int(rc)
        st.fetch(keys).release()
        dev = torch.empty((64, row), dtype=torch.uint8, device="cuda")
        pinned = torch.empty((64, row), dtype=torch.uint8).pin_memory()
        import warnings

        warnings.simplefilter("ignore")

        def h2d_arena():
            with st.fetch(keys) as b:
                for i, v in enumerate(b.views):
                    dev[i].copy_(torch.frombuffer(v, dtype=torch.uint8), non_blocking=True)
                torch.cuda.current_stream().synchronize()

        def h2d_plain():
            dev.copy_(pinned, non_blocking=True)
            torch.cuda.current_stream().synchronize()

        for name, fn in (("arena_hit_h2d", h2d_arena), ("plain_pinned_h2d", h2d_plain)):
            fn()
            t = []
            for _ in range(20):
                t0 = time.perf_counter()
                fn()
                t.append(time.perf_counter() - t0)
            best = min(t)
            out[name] = {"ms": round(best * 1e3, 3), "GBps": round(64 * row / best / 1e9, 2)}
        out["ratio"] = round(out["plain_pinned_h2d"]["ms"] / out["arena_hit_h2d"]["ms"], 3)
        cudart.cudaHostUnregister(st.arena_address)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to test")
    ap.add_argument("--pagecache-mib", type=int, default=512)
    ap.add_argument("--direct-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hit-iters", type=int, default=20000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="moet-store-bench-", dir=args.dir))
    try:
        ncpu = os.cpu_count() or 1
        readers = sorted({1, ncpu, min(8, 2 * ncpu)})
        results = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(),
            "scratch_dir": "a temporary directory (--dir, default $TMPDIR)",
            "doctor": {
                k: v
                for k, v in moet_store.doctor(scratch).items()
                if k not in ("pack_list", "path")
            },
        }
        results["hit"] = bench_hit(scratch / "hit", args.hit_iters)
        print("hit", json.dumps(results["hit"]))
        results["pagecache_miss"] = bench_pagecache(
            scratch / "pc", args.pagecache_mib, readers, args.reps
        )
        print("pagecache", json.dumps(results["pagecache_miss"]["runs"]))
        shutil.rmtree(scratch / "pc", ignore_errors=True)
        results["o_direct"] = bench_direct(scratch / "od", args.direct_mib, args.reps)
        print("o_direct", json.dumps(results["o_direct"]))
        results["cuda_h2d"] = bench_cuda(scratch / "gpu")
        print("cuda", json.dumps(results["cuda_h2d"]))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    kind = "gpu" if "gpu" in results["machine"] else "cpu"
    out = (
        Path(args.out)
        if args.out
        else (ROOT / "bench" / "results" / "store" / f"{kind}-{dt.date.today().isoformat()}.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
