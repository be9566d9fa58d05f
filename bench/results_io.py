"""Where benchmark results go: bench/results/<bench>/<machine>-<date>.json (one file per day and
machine: `cpu` here, `h200` for a GPU bench there; GPU benches write to the device's $OUT and the
file is committed from there)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def write_result(bench: str, result: dict, machine: str = "cpu", out: Path | None = None) -> Path:
    out = Path(out) if out is not None else RESULTS / bench
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{machine}-{datetime.now(timezone.utc):%Y-%m-%d}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def machine() -> str:
    """The result file's machine tag: the GPU's model (`h200`) where torch sees one, else `cpu`."""
    import torch

    return torch.cuda.get_device_name().split()[-1].lower() if torch.cuda.is_available() else "cpu"
