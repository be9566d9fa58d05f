"""moet-kernels: 2-bit MoE GPU kernels and their torch reference implementations.

This version ships the torch reference implementations (`moet_kernels.reference`, the CPU path and
the test oracle), the layout id (`moet_kernels.layout`) and the loader's availability probe
(`moet_kernels.loader`). The CUDA kernels and their cubins come with the kernels issue.
"""

from __future__ import annotations

from importlib.metadata import version as _dist_version

from .layout import LAYOUT_ID

__version__ = _dist_version("moet-kernels")  # the pyproject's, as installed: its one place

__all__ = ["LAYOUT_ID", "__version__"]
