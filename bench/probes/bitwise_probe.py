"""Which engines of the tiered comparison agree bit for bit, and where they part: a probe for
test_gpu_tiered's bit-for-bit tests (one device run, the packages installed as ci/gpu.sh does).

    python3 bench/probes/bitwise_probe.py --out $OUT

Runs, side by side as the GPU suite does, twins of each kind of engine (all-resident, a replayed
50% pool, the floor read in place), compiled with CUDA graphs and eager, on the fixture's prompts,
and writes one JSON: each engine's tokens, logprobs and residency counters, and for every engine
its first (prompt, position) that differs from the all-resident one, with the logprob gap; and
every engine's log. --shared-compile-cache lets the engines share vLLM's compile cache as
they compile side by side: on the H200 (2026-12-03) that parted 3 of the 7 compiled engines, a
resident twin among them, from the first at the second wave's prefill; with it off
(tests/serving.py BITWISE_ENV) all 10 agreed bit for bit
(bench/results/gpu/h200-2026-12-03-bitwise-probe.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "packages" / "moet-vllm" / "tests"
sys.path.insert(0, str(TESTS))
from serving import (  # noqa: E402
    BITWISE_ENV,
    BITWISE_FLAGS,
    GPU_DRIVER_FLAGS,
    GPU_KV_FLAGS,
    convert_fixture,
    fixture_prompts,
    run_vllm_side_by_side,
)

SEQS = 4
FLOOR = 56


def first_difference(a: dict, b: dict):
    for i, (la, lb) in enumerate(zip(a["logprobs"], b["logprobs"], strict=True)):
        for j, (x, y) in enumerate(zip(la, lb, strict=True)):
            if x != y or a["tokens"][i][j] != b["tokens"][i][j]:
                return {"prompt": i, "position": j, "gap": abs(x - y),
                        "tokens_equal": a["tokens"] == b["tokens"]}  # fmt: skip
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shared-compile-cache", action="store_true")
    args = ap.parse_args()
    base = dict(BITWISE_ENV)
    if args.shared_compile_cache:
        del base["VLLM_DISABLE_COMPILE_CACHE"]
    tmp = Path(tempfile.mkdtemp(prefix="moet-probe-"))
    model = convert_fixture(tmp / "fixture-moet")
    kinds = {
        "resident": {},
        "replay-50%": {"MOET_GPU_POOL": "96", "MOET_READ_IN_PLACE": "0"},
        "in-place": {"MOET_GPU_POOL": str(FLOOR)},
    }
    graphs = [*GPU_DRIVER_FLAGS, *BITWISE_FLAGS, "--max-num-seqs", str(SEQS)]
    eager = [*GPU_KV_FLAGS, "--max-num-seqs", str(SEQS)]
    engines = {}
    for kind, env in kinds.items():
        for mode, flags, twins in (("graphs", graphs, 2), ("eager", eager, 1)):
            for t in range(twins + (kind == "resident" and mode == "graphs")):
                name = f"{kind}-{mode}-{t}"
                e = {**base, **env, "MOET_CACHE_DIR": str(tmp / f"{name}-packs")}
                engines[name] = {
                    "model": model, "env": e, "dtype": "bfloat16",
                    "prompts": fixture_prompts(8), "extra": flags,
                }  # fmt: skip
    runs = run_vllm_side_by_side(tmp, engines)
    report = {}
    for name, r in runs.items():
        ref = runs["resident-graphs-0" if "graphs" in name else "resident-eager-0"]
        report[name] = {"vs_resident": first_difference(ref, r),
                        "vs_graphs_resident": first_difference(runs["resident-graphs-0"], r),
                        "residency": r.get("residency")}  # fmt: skip
        print(name, report[name]["vs_resident"], report[name]["vs_graphs_resident"], flush=True)
    slim = {n: {k: r[k] for k in ("tokens", "logprobs", "residency")} for n, r in runs.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bitwise_probe.json").write_text(json.dumps({"report": report, "runs": slim}))
    with tarfile.open(args.out / "engine-logs.tar.gz", "w:gz") as tar:
        for log in tmp.glob("*.log"):
            tar.add(log, arcname=log.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
