"""moet-vllm: the vLLM plugin of moet and the `moet` command.

vLLM loads the plugin through the `vllm.general_plugins` entry point (`moet_vllm.plugin:register`).
This version checks the installed vLLM's version and provides the `moet` command; the quantization
method, residency manager and worker hooks come with the vLLM plugin issue.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
