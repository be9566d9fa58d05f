"""moet-vllm: the vLLM plugin of moet and the `moet` command.

vLLM loads the plugin through the `vllm.general_plugins` entry point (`moet_vllm.plugin:register`).
The plugin checks the installed vLLM's version and registers the quantization method (method.py);
loading, tiered residency and the `moet` command live in their own modules (README.md).
"""

from __future__ import annotations

from importlib.metadata import version as _dist_version

__version__ = _dist_version("moet-vllm")  # the pyproject's, as installed: its one place

__all__ = ["__version__"]
