"""Fault injection, for tests: a private hook, not the public API (docs/store.md, "I/O engines").

Stores and pack writers opened inside ``with inject(...)`` take its faults for their lifetime; the
I/O engine injects them (src/cpp/engine.hpp ``FaultConfig``):

- ``short_read_every=k``, ``eio_every=k``, ``eio_after=n``: reads cut short or failing with EIO;
- ``stall_us=us``: every read delayed;
- ``odirect_refused=True``: O_DIRECT refused at open, as on tmpfs or some network filesystems;
- ``enospc_after_bytes=n``: writes failing with ENOSPC past n bytes (a full disk).

An unknown key is refused by the engine (ValueError). Outside the context nothing is injected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_active: dict | None = None


@contextlib.contextmanager
def inject(**faults: object) -> Iterator[None]:
    global _active
    before, _active = _active, dict(faults)
    try:
        yield
    finally:
        _active = before


def active() -> dict | None:
    """The faults a store or writer opened now takes (a copy), or None."""
    return dict(_active) if _active else None
