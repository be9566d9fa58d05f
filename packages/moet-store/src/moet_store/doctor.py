"""``moet_store.doctor(path)``: what the store would use on this machine, and why.

``moet doctor`` (moet-vllm) calls this same function; :func:`format_doctor` renders it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from . import __version__, _core
from .pack import default_cache_dir, list_packs

_PROBE_REGISTER_BYTES = 64 << 20


def _odirect(path: Path) -> dict:
    """Try an O_DIRECT read of a scratch file in ``path``."""
    if not path.is_dir() or not os.access(path, os.W_OK):
        return {"supported": None, "reason": f"{path} is not a writable directory: not probed"}
    try:
        fd, name = tempfile.mkstemp(prefix=".moet-doctor-", dir=path)
    except OSError as e:
        return {"supported": None, "reason": f"cannot create a scratch file: {e.strerror}"}
    try:
        os.write(fd, b"\0" * 4096)
        os.fsync(fd)
        os.close(fd)
        buf = _core.aligned_buffer(4096)
        _core.raw_read(name, 0, buf, "pread", True)
        return {"supported": True, "reason": "aligned O_DIRECT read succeeded"}
    except OSError as e:
        return {"supported": False, "reason": f"O_DIRECT refused: {e.strerror or e}"}
    finally:
        os.unlink(name)


def doctor(path: str | os.PathLike | None = None) -> dict:
    """Probe the engine (io_uring: available/blocked/absent), buffer registration under the
    memlock limit, O_DIRECT on ``path``, free space, and the packs found in ``path``."""
    p = Path(path) if path is not None else default_cache_dir()
    probe = _core.probe_uring()
    engine = "io_uring" if probe["ok"] else "pread"
    reason = probe["reason"] if probe["ok"] else f"io_uring {probe['state']}: {probe['reason']}"
    reg = _core.probe_register(_PROBE_REGISTER_BYTES)
    soft, hard = _core.memlock_limit()
    info: dict = {
        "version": __version__,
        "path": str(p),
        "path_exists": p.is_dir(),
        "liburing_built": probe["built"],
        "io_uring": probe["state"],
        "engine": engine,
        "reason": reason,
        "registered_buffers": reg["registered"],
        "register_note": reg["note"].strip("; "),
        "register_probe_bytes": _PROBE_REGISTER_BYTES,
        "memlock_soft": soft,
        "memlock_hard": hard,
        "crc32c_hw": _core.crc32c_hw(),
        "cpus": os.cpu_count(),
    }
    od = _odirect(p)
    info["o_direct"] = od["supported"]
    info["o_direct_reason"] = od["reason"]
    probe_dir = p if p.is_dir() else next((q for q in p.parents if q.is_dir()), Path("/"))
    du = shutil.disk_usage(probe_dir)
    info["free_bytes"] = du.free
    info["total_bytes"] = du.total
    packs = list_packs(p) if p.is_dir() else []
    info["packs"] = len(packs)
    info["pack_bytes"] = sum(x["bytes"] for x in packs)
    info["pack_list"] = packs
    return info


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 0:
        return "unlimited"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_doctor(d: dict) -> str:
    """Human-readable lines for a :func:`doctor` dict."""
    lines = [
        f"moet-store {d['version']} doctor: {d['path']}"
        + ("" if d["path_exists"] else " (does not exist yet)"),
        f"  engine            {d['engine']}  ({d['reason']})",
        f"  liburing built    {'yes' if d['liburing_built'] else 'no'}",
        f"  registered bufs   {'yes' if d['registered_buffers'] else 'no'}"
        f"  ({d['register_note'] or 'n/a'}; probe {_size(d['register_probe_bytes'])})",
        f"  memlock limit     soft {_size(d['memlock_soft'])}, hard {_size(d['memlock_hard'])}",
        f"  O_DIRECT          {dict([(True, 'yes'), (False, 'no')]).get(d['o_direct'], '?')}"
        f"  ({d['o_direct_reason']})",
        f"  free space        {_size(d['free_bytes'])} of {_size(d['total_bytes'])}",
        f"  crc32c            {'sse4.2' if d['crc32c_hw'] else 'table'}",
        f"  packs             {d['packs']} ({_size(d['pack_bytes'])} on disk)",
    ]
    for p in d.get("pack_list", []):
        lw = p.get("layers_written")
        state = f"{lw}/{p.get('n_layers')} layers" if lw is not None else p.get("sidecar_error")
        lines.append(f"    {p['name']}  {_size(p['size'])}  {state}")
    return "\n".join(lines)
