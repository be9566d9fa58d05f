"""Where benchmark results go.

* A recipe's run (bench/run.py, bench/recipes/): one file,
  bench/results/<recipe>/<machine>-<date>-<commit>.json, written by `write_run` alone: the recipe
  as run, the provenance (GPU, driver, torch, vLLM, commit, command, date) and the bench's own
  result. On the GPU machine it goes under $OUT/<recipe>/ and is committed from there.
* A bench script's own output (`write_result`): bench/results/<bench>/<machine>-<date>.json, or
  the directory in BENCH_OUT (the runner sets it to the run's scratch directory).
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SCHEMA = 1  # of a run file: {"schema", "recipe", "provenance", "result"}


def write_result(bench: str, result: dict, machine: str = "cpu", out: Path | None = None) -> Path:
    if out is None and os.environ.get("BENCH_OUT"):
        out = Path(os.environ["BENCH_OUT"])
    out = Path(out) if out is not None else RESULTS / bench
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{machine}-{datetime.now(timezone.utc):%Y-%m-%d}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def write_run(root: Path, recipe: dict, provenance: dict, result: dict) -> Path:
    """The one writer of a recipe's run: `root`/<recipe>/<machine>-<date>-<commit>.json.
    `provenance` carries `machine`, `date` and `commit` (bench/provenance.py)."""
    name = recipe["name"]
    commit = str(provenance.get("commit", "unknown"))[:7]
    day = str(provenance["date"])[:10]
    path = Path(root) / name / f"{provenance['machine']}-{day}-{commit}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"schema": SCHEMA, "recipe": recipe, "provenance": provenance, "result": result}
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def runs(root: Path, name: str) -> list[Path]:
    """The committed runs of recipe `name`, oldest first (by date, then file name)."""
    files = (Path(root) / name).glob("*.json")
    return sorted(files, key=lambda p: (json.loads(p.read_text())["provenance"]["date"], p.name))
