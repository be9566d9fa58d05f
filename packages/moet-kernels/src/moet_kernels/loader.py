"""Finding and loading the shipped cubins (design.md, Kernels).

The loader will load every cubin with `cuda.bindings.driver` (cuModuleLoadData) before graph
capture and launch on torch's current stream. This version ships no cubins, so the probe below
always answers "unavailable" with the reason, and callers use the torch reference
(`moet_kernels.reference`).
"""

from __future__ import annotations

from importlib import resources

CUBIN_DIR = "cubins"  # package data folder: moet_kernels/cubins/*.cubin


def shipped_cubins() -> list[str]:
    """Names of the cubins packaged with this build (none yet)."""
    folder = resources.files("moet_kernels").joinpath(CUBIN_DIR)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".cubin"))


def _cuda_device() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)


def kernels_available() -> tuple[bool, str]:
    """Whether the GPU kernels can run here, and why not when they cannot.

    Returns `(True, "")` only when kernels can actually be launched; in this version never.
    """
    if not _cuda_device():
        return False, "no CUDA device; ops fall back to the torch reference"
    cubins = shipped_cubins()
    if not cubins:
        return False, "this build ships no cubins yet; ops fall back to the torch reference"
    return False, (
        f"{len(cubins)} cubin(s) found, but this version of moet-kernels has no loader for them; "
        "ops fall back to the torch reference"
    )


__all__ = ["kernels_available", "shipped_cubins"]
