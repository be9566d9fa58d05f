"""The reading side: backends ``ram``, ``pagecache`` and ``tiered`` behind one API, heat files."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from . import _core, _faults
from ._core import Batch, StoreError
from ._jsonio import InvalidJSON, atomic_write_json, is_int, load_json
from .pack import PackSpec, _flock, default_cache_dir, read_sidecar

log = logging.getLogger("moet_store")

BACKENDS = ("ram", "pagecache", "tiered")
HEAT_FORMAT = "moet-heat"
DEFAULT_ARENA_BYTES = 1 << 30
DEFAULT_STAGE_ROWS = 64
_MAX_STAGE_BYTES = 1 << 30


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def load_heat(path: Path, spec: PackSpec, limit: int) -> tuple[list[int], dict]:
    """Validated hot rows from a heat file: in range, de-duplicated, truncated to ``limit``.

    A structurally bad file (corrupt, truncated, hostile, another pack's) is rejected whole;
    single bad entries are dropped. Returns (rows, report).
    """
    report: dict = {"path": str(path), "loaded": 0, "dropped": 0, "rejected": None}
    try:
        obj = load_json(path, (1 << 20) + 64 * min(spec.n_rows, 1 << 20))
    except InvalidJSON as e:
        if str(e) != "missing":
            report["rejected"] = str(e)
            log.warning("moet-store: ignoring heat file %s: %s", path, e)
        else:
            report["rejected"] = "missing"
        return [], report
    problem = None
    if not isinstance(obj, dict):
        problem = "not a JSON object"
    elif obj.get("format") != HEAT_FORMAT or not is_int(obj.get("version")) or obj["version"] != 1:
        problem = "wrong format or version"
    elif obj.get("identity_hash") != spec.identity_hash:
        problem = "written for another identity"
    elif obj.get("n_layers") != spec.n_layers or obj.get("n_experts") != spec.n_experts:
        problem = "written for another geometry"
    elif not isinstance(obj.get("keys"), list):
        problem = "keys is not a list"
    if problem:
        report["rejected"] = problem
        log.warning("moet-store: ignoring heat file %s: %s", path, problem)
        return [], report
    rows: list[int] = []
    seen: set[int] = set()
    dropped = 0
    for k in obj["keys"]:
        if len(rows) >= limit:
            break
        if (
            isinstance(k, list)
            and len(k) == 2
            and is_int(k[0])
            and is_int(k[1])
            and 0 <= k[0] < spec.n_layers
            and 0 <= k[1] < spec.n_experts
        ):
            r = k[0] * spec.n_experts + k[1]
            if r not in seen:
                seen.add(r)
                rows.append(r)
                continue
        dropped += 1
    report["loaded"] = len(rows)
    report["dropped"] = dropped
    return rows, report


class Store:
    """A pack opened for reading. ``fetch(keys, scan=False)`` returns a leased :class:`Batch`."""

    def __init__(
        self,
        directory: str | os.PathLike | None,
        spec: PackSpec,
        *,
        backend: str = "tiered",
        arena_bytes: int | None = None,
        stage_bytes: int | None = None,
        engine: str = "auto",
        direct: bool | str = "auto",
        readers: int = 4,
        queue_depth: int = 64,
        verify: bool = True,
        preheat: bool = True,
        populate: bool = False,
        register_buffers: bool = True,
        writable_views: bool = False,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: expected one of {BACKENDS}")
        if direct not in ("auto", True, False):
            raise ValueError(f"direct={direct!r}: expected 'auto', True or False")
        if not is_int(readers) or not 1 <= readers <= 256:
            raise ValueError(f"readers={readers!r}: expected an int in [1, 256]")
        self.spec = spec
        self.backend = backend
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.paths = spec.paths(self.directory)
        self.path = self.paths.pack
        if not self.path.exists():
            raise StoreError(
                errno.ENOENT,
                f"no pack at {self.path} (tag {spec.tag}, tp {spec.tp_rank}, pp {spec.pp_rank}, "
                f"identity {spec.identity_hash}); expected one written by "
                f"open_pack_for_write(directory, spec); write its layers first",
            )
        stride = spec.stride
        if backend == "ram":
            arena_slots = spec.n_rows
        elif backend == "pagecache":
            arena_slots = 0
        else:
            ab = DEFAULT_ARENA_BYTES if arena_bytes is None else int(arena_bytes)
            if ab < 0:
                raise ValueError(f"arena_bytes={arena_bytes!r} must be >= 0")
            arena_slots = min(spec.n_rows, ab // stride)
        if stage_bytes is None:
            stage_slots = max(1, min(DEFAULT_STAGE_ROWS, spec.n_rows, _MAX_STAGE_BYTES // stride))
        else:
            stage_slots = max(0, int(stage_bytes) // stride)
        if backend == "pagecache":
            direct = False
        self.stale_reason: str | None = None
        with _flock(self.paths.lock, False):
            try:
                layers = read_sidecar(self.directory, spec)
            except InvalidJSON as e:
                layers = {}
                self.stale_reason = str(e)
                log.warning(
                    "moet-store: pack %s is stale or foreign (sidecar %s): serving no rows; "
                    "rebuild it with open_pack_for_write()",
                    self.path,
                    e,
                )
            written = [1 if i in layers else 0 for i in range(spec.n_layers)]
            crcs = [0] * spec.n_rows
            for layer, cs in layers.items():
                crcs[layer * spec.n_experts : (layer + 1) * spec.n_experts] = cs
            self._core = _core.CoreStore(
                str(self.path),
                spec.n_layers,
                spec.n_experts,
                spec.row_bytes,
                stride,
                arena_slots,
                stage_slots,
                engine,
                {"auto": -1, True: 1, False: 0}[direct],
                readers,
                verify,
                populate,
                register_buffers,
                _faults.active(),  # tests only (moet_store._faults)
                written,
                crcs,
                writable_views,
                queue_depth,
            )
        self._layers = sorted(layers)
        self.fetch = self._core.fetch  # the hot path: no Python frame in between
        self.heat_report: dict | None = None
        if backend == "ram" and layers:
            rows = [r for layer in self._layers for r in range(*self._layer_rows(layer))]
            self._core.preheat(rows)
        elif backend == "tiered" and preheat and arena_slots:
            rows, self.heat_report = load_heat(self.paths.heat, spec, arena_slots)
            if rows:
                self.heat_report["preheated"] = self._core.preheat(rows)

    def _layer_rows(self, layer: int) -> tuple[int, int]:
        e = self.spec.n_experts
        return layer * e, (layer + 1) * e

    def fetch(self, keys: object, scan: bool = False) -> Batch:  # replaced per instance
        """Rows for ``keys`` ((layer, expert) pairs: a list or an int array [n, 2]).

        Hits are zero-copy views of arena slots; misses are read (transactionally) into free or
        least-recently-used slots, or into the stage when the arena cannot take them. ``scan``
        (prefill) fills free slots but never evicts. Release the batch after the H2D copy.
        """
        return self._core.fetch(keys, scan)

    @property
    def layers_written(self) -> list[int]:
        return list(self._layers)

    def missing_layers(self) -> list[int]:
        done = set(self._layers)
        return [i for i in range(self.spec.n_layers) if i not in done]

    @property
    def arena_address(self) -> int:
        """Base address of the page-aligned arena (for cudaHostRegister)."""
        return self._core.arena_address

    @property
    def arena_bytes(self) -> int:
        return self._core.arena_bytes

    @property
    def stage_address(self) -> int:
        return self._core.stage_address

    @property
    def stage_bytes(self) -> int:
        return self._core.stage_bytes

    def is_resident(self, layer: int, expert: int) -> bool:
        return self._core.row_slot(layer * self.spec.n_experts + expert) >= 0

    def arena_slot(self, layer: int, expert: int) -> int:
        """The arena slot holding the row (at arena_address + slot * spec.stride), -1 if none.
        With the ram backend every written row has one for the store's lifetime."""
        return self._core.row_slot(layer * self.spec.n_experts + expert)

    def stats(self) -> dict:
        d = self._core.stats()
        lat = self._core.latency_us(False)
        miss = self._core.latency_us(True)
        d["latency_us_p50"] = _percentile(lat, 50)
        d["latency_us_p99"] = _percentile(lat, 99)
        d["miss_latency_us_p50"] = _percentile(miss, 50)
        d["miss_latency_us_p99"] = _percentile(miss, 99)
        d["leased_batches"] = self._core.leased_batches()
        return d

    def runtime_info(self) -> dict:
        d = self._core.info()
        d.update(
            backend=self.backend,
            path=str(self.path),
            arena_bytes=self._core.arena_bytes,
            arena_slots=self._core.arena_bytes // self.spec.stride,
            stage_bytes=self._core.stage_bytes,
            stride=self.spec.stride,
            row_bytes=self.spec.row_bytes,
            layers_written=len(self._layers),
            stale_reason=self.stale_reason,
            heat=self.heat_report,
        )
        return d

    def hot_keys(self, limit: int | None = None) -> list[tuple[int, int]]:
        n = self._core.arena_bytes // self.spec.stride if limit is None else limit
        e = self.spec.n_experts
        return [(r // e, r % e) for r in self._core.hot_rows(n)]

    def save_heat(self, path: str | os.PathLike | None = None, limit: int | None = None) -> Path:
        """Write the arena's keys, most recent first, atomically to ``<pack>.heat.json``."""
        p = Path(path) if path is not None else self.paths.heat
        obj = {
            "format": HEAT_FORMAT,
            "version": 1,
            "identity_hash": self.spec.identity_hash,
            "tag": self.spec.tag,
            "n_layers": self.spec.n_layers,
            "n_experts": self.spec.n_experts,
            "keys": [list(k) for k in self.hot_keys(limit)],
        }
        atomic_write_json(p, obj)
        return p

    def close(self) -> None:
        self._core.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(directory: str | os.PathLike | None, spec: PackSpec, **kwargs: object) -> Store:
    """Open the pack of ``spec`` in ``directory`` (None: the cache dir) for reading.

    Keywords: backend ("tiered" | "pagecache" | "ram"), arena_bytes, stage_bytes,
    engine ("auto" | "io_uring" | "pread"), direct ("auto" | True | False), readers, verify,
    preheat, populate, register_buffers, writable_views.
    """
    return Store(directory, spec, **kwargs)  # type: ignore[arg-type]
