"""Safetensors through the `safetensors` library, with moet's checks and atomic writes around it.

Reading: the header is checked first (length, JSON, every entry's dtype, shape, byte count and
bounds, overlaps) so that a truncated or corrupt file is one clear error naming the file and
tensor; then the library opens the file (`safe_open`: lazy, mmap-backed, its own checks too) and
reads one tensor, or one leading-index slice of it, at a time. Nothing is unpickled and no
checkpoint is held in RAM. bf16 and fp8 come as raw bits (see `RAW_BITS`).
Writing streams tensors into `<name>.partial`, has the library open it, and renames only after
fsync, so a file that exists under its final name is complete and readable by the library.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors

from .errors import CheckpointError

# safetensors dtype -> numpy storage dtype (bf16 and fp8 travel as raw bits)
STORAGE_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(np.uint8),
    "F8_E5M2": np.dtype(np.uint8),
    "F8_E8M0": np.dtype(np.uint8),
}
# numpy has no bf16/fp8 and the library's numpy framework refuses them: their bits come from a
# read-only map of the file instead (the library still validated the file)
RAW_BITS = frozenset({"BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"})
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset in the file
    nbytes: int


def _fail(
    path: Path, what: str, todo: str = "re-download or re-export this file"
) -> CheckpointError:
    return CheckpointError(f"{path}: {what}; {todo}")


class SafetensorsFile:
    """One .safetensors file: a validated header and mmap-backed tensor views."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._fh = open(self.path, "rb")
        except FileNotFoundError:
            raise _fail(self.path, "file not found", "check the checkpoint directory") from None
        except OSError as e:
            raise _fail(self.path, f"cannot open ({e.strerror})", "check permissions") from None
        size = os.fstat(self._fh.fileno()).st_size
        head = self._fh.read(8)
        if len(head) < 8:
            raise _fail(
                self.path,
                f"truncated: {size} bytes, a safetensors file starts with an 8-byte header length",
            )
        (hlen,) = struct.unpack("<Q", head)
        if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
            raise _fail(
                self.path,
                f"header length {hlen} does not fit a file of {size} bytes "
                "(truncated or not a safetensors file)",
            )
        raw = self._fh.read(hlen)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _fail(self.path, f"corrupt header JSON ({e})") from None
        if not isinstance(header, dict):
            raise _fail(self.path, "header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise _fail(self.path, "__metadata__ is not an object")
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in meta.items()}
        data_start = 8 + hlen
        data_len = size - data_start
        self.tensors: dict[str, TensorInfo] = {}
        spans = []
        for name, entry in header.items():
            self.tensors[name] = info = self._validate(name, entry, data_start, data_len)
            spans.append((info.offset, info.offset + info.nbytes, name))
        spans.sort()
        for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
            if start_b < end_a:
                raise _fail(self.path, f"tensors {a!r} and {b!r} overlap")
        self.size = size
        self._mm: mmap.mmap | None = None
        try:  # the library's own checks (e.g. bytes no tensor covers) on top of ours
            self._st = safetensors.safe_open(str(self.path), framework="numpy")
        except safetensors.SafetensorError as e:
            self._fh.close()
            raise _fail(self.path, f"refused by the safetensors library ({e})") from None

    def _validate(self, name: str, e: object, data_start: int, data_len: int) -> TensorInfo:
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
            raise _fail(self.path, f"tensor {name!r}: header entry lacks dtype/shape/data_offsets")
        dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in STORAGE_DTYPES:
            raise _fail(
                self.path,
                f"tensor {name!r}: unsupported dtype {dtype!r} (supported: "
                f"{', '.join(STORAGE_DTYPES)})",
                "convert it to a supported dtype",
            )
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise _fail(self.path, f"tensor {name!r}: bad shape {shape!r}")
        if not (
            isinstance(offs, list)
            and len(offs) == 2
            and all(isinstance(o, int) and o >= 0 for o in offs)
        ):
            raise _fail(self.path, f"tensor {name!r}: bad data_offsets {offs!r}")
        want = int(np.prod(shape, dtype=np.int64)) * STORAGE_DTYPES[dtype].itemsize
        begin, end = offs
        if end - begin != want:
            raise _fail(
                self.path,
                f"tensor {name!r}: {dtype}{shape} needs {want} bytes, header gives {end - begin}",
            )
        if end > data_len:
            raise _fail(
                self.path,
                f"tensor {name!r}: data ends at byte {data_start + end} but the "
                f"file has {data_start + data_len} bytes (truncated)",
            )
        return TensorInfo(name, dtype, tuple(shape), self.path, data_start + begin, want)

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mm

    def array(self, name: str) -> np.ndarray:
        """A tensor in its storage dtype (bf16/fp8 as raw bits, read-only)."""
        return self._read(name, None)

    def part(self, name: str, index: int) -> np.ndarray:
        """`array(name)[index]` reading only that slice (one expert of a fused tensor)."""
        return self._read(name, index)

    def _read(self, name: str, index: int | None) -> np.ndarray:
        info = self.tensors.get(name)
        if info is None:
            raise _fail(self.path, f"has no tensor {name!r}", "check the checkpoint index")
        if index is not None and not (info.shape and 0 <= index < info.shape[0]):
            raise IndexError(
                f"{self.path}: tensor {name!r} {list(info.shape)} has no index {index}"
            )
        if info.dtype in RAW_BITS:
            dt = STORAGE_DTYPES[info.dtype]
            if info.nbytes == 0:
                return np.zeros(info.shape, dtype=dt)
            buf = np.frombuffer(self._map(), dtype=np.uint8, count=info.nbytes, offset=info.offset)
            a = buf.view(dt).reshape(info.shape)
            return a if index is None else a[index]
        try:
            if index is None:
                return self._st.get_tensor(name)
            return self._st.get_slice(name)[index]
        except safetensors.SafetensorError as e:
            raise _fail(self.path, f"tensor {name!r}: {e}") from None

    def raw_bytes(self, name: str) -> memoryview:
        """A tensor's bytes as stored, for a verbatim copy: a view of the map (the library has
        checked the file at open), not a decoded copy."""
        info = self.tensors[name]
        return memoryview(self._map())[info.offset : info.offset + info.nbytes]

    def close(self) -> None:
        self._st.__exit__(None, None, None)
        self._mm = None  # views may still hold the map; it closes when they are gone
        self._fh.close()


class ShardedSafetensors:
    """All safetensors shards of a checkpoint directory, by tensor name.

    Uses `model.safetensors.index.json` when present (every shard it names must exist and hold the
    tensors the index says), else every `*.safetensors` file in the directory.
    """

    INDEX = "model.safetensors.index.json"

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(
                f"{self.dir}: not a directory; pass a checkpoint directory "
                "holding config.json and *.safetensors"
            )
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}  # tensor name -> shard file name
        index = self.dir / self.INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(
                    f"{index}: corrupt index (expected a JSON object with a "
                    "'weight_map'); re-download it"
                ) from None
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not (self.dir / s).is_file()]
            if missing:
                raise CheckpointError(
                    f"{self.dir}: missing shard(s) {', '.join(missing)} named by "
                    f"{self.INDEX}; download the complete checkpoint"
                )
            for s in shards:
                self.files[s] = SafetensorsFile(self.dir / s)
            for name, shard in weight_map.items():
                if name not in self.files[shard].tensors:
                    raise CheckpointError(
                        f"{self.dir / shard}: has no tensor {name!r} although "
                        f"{self.INDEX} says so; the shard is stale or corrupt"
                    )
                self.where[name] = shard
        else:
            shards = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(
                    f"{self.dir}: no *.safetensors files (moet never loads "
                    "pickled .bin/.pt weights); export the model to safetensors"
                )
            for s in shards:
                f = self.files[s] = SafetensorsFile(self.dir / s)
                for name in f.tensors:
                    if name in self.where:
                        raise CheckpointError(
                            f"{self.dir}: tensor {name!r} is in both "
                            f"{self.where[name]} and {s}; remove the stale shard"
                        )
                    self.where[name] = s

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return list(self.where)

    def info(self, name: str) -> TensorInfo:
        return self.files[self.where[name]].tensors[name]

    def array(self, name: str) -> np.ndarray:
        return self._file(name).array(name)

    def part(self, name: str, index: int) -> np.ndarray:
        return self._file(name).part(name, index)

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self.where:
            raise CheckpointError(f"{self.dir}: no tensor {name!r} in any shard")
        return self.files[self.where[name]]

    def shard_names(self) -> list[str]:
        return list(self.files)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


@dataclass(frozen=True)
class OutTensor:
    """A tensor to write: its name, safetensors dtype, shape, and a producer of its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * STORAGE_DTYPES[self.dtype].itemsize


def header_bytes(tensors: Iterable[OutTensor], metadata: dict[str, str] | None = None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    off = 0
    for t in tensors:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [off, off + t.nbytes],
        }
        off += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # 8-byte aligned data start, as the reference writer does
    return struct.pack("<Q", len(raw)) + raw


def planned_size(tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> int:
    return len(header_bytes(tensors, metadata)) + sum(t.nbytes for t in tensors)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(
    path: str | os.PathLike,
    tensors: list[OutTensor],
    data: Iterator[bytes | memoryview | np.ndarray],
    metadata: dict[str, str] | None = None,
) -> int:
    """Stream `data` (one buffer per tensor, in order) into `path` atomically; returns bytes written.

    The file appears under its final name only after every byte is written and fsynced and the
    library has opened it. Not the library's writer: it takes every tensor of a file in memory at
    once (safetensors#291) and numpy arrays cannot carry bf16/fp8, while `convert` streams a
    shard one projection at a time.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    written = 0
    with open(tmp, "wb") as f:
        f.write(header_bytes(tensors, metadata))
        for t, buf in zip(tensors, data, strict=True):
            mv = (
                memoryview(np.ascontiguousarray(buf).reshape(-1).view(np.uint8))  # 0-size too
                if isinstance(buf, np.ndarray)
                else memoryview(buf).cast("B")
            )
            if mv.nbytes != t.nbytes:
                raise ValueError(
                    f"{path}: tensor {t.name!r} produced {mv.nbytes} bytes, expected {t.nbytes}"
                )
            f.write(mv)
            written += mv.nbytes
        f.flush()
        os.fsync(f.fileno())
    try:
        with safetensors.safe_open(str(tmp), framework="numpy"):
            pass
    except safetensors.SafetensorError as e:
        tmp.unlink()
        raise ValueError(
            f"{path}: the safetensors library refuses what was written ({e})"
        ) from None
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return written
