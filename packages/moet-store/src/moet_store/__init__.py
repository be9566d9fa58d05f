"""moet-store: pack files of expert rows, a pinned MRU arena and the I/O engines that fill it.

Public API (see docs/store.md):

- :class:`PackSpec` -- what a pack holds (tag, TP/PP rank, geometry, opaque identity dict);
- :func:`open_pack_for_write` / :class:`PackWriter` -- write layers (flock, CRC-32C, atomic sidecar);
- :func:`open_store` / :class:`Store` -- backends ``ram``, ``pagecache``, ``tiered``;
  ``fetch(keys, scan=False)`` returns a leased :class:`Batch` of zero-copy row views;
- :func:`doctor` / :func:`format_doctor` -- engine probe, O_DIRECT, memlock, free space;
- :func:`prune`, :func:`default_cache_dir`, :class:`StoreError`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError as _NotInstalled
from importlib.metadata import version as _dist_version

try:  # the pyproject's version, as installed: its one place
    __version__ = _dist_version("moet-store")
except _NotInstalled:  # imported from a source tree (PYTHONPATH), not installed
    __version__ = "0+source"

from ._core import Batch, StoreError
from .doctor import doctor, format_doctor
from .pack import (
    PackSpec,
    PackWriter,
    default_cache_dir,
    list_packs,
    open_pack_for_write,
    prune,
    read_sidecar,
)
from .store import Store, open_store

__all__ = [
    "Batch",
    "PackSpec",
    "PackWriter",
    "Store",
    "StoreError",
    "__version__",
    "default_cache_dir",
    "doctor",
    "format_doctor",
    "list_packs",
    "open_pack_for_write",
    "open_store",
    "prune",
    "read_sidecar",
]
