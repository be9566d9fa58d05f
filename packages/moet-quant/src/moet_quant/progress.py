"""One progress bar style for every long step (bytes, to stderr, only on a terminal by default)."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from tqdm import tqdm


def new_bar(
    total: int, desc: str, enabled: bool | None = None, unit: str = "B", unit_scale: bool = True
) -> tqdm:
    """A bar to update and close by hand; `enabled` None shows it only when stderr is a
    terminal."""
    show = sys.stderr.isatty() if enabled is None else enabled
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit_scale,
        unit_divisor=1024,
        disable=not show,
        file=sys.stderr,
        dynamic_ncols=True,
    )


@contextmanager
def progress_bar(total: int, desc: str, enabled: bool | None = None, unit: str = "B"):
    """`new_bar` for a `with` block."""
    with new_bar(total, desc, enabled, unit) as bar:
        yield bar
