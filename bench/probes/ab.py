"""A/B timing of two kernel trees on the GPU, in one device run, rounds interleaved.

    python3 bench/probes/ab.py --a build/ab-old --b . [--rounds 3] [--batches 1 8 32] --out $OUT

Each side runs `bench/kernels.py --only time --no-wide --no-fp4` in its own tree (so with its own
CUDA source, built there) in the order A, B, A, B, ...: a drift of the GPU between runs (the H200
varies by about ±3% from run to run) then falls on both sides alike. Every run draws its own
routing, so the comparison is the median share of the copy bandwidth per batch (routed bytes /
time / the copy bandwidth measured in that run), not the raw time. A tree is a checkout of the
repository (for an older commit: `git archive <sha> | tar -x -C build/ab-old`, carried to the
device). Validate B first (`bench/kernels.py --only validate`): this only times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from provenance import provenance  # noqa: E402


def time_tree(tree: Path, batches: list[int], out: Path) -> dict:
    cmd = [sys.executable, "bench/kernels.py", "--only", "time", "--no-wide", "--no-fp4",
           "--batches", *map(str, batches), "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, cwd=tree, check=True)
    (result,) = out.glob("*.json")
    return json.loads(result.read_text())["timing"]["batches"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="the baseline tree")
    ap.add_argument("--b", type=Path, required=True, help="the candidate tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for side in ("a", "b"):
            tree = getattr(args, side).resolve()
            runs[side].append(time_tree(tree, args.batches, args.out / f"{side}-{r}"))
    summary = {}
    for n in args.batches:
        row = {}
        for side in ("a", "b"):
            rows = [run[str(n)] for run in runs[side]]
            row[f"{side}_share_of_copy"] = statistics.median(x["share_of_copy_bw"] for x in rows)
            row[f"{side}_us_per_layer"] = statistics.median(x["us_per_layer"] for x in rows)
        row["b_over_a_share"] = row["b_share_of_copy"] / row["a_share_of_copy"]
        summary[n] = row
        print(f"batch {n:4d}: A {row['a_us_per_layer']:7.1f} us ({row['a_share_of_copy']:.3f} of copy)"
              f"  B {row['b_us_per_layer']:7.1f} us ({row['b_share_of_copy']:.3f})"
              f"  B/A share {row['b_over_a_share']:.3f}")  # fmt: skip
    report = {"environment": provenance([sys.executable, *sys.argv]), "a": str(args.a),
              "b": str(args.b), "rounds": args.rounds, "summary": summary, "runs": runs}  # fmt: skip
    (args.out / "ab.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
