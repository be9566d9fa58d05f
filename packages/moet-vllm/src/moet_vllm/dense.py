"""Quantized dense layers (attention, shared experts, dense MLPs) of the checkpoints moet serves.

moet re-quantizes routed experts only; dense layers keep the checkpoint's precision (design.md).
`MoetConfig.dense` says how they run:

* ``checkpoint``  the checkpoint's own vLLM method (e.g. `fp8`, `compressed-tensors`, `modelopt`)
  builds and runs them, as it would without moet;
* ``dequantize``  moet-quant decodes them exactly (float64) at load and vLLM runs them as plain
  float weights of the model's dtype: for methods the platform cannot run;
* ``auto``        ``checkpoint`` where vLLM runs that method on this platform, else ``dequantize``.

`DenseDequantizer` is the load-time half of ``dequantize``: it rewrites vLLM's weight stream so
that each quantized projection's tensors (weight + scales) arrive as one float `.weight`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from moet_quant.checkpoint import dense_projections

log = logging.getLogger("vllm.moet")


def dense_method(qc: dict | None) -> str | None:
    """The checkpoint's own quantization method for its dense layers (None: unquantized)."""
    return (qc or {}).get("quant_method")


class DenseDequantizer:
    """Rewrites a weight stream: quantized dense projections -> exact float weights."""

    def __init__(self, model_path: str | Path):
        self.projections = dense_projections(model_path)
        self.done: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.projections)

    @property
    def formats(self) -> list[str]:
        return sorted({p.fmt for p in self.projections.values()})

    def __call__(self, weights: Iterator[tuple[str, torch.Tensor]]):
        for name, tensor in weights:
            base = name.rpartition(".")[0]
            proj = self.projections.get(base)
            if proj is None:
                yield name, tensor
            elif base not in self.done:  # the first of its tensors: yield the whole weight once
                self.done.add(base)
                # float64: the model's dtype rounds it once, in the parameter's copy
                yield f"{base}.weight", torch.from_numpy(proj.dequant())
