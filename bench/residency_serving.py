"""Decode speed on vLLM CPU with tiered residency: a pool at 100% / 50% / 25% of the experts
against every expert resident, in the same run, on the trained fixture model (real routing); at
50% and 25% also without the predicted fetch (`MOET_PREDICT=0`, experts fetched on demand only).

Run through nox: `nox -s bench -- residency-serving`. The fixture (moet.models.fixture():
3 MoE layers x 64 experts, top-4) is converted by `moet convert` (once, cached under
$XDG_CACHE_HOME/moet/bench) and served by vLLM (CPU, float32) one sequence at a time
(max_num_seqs 1: the boot floor is 1.15 x 3 x 4 = 14 slots, below every pool here: 25% is 48),
decoding prompts of the text it was trained on. Each tiered pool boots twice on one pack cache:
the first boot warms the pool and saves its hot set, the second preloads it (a warm start, as a
restarted server has) and is the one measured. Reported: decode tokens/s (vLLM's generate wall
time), its ratio to the resident run, the share of steps that replayed (from the KPI lines), and
whether the greedy tokens equal the resident run's (they must: replays are bit-identical).
Results: bench/results/residency_serving/cpu-<date>.json.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_io import write_result  # noqa: E402  (bench/ is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "packages" / "moet-vllm" / "tests"
sys.path.insert(0, str(TESTS))
from serving import FIXTURE, FIXTURE_TEXTS, fixture_prompts  # noqa: E402  (the tests' prompts)

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moet" / "bench"
MODEL = CACHE / "glm-moe-fixture-moet"
DRIVER = TESTS / "vllm_driver.py"
MAX_TOKENS = 48
# (gpu_pool, predicted fetch): the resident baseline, then the serving default and on-demand fetch
POOLS = (
    ("all", True),
    ("100%", True),
    ("50%", True),
    ("50%", False),
    ("25%", True),
    ("25%", False),
)


def build_model() -> Path:
    if (MODEL / "config.json").exists():
        return MODEL
    from moet_quant import convert

    print(f"converting {FIXTURE.name} to {MODEL} (once)...", flush=True)
    return convert.convert(FIXTURE, MODEL, progress=False).out


def serve(
    model: Path, pool: str, predict: bool, cache_dir: Path, out_dir: Path, prompts: Path
) -> dict:
    out = out_dir / f"{pool.replace('%', 'pct')}-{int(predict)}.json"
    env = {
        **os.environ,
        "MOET_CACHE_DIR": str(cache_dir),
        "MOET_GPU_POOL": pool,
        "MOET_PREDICT": str(int(predict)),
        "MOET_KPI_EVERY": "8",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    cmd = [sys.executable, str(DRIVER), str(model), str(out), "--max-num-seqs", "1"]
    cmd += ["--prompts-file", str(prompts), "--max-tokens", str(MAX_TOKENS)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"pool {pool}: vLLM failed:\n{r.stderr[-3000:]}")
    res = json.loads(out.read_text())
    n_tokens = sum(len(t) for t in res["tokens"])
    log = r.stdout + r.stderr
    coverage = re.search(r"pool coverage ([\d.]+)%", log)
    kpis = re.findall(r"moet KPI: (\d+) steps: replay ([\d.]+)% of steps, ([\d.]+) missing", log)
    steps = sum(int(n) for n, _, _ in kpis)
    replayed = sum(int(n) * float(p) / 100 for n, p, _ in kpis)
    return {
        "pool": pool,
        "predict": predict,
        "tokens": res["tokens"],
        "generate_s": round(res["generate_seconds"], 2),
        "decode_tokens_per_s": round(n_tokens / res["generate_seconds"], 2),
        "pool_coverage_pct": float(coverage.group(1)) if coverage else 100.0,
        "kpi_steps": steps,
        "replayed_steps_pct": round(100 * replayed / steps, 1) if steps else 0.0,
    }


def main() -> int:
    model = build_model()
    runs = []
    with tempfile.TemporaryDirectory(prefix="moet-residency-bench-") as tmp:
        tmp = Path(tmp)
        prompts = tmp / "prompts.json"
        prompts.write_text(json.dumps(fixture_prompts(len(FIXTURE_TEXTS))))
        for pool, predict in POOLS:  # one pack cache: the first tiered boot writes the packs
            t0 = time.perf_counter()
            if pool != "all":  # warm-up boot: fills the pool and saves its hot set
                serve(model, pool, predict, tmp / "packs", tmp, prompts)
            run = serve(model, pool, predict, tmp / "packs", tmp, prompts)
            print(
                f"pool {pool:>5}{'' if predict else ' (on demand)'}: "
                f"{run['decode_tokens_per_s']:.2f} tok/s "
                f"({time.perf_counter() - t0:.0f} s boot + run)",
                flush=True,
            )
            runs.append(run)
    base = runs[0]
    for run in runs:
        run["ratio_to_resident"] = round(
            run["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3
        )
        run["tokens_equal_resident"] = run["tokens"] == base["tokens"]
    result = {
        "bench": "residency_serving",
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
        "command": "nox -s bench -- residency-serving",
        "model": f"{FIXTURE.name} (moet.models.fixture(), moet convert)",
        "prompts": len(FIXTURE_TEXTS),
        "protocol": "max_num_seqs 1; each tiered pool boots twice on one pack cache, the second "
        "boot (warm start from the first's saved hot set) is measured",
        "max_tokens": MAX_TOKENS,
        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
    }
    write_result("residency_serving", result)
    bad = [(r["pool"], r["predict"]) for r in runs if not r["tokens_equal_resident"]]
    if bad:
        print(f"FAIL: tokens differ from the resident run for pools {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
