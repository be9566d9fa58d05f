"""moet-kernels: 2-bit MoE GPU kernels and their torch reference implementations.

This version ships the torch reference implementations (`moet_kernels.reference`, the CPU path and
the test oracle), the layout id (`moet_kernels.layout`) and the loader's availability probe
(`moet_kernels.loader`). The CUDA kernels and their cubins come with the kernels issue.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError as _NotInstalled
from importlib.metadata import version as _dist_version

from .layout import LAYOUT_ID

try:  # the pyproject's version, as installed: its one place
    __version__ = _dist_version("moet-kernels")
except _NotInstalled:  # imported from a source tree (PYTHONPATH), not installed
    __version__ = "0+source"

__all__ = ["LAYOUT_ID", "__version__"]
