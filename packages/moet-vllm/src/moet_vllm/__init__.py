"""moet-vllm: the vLLM plugin of moet and the `moet` command.

vLLM loads the plugin through the `vllm.general_plugins` entry point (`moet_vllm.plugin:register`).
The plugin checks the installed vLLM's version and registers the quantization method (method.py);
loading, tiered residency and the `moet` command live in their own modules (README.md).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError as _NotInstalled
from importlib.metadata import version as _dist_version

try:  # the pyproject's version, as installed: its one place
    __version__ = _dist_version("moet-vllm")
except _NotInstalled:  # imported from a source tree (PYTHONPATH), not installed
    __version__ = "0+source"

__all__ = ["__version__"]
