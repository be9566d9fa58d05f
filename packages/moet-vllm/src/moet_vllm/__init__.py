"""moet-vllm: the vLLM plugin of moet and the `moet` command.

vLLM loads the plugin through the `vllm.general_plugins` entry point (`moet_vllm.plugin:register`).
The plugin checks the installed vLLM's version and registers the quantization method (method.py);
loading, tiered residency and the `moet` command live in their own modules (README.md).
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
