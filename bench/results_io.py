"""Where benchmark results go: bench/results/<bench>/cpu-<date>.json (one file per day)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def write_result(bench: str, result: dict) -> Path:
    out = RESULTS / bench
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cpu-{datetime.now(timezone.utc):%Y-%m-%d}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return path
