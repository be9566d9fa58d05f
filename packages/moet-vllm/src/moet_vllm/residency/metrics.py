"""The run directory: residency counters to vLLM's `/metrics`, and runtime tuning from `moet tune`.

vLLM's Prometheus endpoint lives in the API server process; moet's counters live in the workers
(two process hops away, behind the engine core). The path, documented in docs/residency.md:

1. `register()` runs first in the process that starts vLLM (the API server, or the `vllm.LLM`
   caller) and names a run directory under moet's cache dir in `_MOET_RUN_DIR`; every process
   vLLM spawns inherits it.
2. Each worker's residency manager writes its counters there (`rank<r>.json`, atomically, at most
   once a second and at every KPI line).
3. A Prometheus collector registered in that first process reads the files at scrape time and
   exposes `moet_*` metrics, labelled by the worker's rank (TP rank + TP size x pipeline
   stage; the sum over workers is PromQL's `sum without (rank) (...)`).

The same directory carries runtime tuning the other way: `moet tune KEY=VALUE` writes
`tune.json` there, and each worker applies it (validated as at boot) within a second.

Nothing is written unless a model is served with tiered residency. With several API server
processes (PROMETHEUS_MULTIPROC_DIR), vLLM builds its registry per scrape and moet's collector is
not in it: read the JSON files instead.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import time
from pathlib import Path

RUN_DIR_ENV = "_MOET_RUN_DIR"  # not MOET_*: those are MoetConfig fields
# counter name in residency.manager.Counters -> (metric name, help)
COUNTERS = {
    "steps": ("moet_steps", "Forward steps run with tiered residency"),
    "replayed_steps": ("moet_replayed_steps", "Steps whose first forward pass missed experts"),
    "replays": ("moet_replays", "Forward passes re-run after a fetch"),
    "second_order": ("moet_second_order_replays", "Replays beyond the first of a step"),
    "missing_pairs": ("moet_missing_pairs", "Routed (token, expert) pairs that missed"),
    "fetched_rows": ("moet_fetched_experts", "Expert rows copied into the pool"),
    "fetched_bytes": ("moet_fetched_bytes", "Bytes copied into the pool"),
    "streamed_steps": ("moet_streamed_steps", "Steps larger than the pool, streamed per layer"),
    "unrestored_steps": ("moet_unrestored_steps", "Steps served with zeroed experts (approx.)"),
    "fetch_retries": ("moet_fetch_retries", "Host-tier reads retried"),
    "predicted_steps": (
        "moet_predicted_steps",
        "Decode steps that fetched predicted experts before their forward pass",
    ),
    "predicted_rows": ("moet_predicted_experts", "Expert rows fetched on a prediction"),
    "host_read_steps": (
        "moet_host_read_steps",
        "Steps that read experts missing from the pool in place from host memory",
    ),
    "host_read_rows": ("moet_host_read_experts", "Expert rows read in place from host memory"),
    "observed_steps": (
        "moet_host_read_observed_steps",
        "Steps whose routed experts came back to the host (reading in place counts over them)",
    ),
}

# the FP4 tier's counters (fp4pool.Fp4Pool.metrics), exported where a rank serves the tier
FP4_COUNTERS = {
    "fp4_promotions": ("moet_fp4_promotions", "Expert rows that entered the FP4 pool"),
    "fp4_evictions": ("moet_fp4_evictions", "Expert rows that left the FP4 pool"),
    "fp4_routed_pairs": (
        "moet_fp4_routed_experts",
        "(MoE layer, expert) pairs routed by decode steps (the FP4 hit rate's denominator)",
    ),
    "fp4_hit_pairs": ("moet_fp4_hit_experts", "Of those, the pairs computed from an FP4 row"),
    "fp4_gated_steps": (
        "moet_fp4_gated_steps",
        "Decode steps the confidence gate ran once more with their routed experts at FP4",
    ),
}


def run_dir() -> Path | None:
    d = os.environ.get(RUN_DIR_ENV)
    return Path(d) if d else None


def name_run_dir(cache_root: Path) -> bool:
    """In the first vLLM process: name the directory its workers will report to (created by the
    first report) and remove those of runs whose process is gone; -> whether this process is the
    first (it then serves the metrics). vLLM's own processes (multiprocessing children) inherit
    the name; any other process names its own run, even if its environment came with one (a
    server started from a process that had loaded vLLM itself)."""
    if RUN_DIR_ENV in os.environ and multiprocessing.parent_process() is not None:
        return False
    runs = cache_root / "runs"
    os.environ[RUN_DIR_ENV] = str(runs / f"{os.getpid()}-{int(time.time())}")
    for old in _run_dirs(runs):
        if not Path(f"/proc/{old.name.split('-')[0]}").exists():
            for f in old.iterdir():
                f.unlink(missing_ok=True)
            old.rmdir()
    return True


class Publisher:
    """A worker's side: its counters to `<run dir>/rank<r>.json`, throttled."""

    def __init__(self, rank: int, every_s: float = 1.0):
        d = run_dir()
        self.path = d / f"rank{rank}.json" if d else None
        self.every_s, self.last = every_s, 0.0

    def publish(self, counters, coverage: float, force: bool = False, fp4=None) -> None:
        """`fp4`: the FP4 tier's numbers (FP4_COUNTERS and `fp4_pool_coverage`), if it runs."""
        now = time.monotonic()
        if self.path is None or (not force and now - self.last < self.every_s):
            return
        self.last = now
        data = {k: getattr(counters, k) for k in COUNTERS}
        data["pool_coverage"] = coverage
        data.update(fp4 or {})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)
        except OSError:  # metrics never fail a step
            self.path = None


TUNE_FILE = "tune.json"


def _run_dirs(runs: Path) -> list[Path]:
    """`<pid>-<start time>` directories under `runs`."""
    if not runs.is_dir():
        return []
    return [d for d in runs.iterdir() if d.is_dir() and re.fullmatch(r"[0-9]+-[0-9]+", d.name)]


def live_run_dirs(cache_root: Path) -> list[Path]:
    """Run directories of vLLM processes still alive, newest first."""
    found = [
        d for d in _run_dirs(cache_root / "runs") if Path(f"/proc/{d.name.split('-')[0]}").exists()
    ]
    return sorted(found, key=lambda d: int(d.name.split("-")[1]), reverse=True)


def write_tune(directory: Path, values: dict) -> Path:
    """Merge `values` into the run's tune.json (atomically)."""
    path = directory / TUNE_FILE
    current = json.loads(path.read_text()) if path.is_file() else {}
    current.update(values)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(current, sort_keys=True))
    os.replace(tmp, path)
    return path


class TuneWatcher:
    """A worker's side of `moet tune`: the tune.json of its run, re-read when it changes."""

    def __init__(self, every_s: float = 1.0):
        d = run_dir()
        self.path = d / TUNE_FILE if d else None
        self.every_s, self.last, self.mtime = every_s, 0.0, None

    def poll(self) -> dict | None:
        """The whole tune.json when it changed since the last poll, else None."""
        now = time.monotonic()
        if self.path is None or now - self.last < self.every_s:
            return None
        self.last = now
        try:
            mtime = self.path.stat().st_mtime_ns
            if mtime == self.mtime:
                return None
            self.mtime = mtime
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None


class Collector:
    """The API server's side: a prometheus_client collector over the workers' files."""

    def collect(self):
        d = run_dir()
        files = sorted(d.glob("rank*.json")) if d and d.is_dir() else []
        ranks = []
        for f in files:
            try:
                ranks.append((f.stem.removeprefix("rank"), json.loads(f.read_text())))
            except (OSError, ValueError):
                continue
        if not ranks:
            return
        yield from _families(ranks, COUNTERS, "pool_coverage", "the device pool")
        fp4 = [(rank, data) for rank, data in ranks if "fp4_pool_coverage" in data]
        if fp4:  # a rank serves the FP4 tier
            yield from _families(fp4, FP4_COUNTERS, "fp4_pool_coverage", "the FP4 pool")


def _families(ranks: list, counters: dict, coverage: str, pool: str):
    """Prometheus families of `counters` and the `coverage` gauge over the ranks' files."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for key, (name, doc) in counters.items():
        m = CounterMetricFamily(name, doc, labels=["rank"])
        for rank, data in ranks:
            m.add_metric([rank], float(data.get(key, 0)))
        yield m
    g = GaugeMetricFamily(f"moet_{coverage}", f"Share of the experts {pool} holds", labels=["rank"])
    for rank, data in ranks:
        g.add_metric([rank], float(data.get(coverage, 0)))
    yield g


_collector: Collector | None = None


def install_collector() -> None:
    """Register the collector with prometheus_client's default registry (vLLM's `/metrics`)."""
    global _collector
    if _collector is not None:
        return
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    _collector = Collector()
    REGISTRY.register(_collector)
