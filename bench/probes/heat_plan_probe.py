"""Host time of the FP4 tier's heat plan, one step's, against another tree's in the same run.

    python bench/probes/heat_plan_probe.py [--baseline TREE] [--rounds 3] [--steps 1500]
        [--batches 1 32] [--out FILE]

With the gate on, serving's runner plans heat promotions between a decode step's sync and the
next step's launch (moet_vllm.residency.manager: `fp4.after_step`), so the plan's host time is on
the step's critical path. This times `Fp4Tier.heat_plan` alone (after `observe`, before
`commit`, as the runner calls them) at GLM-4.5-Air's routing (46 MoE layers x 128 experts, top-8,
uniform over the experts: what bench/serving_gpu.py imposes) with a 25% FP4 pool, the median of
the steps after the first 500 (the pool is full by then). `--baseline TREE` times TREE's
moet-vllm sources too (e.g. a `git worktree add --detach` of main), each round one process a
tree, the trees alternating, so both see the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS, EXPERTS, TOP_K, POOL_SHARE, WARM_STEPS = 46, 128, 8, 0.25, 500


def time_plans(batch: int, steps: int) -> float:
    """Median µs of heat_plan per step past the warm-up (this process's moet_vllm)."""
    import numpy as np

    from moet_vllm.residency.fp4tier import Fp4Tier

    rng = np.random.default_rng(batch)
    tier = Fp4Tier(int(LAYERS * EXPERTS * POOL_SHARE), LAYERS, EXPERTS)
    times = []
    for _ in range(steps):
        routed = np.zeros((LAYERS, EXPERTS), dtype=bool)  # the pass's routed mask
        for _ in range(batch):
            for layer in range(LAYERS):
                routed[layer, rng.choice(EXPERTS, TOP_K, replace=False)] = True
        o, e = np.nonzero(routed)
        keys = o.astype(np.int64) * EXPERTS + e  # as the runner reads the mask back
        tier.observe(keys, gated=False)
        t0 = time.perf_counter()
        plan = tier.heat_plan(keys)
        times.append(time.perf_counter() - t0)
        tier.commit(plan)
    return float(np.median(times[WARM_STEPS:]) * 1e6)


def run_tree(tree: Path, batches: list[int], steps: int) -> dict[int, float]:
    env = dict(os.environ, PYTHONPATH=str(tree / "packages" / "moet-vllm" / "src"))
    cmd = [sys.executable, __file__, "--child", "--steps", str(steps), "--batches",
           *map(str, batches)]  # fmt: skip
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return {int(k): v for k, v in json.loads(out).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, help="another tree to time beside this one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps <= WARM_STEPS:
        ap.error(f"--steps must exceed the {WARM_STEPS} warm-up steps")
    if args.child:
        print(json.dumps({b: time_plans(b, args.steps) for b in args.batches}))
        return
    trees = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    for name, tree in trees.items():
        if not (tree / "packages" / "moet-vllm" / "src" / "moet_vllm").is_dir():
            sys.exit(f"heat_plan_probe: {name} tree {tree} has no packages/moet-vllm/src/moet_vllm")
    rounds: dict[str, list[dict[int, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            rounds[name].append(run_tree(tree, args.batches, args.steps))
            print(f"round {r + 1}/{args.rounds} {name}: " + ", ".join(
                f"batch {b} {us:.0f} µs" for b, us in rounds[name][-1].items()), flush=True)  # fmt: skip
    sys.path.insert(0, str(ROOT / "bench"))
    from provenance import provenance

    result = {
        "shape": {
            "moe_layers": LAYERS,
            "experts": EXPERTS,
            "top_k": TOP_K,
            "fp4_pool_share": POOL_SHARE,
            "routing": "uniform",
        },
        "steps": args.steps,
        "warm_steps": WARM_STEPS,
        "us_per_step": {
            name: {b: sorted(x[b] for x in rs)[len(rs) // 2] for b in args.batches}
            for name, rs in rounds.items()
        },
        "rounds": rounds,
        "provenance": provenance(["python", "bench/probes/heat_plan_probe.py", *sys.argv[1:]]),
    }
    if "baseline" in rounds:
        # the baseline's own commit (a worktree's HEAD), not this tree's
        git = ["git", "-C", str(args.baseline), "rev-parse", "--short", "HEAD"]
        head = subprocess.run(git, capture_output=True, text=True).stdout.strip()
        result["baseline_commit"] = head or "unknown"
    for name, per in result["us_per_step"].items():
        print(f"{name}: " + ", ".join(f"batch {b} {us:.0f} µs (median of rounds)"
                                      for b, us in per.items()))  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
