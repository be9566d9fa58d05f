"""One progress bar style for every long step (bytes, to stderr, only on a terminal by default)."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from tqdm import tqdm


@contextmanager
def progress_bar(total: int, desc: str, enabled: bool | None = None, unit: str = "B"):
    """`enabled` None shows the bar only when stderr is a terminal."""
    show = sys.stderr.isatty() if enabled is None else enabled
    with tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=True,
        unit_divisor=1024,
        disable=not show,
        file=sys.stderr,
        dynamic_ncols=True,
    ) as bar:
        yield bar
