"""Strict, bounded JSON reading and atomic JSON writing for sidecars and heat files."""

from __future__ import annotations

import json
import os
from pathlib import Path


class InvalidJSON(ValueError):
    """A sidecar or heat file that is missing, truncated, corrupt, oversized or hostile."""


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-finite number {name}")


def load_json(path: Path, max_bytes: int) -> object:
    """Read and parse ``path``; raise :class:`InvalidJSON` with the reason on any problem."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise InvalidJSON("missing") from None
    except OSError as e:
        raise InvalidJSON(f"unreadable ({e.strerror})") from None
    if len(data) > max_bytes:
        raise InvalidJSON(f"larger than {max_bytes} bytes")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except RecursionError:
        raise InvalidJSON("nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, huge ints, bad UTF-8
        raise InvalidJSON(f"not valid JSON ({str(e)[:120]})") from None


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj: object, *, durable: bool = True) -> None:
    """tmp + fsync + rename + directory fsync: readers see the old or the new file, never a mix."""
    data = json.dumps(obj, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}.{os.urandom(4).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def is_int(v: object) -> bool:
    return type(v) is int  # bool is not an int here
