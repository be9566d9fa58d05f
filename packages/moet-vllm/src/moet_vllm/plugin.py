"""vLLM's entry into moet: `register()`, the `vllm.general_plugins` entry point.

vLLM calls every general plugin's function in each of its processes (API server, engine core,
workers), possibly more than once, so `register()` is idempotent.

What it does in this version: checks the installed vLLM against `compat.SUPPORTED` (raising
`MoetVllmError` outside it) and logs one line. It registers nothing with vLLM yet: the "moet"
quantization method, the MoE method and the worker hooks for miss/replay come with the vLLM plugin
issue. Installing this version therefore changes nothing about how any model serves.
"""

from __future__ import annotations

import logging
import threading

from . import __version__, compat

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Idempotent plugin entry point; raises MoetVllmError for an unsupported vLLM."""
    global _registered
    with _lock:
        if _registered:
            return
        found = compat.installed_vllm()
        if found is None:
            logger.info("moet-vllm %s: vLLM is not installed; nothing to register", __version__)
        else:
            dist, version = found
            compat.check_vllm_version(version)
            logger.info(
                "moet-vllm %s: loaded by %s %s (supported %s); no quantization method or hooks "
                "are registered by this version",
                __version__,
                dist,
                version,
                compat.SUPPORTED,
            )
        _registered = True


def is_registered() -> bool:
    return _registered


__all__ = ["is_registered", "register"]
