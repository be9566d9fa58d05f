"""Pack files: naming, identity, the JSON sidecar, the writer (flock, CRC-32C, atomic sidecar
replace, stale rebuild, concurrent writers merging layers), the cache directory and pruning.

File layout (design.md, "Pack files"): row (layer, expert) lives at (layer * E + expert) * stride of
a pre-sized file, stride = row_bytes rounded up to 4096. Next to ``<name>.pack``:
``<name>.pack.json`` (sidecar), ``<name>.pack.lock`` (flock), ``<name>.pack.heat.json`` (heat).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import _core, _faults
from ._core import StoreError
from ._jsonio import InvalidJSON, atomic_write_json, fsync_dir, is_int, load_json

log = logging.getLogger("moet_store")

FORMAT = "moet-pack"
VERSION = 1
PAGE = 4096
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_]{0,31}$")
_MAX_ROWS = 1 << 24
_MAX_ROW_BYTES = 1 << 31


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/moet``, else ``~/.cache/moet``."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "moet"


def canonical_identity(identity: dict) -> str:
    if not isinstance(identity, dict):
        raise TypeError(f"identity must be a dict, got {type(identity).__name__}")
    try:
        return json.dumps(
            identity, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"identity must be JSON-serializable with string keys: {e}") from None


@dataclass(frozen=True)
class PackSpec:
    """What one pack holds: rows of raw bytes for one (tier tag, TP rank, PP rank)."""

    tag: str
    tp_rank: int
    pp_rank: int
    n_layers: int
    n_experts: int
    row_bytes: int
    identity: dict = field(hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tag, str) or not _TAG_RE.match(self.tag):
            raise ValueError(
                f"tag {self.tag!r}: expected 1-32 characters of [A-Za-z0-9_] (e.g. 'w2', 'fp4r')"
            )
        for name in ("tp_rank", "pp_rank"):
            v = getattr(self, name)
            if not is_int(v) or not 0 <= v < 1 << 16:
                raise ValueError(f"{name}={v!r}: expected an int in [0, 65536)")
        for name, hi in (("n_layers", 1 << 16), ("n_experts", 1 << 20)):
            v = getattr(self, name)
            if not is_int(v) or not 1 <= v <= hi:
                raise ValueError(f"{name}={v!r}: expected an int in [1, {hi}]")
        if self.n_layers * self.n_experts > _MAX_ROWS:
            raise ValueError(f"n_layers * n_experts must be <= {_MAX_ROWS}")
        if not is_int(self.row_bytes) or not 1 <= self.row_bytes <= _MAX_ROW_BYTES:
            raise ValueError(f"row_bytes={self.row_bytes!r}: expected an int in [1, 2**31]")
        canonical_identity(self.identity)

    @property
    def stride(self) -> int:
        return (self.row_bytes + PAGE - 1) // PAGE * PAGE

    @property
    def n_rows(self) -> int:
        return self.n_layers * self.n_experts

    @property
    def layer_bytes(self) -> int:
        return self.n_experts * self.stride

    @property
    def file_bytes(self) -> int:
        return self.n_rows * self.stride

    @property
    def identity_hash(self) -> str:
        return hashlib.sha256(canonical_identity(self.identity).encode()).hexdigest()[:16]

    @property
    def file_name(self) -> str:
        return f"{self.tag}-tp{self.tp_rank}-pp{self.pp_rank}-{self.identity_hash}.pack"

    def paths(self, directory: str | os.PathLike | None = None) -> PackPaths:
        d = Path(directory) if directory is not None else default_cache_dir()
        return PackPaths(d / self.file_name)


@dataclass(frozen=True)
class PackPaths:
    pack: Path

    @property
    def sidecar(self) -> Path:
        return self.pack.with_name(self.pack.name + ".json")

    @property
    def lock(self) -> Path:
        return self.pack.with_name(self.pack.name + ".lock")

    @property
    def heat(self) -> Path:
        return self.pack.with_name(self.pack.name + ".heat.json")


def _sidecar_max_bytes(spec: PackSpec) -> int:
    return (1 << 20) + spec.n_rows * 16 + len(canonical_identity(spec.identity)) * 2


def _new_sidecar(spec: PackSpec, layers: dict[int, list[int]]) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "tag": spec.tag,
        "tp_rank": spec.tp_rank,
        "pp_rank": spec.pp_rank,
        "n_layers": spec.n_layers,
        "n_experts": spec.n_experts,
        "row_bytes": spec.row_bytes,
        "slot_bytes": spec.row_bytes,
        "stride": spec.stride,
        "file_bytes": spec.file_bytes,
        "identity": spec.identity,
        "identity_hash": spec.identity_hash,
        "checksum": "crc32c",
        "layers": {str(k): v for k, v in sorted(layers.items())},
    }


def validate_sidecar(obj: object, spec: PackSpec) -> dict[int, list[int]]:
    """Check a parsed sidecar against ``spec``; return {layer: [crc32c per expert]}.

    Raises :class:`InvalidJSON` naming the first mismatch (stale, foreign or hostile content).
    """
    if not isinstance(obj, dict):
        raise InvalidJSON(f"expected a JSON object, found {type(obj).__name__}")
    if obj.get("format") != FORMAT:
        raise InvalidJSON(f"format is {str(obj.get('format'))[:40]!r}, expected {FORMAT!r}")
    if not is_int(obj.get("version")) or obj["version"] != VERSION:
        raise InvalidJSON(f"version is {str(obj.get('version'))[:40]}, expected {VERSION}")
    want = _new_sidecar(spec, {})
    for key in (
        "tag",
        "tp_rank",
        "pp_rank",
        "n_layers",
        "n_experts",
        "row_bytes",
        "slot_bytes",
        "stride",
        "file_bytes",
        "identity_hash",
        "checksum",
    ):
        v = obj.get(key)
        if type(v) is not type(want[key]) or v != want[key]:
            raise InvalidJSON(f"{key} is {str(v)[:60]!r}, expected {want[key]!r}")
    ident = obj.get("identity")
    if not isinstance(ident, dict):
        raise InvalidJSON("identity is not an object")
    try:
        same = canonical_identity(ident) == canonical_identity(spec.identity)
    except (TypeError, ValueError):
        same = False
    if not same:
        raise InvalidJSON("identity differs from the requested one (a pack of another checkpoint)")
    layers = obj.get("layers")
    if not isinstance(layers, dict):
        raise InvalidJSON("layers is not an object")
    out: dict[int, list[int]] = {}
    for k, v in layers.items():
        if not (
            isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 6 and str(int(k)) == k
        ):
            raise InvalidJSON(f"layer key {k[:20]!r} is not a layer index")
        layer = int(k)
        if layer >= spec.n_layers:
            raise InvalidJSON(f"layer {layer} out of range [0, {spec.n_layers})")
        if not isinstance(v, list) or len(v) != spec.n_experts:
            raise InvalidJSON(f"layer {layer}: expected {spec.n_experts} checksums")
        if not all(is_int(c) and 0 <= c < 1 << 32 for c in v):
            raise InvalidJSON(f"layer {layer}: checksums must be ints in [0, 2**32)")
        out[layer] = v
    return out


def read_sidecar(directory: str | os.PathLike | None, spec: PackSpec) -> dict[int, list[int]]:
    """The written layers of ``spec``'s pack in ``directory`` (raises InvalidJSON when stale)."""
    p = spec.paths(directory)
    layers = validate_sidecar(load_json(p.sidecar, _sidecar_max_bytes(spec)), spec)
    try:
        size = os.stat(p.pack).st_size
    except FileNotFoundError:
        raise InvalidJSON("the pack file is missing") from None
    if size != spec.file_bytes:
        raise InvalidJSON(f"pack holds {size} bytes, expected {spec.file_bytes}")
    return layers


@contextlib.contextmanager
def _flock(path: Path, exclusive: bool) -> Iterator[None]:
    """flock on ``path`` (created when missing). In a read-only directory a shared lock is skipped:
    the sidecar is replaced atomically, so readers still see a whole one."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        if exclusive:
            raise
        fd = -1
    try:
        if fd >= 0:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        if fd >= 0:
            os.close(fd)


def _free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class PackWriter:
    """Writes layers of one pack. Safe against crashes (kill -9) and concurrent writers."""

    def __init__(
        self,
        directory: str | os.PathLike | None,
        spec: PackSpec,
        *,
        cap_bytes: int | None = None,
        min_free_bytes: int = 64 << 20,
        durable: bool = True,
    ) -> None:
        self.spec = spec
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.paths = spec.paths(self.directory)
        self.path = self.paths.pack
        self.min_free_bytes = int(min_free_bytes)
        self._faults = _faults.active()  # tests only (moet_store._faults)
        self._durable = durable
        self._written = 0
        self._fd = -1
        if cap_bytes is not None:
            prune(self.directory, cap_bytes, keep_identities=[spec.identity_hash])
        with _flock(self.paths.lock, True):
            layers = self._ensure_valid()
            self._reopen()
        missing = self.spec.n_layers - len(layers)
        need = missing * spec.layer_bytes
        free = _free_bytes(self.directory)
        if missing and free < need + self.min_free_bytes:
            self.close()
            raise StoreError(
                errno.ENOSPC,
                f"not enough free space in {self.directory} for pack {self.path.name}: "
                f"{missing} layers still to write need {need} bytes (+{self.min_free_bytes} "
                f"reserve), found {free} free; free disk space, choose another directory "
                f"or lower the cache cap",
            )

    # -- internals (call with the exclusive lock held)
    def _ensure_valid(self) -> dict[int, list[int]]:
        try:
            return read_sidecar(self.directory, self.spec)
        except InvalidJSON as e:
            reason = str(e)
        if reason != "missing" or self.path.exists():
            log.warning("moet-store: rebuilding stale pack %s: sidecar %s", self.path, reason)
        self._rebuild()
        return {}

    def _rebuild(self) -> None:
        # empty sidecar first: a crash between the two steps leaves nothing listed
        atomic_write_json(self.paths.sidecar, _new_sidecar(self.spec, {}), durable=self._durable)
        tmp = self.path.with_name(f".{self.path.name}.new.{os.getpid()}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(fd, self.spec.file_bytes)
            if self._durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        if self._durable:
            fsync_dir(self.directory)

    def _reopen(self) -> None:
        st = os.stat(self.path)
        if self._fd >= 0:
            cur = os.fstat(self._fd)
            if (cur.st_ino, cur.st_dev) == (st.st_ino, st.st_dev):
                return
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)

    # -- API
    def layers_written(self) -> list[int]:
        try:
            return sorted(read_sidecar(self.directory, self.spec))
        except InvalidJSON:
            return []

    def missing_layers(self) -> list[int]:
        done = set(self.layers_written())
        return [i for i in range(self.spec.n_layers) if i not in done]

    def write_layer(self, layer: int, rows: object) -> bool:
        """Write one layer: ``rows`` is a C-contiguous uint8 buffer [n_experts, row_bytes].

        Returns True when written, False when the layer was already there with the same bytes.
        The layer becomes visible to readers only once its rows and checksums are durable.
        """
        spec = self.spec
        if self._fd < 0:
            raise StoreError(errno.EBADF, f"writer of {self.path} is closed")
        if not is_int(layer) or not 0 <= layer < spec.n_layers:
            raise IndexError(f"layer {layer!r} out of range [0, {spec.n_layers}) for {self.path}")
        mv = memoryview(rows)
        if not mv.c_contiguous:
            raise ValueError("rows must be a C-contiguous buffer [n_experts, row_bytes]")
        want = spec.n_experts * spec.row_bytes
        if mv.nbytes != want:
            raise ValueError(
                f"rows hold {mv.nbytes} bytes, expected n_experts * row_bytes = "
                f"{spec.n_experts} * {spec.row_bytes} = {want}"
            )
        mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        with _flock(self.paths.lock, True):
            layers = self._ensure_valid()
            self._reopen()
            if layer in layers:
                if _core.crc32c_rows(mv, spec.row_bytes) == layers[layer]:
                    return False
                raise StoreError(
                    errno.EEXIST,
                    f"layer {layer} of {self.path} is already written with different bytes: "
                    f"packs are read-only once written; the identity must change when the "
                    f"content does (or delete the pack to rebuild it)",
                )
            free = _free_bytes(self.directory)
            if free < spec.layer_bytes + self.min_free_bytes:
                raise StoreError(
                    errno.ENOSPC,
                    f"not enough free space to write layer {layer} of {self.path}: need "
                    f"{spec.layer_bytes} bytes (+{self.min_free_bytes} reserve), found {free}; "
                    f"layers {sorted(layers)} are intact; free space and rerun the writer",
                )
            try:
                crcs, self._written = _core.write_rows(
                    self._fd,
                    mv,
                    spec.n_experts,
                    spec.row_bytes,
                    spec.stride,
                    layer * spec.layer_bytes,
                    self._faults,
                    self._written,
                )
                if self._durable:
                    os.fdatasync(self._fd)
            except OSError as e:
                raise StoreError(
                    e.errno or errno.EIO,
                    f"writing layer {layer} of {self.path} failed: {e.strerror or e}; "
                    f"expected {spec.layer_bytes} bytes written; layers {sorted(layers)} are "
                    f"intact and this layer stays unlisted; fix the cause (free disk space?) "
                    f"and rerun the writer",
                ) from None
            layers[layer] = crcs
            try:
                atomic_write_json(
                    self.paths.sidecar, _new_sidecar(spec, layers), durable=self._durable
                )
            except OSError as e:
                raise StoreError(
                    e.errno or errno.EIO,
                    f"updating the sidecar {self.paths.sidecar} failed: {e.strerror or e}; "
                    f"layer {layer} stays unlisted, earlier layers are intact; rerun the writer",
                ) from None
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> PackWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def open_pack_for_write(
    directory: str | os.PathLike | None, spec: PackSpec, **kwargs: object
) -> PackWriter:
    """Open (creating or rebuilding as needed) the pack of ``spec`` in ``directory`` for writing."""
    return PackWriter(directory, spec, **kwargs)  # type: ignore[arg-type]


def list_packs(directory: str | os.PathLike | None = None) -> list[dict]:
    """Pack files in ``directory`` with size, identity hash and sidecar status."""
    d = Path(directory) if directory is not None else default_cache_dir()
    out = []
    if not d.is_dir():
        return out
    for p in sorted(d.glob("*.pack")):
        m = re.match(r"^([A-Za-z0-9_]+)-tp(\d+)-pp(\d+)-([0-9a-f]{16})\.pack$", p.name)
        side = p.with_name(p.name + ".json")
        info: dict = {"path": str(p), "name": p.name, "valid_name": bool(m)}
        try:
            st = p.stat()
            info["bytes"] = st.st_blocks * 512
            info["size"] = st.st_size
        except OSError:
            continue
        info["identity_hash"] = m.group(4) if m else None
        try:
            obj = load_json(side, 64 << 20)
            layers = obj.get("layers") if isinstance(obj, dict) else None
            info["layers_written"] = len(layers) if isinstance(layers, dict) else None
            info["n_layers"] = obj.get("n_layers") if isinstance(obj, dict) else None
        except InvalidJSON as e:
            info["layers_written"] = None
            info["sidecar_error"] = str(e)
        last = [st.st_mtime]
        for extra in (side, p.with_name(p.name + ".heat.json")):
            with contextlib.suppress(OSError):
                last.append(extra.stat().st_mtime)
        info["last_used"] = max(last)
        out.append(info)
    return out


def prune(
    directory: str | os.PathLike | None,
    cap_bytes: int,
    keep_identities: Iterable[str] = (),
) -> list[str]:
    """Delete stale packs (identity hash not in ``keep_identities``, or no valid name/sidecar),
    least recently used first, until the packs in ``directory`` use at most ``cap_bytes``.

    A pack locked by a writer is skipped. Returns the deleted pack paths.
    """
    keep = set(keep_identities)
    packs = list_packs(directory)
    total = sum(p["bytes"] for p in packs)
    removed: list[str] = []
    if total <= cap_bytes:
        return removed
    stale = [p for p in packs if p["identity_hash"] not in keep or p["layers_written"] is None]
    stale.sort(key=lambda p: p["last_used"])
    for p in stale:
        if total <= cap_bytes:
            break
        path = Path(p["path"])
        lock = path.with_name(path.name + ".lock")
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # in use by a writer
            for suffix in (".json", ".heat.json", ""):
                with contextlib.suppress(FileNotFoundError):
                    path.with_name(path.name + suffix).unlink()
            # the empty lock file stays: unlinking it would let a writer that opened it a moment
            # ago hold a lock on an inode that a later writer no longer sees
        finally:
            os.close(fd)
        total -= p["bytes"]
        removed.append(str(path))
        log.info("moet-store: pruned stale pack %s (%d bytes)", path, p["bytes"])
    if total > cap_bytes:
        log.warning(
            "moet-store: packs in %s use %d bytes, over the cap of %d, and none left is stale",
            directory,
            total,
            cap_bytes,
        )
    return removed
