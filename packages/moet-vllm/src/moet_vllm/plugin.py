"""vLLM's entry into moet: `register()`, the `vllm.general_plugins` entry point.

vLLM calls every general plugin's function in each of its processes (API server, engine core,
workers), possibly more than once, so `register()` is idempotent.

What it does: checks the installed vLLM against `compat.SUPPORTED`, the versions tested for its
distribution (raising `MoetVllmError` for any other), and registers the "moet" quantization
method (`method.MoetQuantConfig`). A model without a moet `quantization_config` and without
`--quantization moet` never reaches moet code, so it serves exactly as without the plugin. It also names the directory through which workers
report tiered-residency counters to `/metrics` (residency/metrics.py); the runner hook for
miss/replay is installed when a model is loaded with tiered residency.
"""

from __future__ import annotations

import logging
import threading

from . import __version__, compat

logger = logging.getLogger("vllm.moet")  # vLLM formats and shows its own namespace

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
            compat.check_vllm_version(version, dist)
            from vllm.model_executor.layers.quantization import (
                QUANTIZATION_METHODS,
                register_quantization_config,
            )

            from .method import MoetQuantConfig

            if "moet" not in QUANTIZATION_METHODS:
                register_quantization_config("moet")(MoetQuantConfig)
            _serve_residency_metrics()
            logger.info(
                "moet-vllm %s: loaded by %s %s (supported %s); quantization method 'moet' "
                "registered",
                __version__,
                dist,
                version,
                dist + compat.SUPPORTED[dist],
            )
        _registered = True


def _serve_residency_metrics() -> None:
    """The first vLLM process names the directory workers report residency counters to, and
    exposes them on `/metrics` (residency/metrics.py); harmless for models without tiering."""
    import os
    from pathlib import Path

    from moet_store import default_cache_dir

    from .residency import metrics

    root = Path(os.environ.get("MOET_CACHE_DIR") or default_cache_dir())
    try:
        if metrics.name_run_dir(root):
            metrics.install_collector()
    except OSError as e:  # never stop vLLM for metrics
        logger.warning("moet: residency metrics unavailable (%s)", e)


def is_registered() -> bool:
    return _registered


__all__ = ["is_registered", "register"]
