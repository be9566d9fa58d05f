"""Loading a model's routed experts in a vLLM worker: one `MoetLoadSession` per process.

The session joins the expert source (`experts.ExpertSource`: a moet checkpoint, or an official
one re-quantized exactly) and the persistent pack cache (`packcache.ExpertPackCache`), and hands
each MoE layer its experts as rows in the layout its compute path reads (`row_layout`): the
kernels' native layout on a GPU with moet-kernels, the logical layout for the torch reference.
Rows of the native layout are packed on the layer's device (`pack_native`), which is what makes
a moet checkpoint's logical tensors servable by the kernels at load. With an FP4 tier
(`MoetConfig.serves_fp4`) each layer's FP4 rows (`ExpertSource.fp4_kind`: fp4r, or the
checkpoint's own NVFP4/MXFP4 data) reach a pack of their own beside the W2 one
(`fp4_cache`), which the FP4 pool reads (residency/fp4pool.py).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from moet_quant.progress import new_bar

from . import compat
from .config import MoetConfig
from .experts import ExpertSource, OfficialSource
from .packcache import ExpertPackCache
from .residency.manager import MoetResidencyError

log = logging.getLogger("vllm.moet")
SECTIONS = ("w13_codes", "w13_scales", "w2_codes", "w2_scales")  # a W2 row's logical sections


def pack_native(layout, sections: dict, device: torch.device) -> torch.Tensor:
    """Logical W2 sections [E, ...] (numpy or tensors) -> native rows uint8 [E, row_bytes] on
    `device` (the packing runs there: on a GPU it is a few kernels per layer)."""
    tensors = {k: torch.as_tensor(sections[k]).to(device) for k in SECTIONS}
    return layout.pack(**tensors)


class MoetLoadSession:
    """Per worker process: the expert source and pack cache shared by all MoE layers."""

    def __init__(
        self,
        cfg: MoetConfig,
        model_path: str,
        tp_rank: int,
        tp_size: int,
        native: bool,
        device: torch.device,
    ):
        self.cfg, self.native, self.device = cfg, native, device
        self.source = ExpertSource.open(model_path, cfg, tp_rank, tp_size)
        self.layout = self.source.row_layout(native)
        # a pipeline stage builds, packs and serves only its own decoder layers' experts
        pp_rank, stage = compat.pipeline_stage(self.source.n_hidden_layers)

        def cache(layout) -> ExpertPackCache:
            return ExpertPackCache.of_rank(
                cfg, self.source, layout, tp_rank, tp_size, pp_rank, stage
            )

        self.cache = cache(self.layout)
        self.fp4_layout = (
            self.source.row_layout(native, self.source.fp4_kind) if cfg.serves_fp4 else None
        )
        self.fp4_cache = cache(self.fp4_layout) if self.fp4_layout is not None else None
        # vLLM builds the checkpoint's MTP layers only to draft with them: else they never load
        drafts = compat.serves_mtp_drafter()
        self.mtp_layers = self.source.mtp_layers if drafts else []
        unserved = [] if drafts else self.source.mtp_layers
        # the MoE layers this engine serves, in pack order (MTP layers come last)
        self.moe_layers = [m for m in self.cache.layers if m not in unserved]
        self.pending = set(self.moe_layers)
        self.from_pack = self.quantized = 0
        self.seconds = self.pack_seconds = 0.0
        # re-quantizing a large official checkpoint takes minutes: a bar (TP rank 0, a terminal)
        self.bar = new_bar(
            len(self.moe_layers),
            f"moet: experts of {len(self.moe_layers)} MoE layers ({self.source.kind})",
            None if tp_rank == 0 else False,
            unit="layer",
            unit_scale=False,
        )
        log.info(
            "moet: experts of %s: %s (%s, %d MoE layers x %d experts%s%s); %s rows; pack cache %s",
            model_path,
            self.source.kind,
            self.source.source_format,
            len(self.moe_layers),
            self.source.n_experts,
            ""
            if stage is None
            else f" in pipeline stage {pp_rank}: layers {stage.start}-{stage.stop - 1}",
            f"; MTP layer(s) {unserved} unused: no MTP drafter" if unserved else "",
            "kernel-native" if native else "logical",
            self.cache.reason,
        )

    def rows(self, model_layer: int, keep: bool = True) -> np.ndarray | torch.Tensor | None:
        """One MoE layer's expert rows [E, row_bytes], from the pack cache or the checkpoint
        (then written to the cache): a tensor on the session's device for native rows, numpy
        for logical ones. With `keep=False` (tiered residency) the layer only has to reach the
        packs: a cached layer is not read back, and None is returned."""
        t0 = time.perf_counter()
        ordinal = self.cache.layers.index(model_layer)  # the layer's pack row
        if keep:
            rows = self.cache.read_rows(ordinal)
            cached = rows is not None
        else:  # tiered: a cached layer stays in the packs, unread
            rows, cached = None, ordinal in self.cache.cached_layers()
            self._fp4_rows(model_layer, ordinal)
        if cached:
            self.from_pack += 1
        else:
            rows = self._pack(self.source.layer(model_layer))
            self.cache.write_rows(
                ordinal, rows if isinstance(rows, np.ndarray) else rows.cpu().numpy()
            )
            self.quantized += 1
            if not keep and not self.cache.enabled:
                raise MoetResidencyError(
                    f"moet: tiered residency (gpu_pool={self.cfg.gpu_pool!r}) serves experts "
                    f"from the pack files, but the pack cache is off ({self.cache.reason}); "
                    "give it a writable cache_dir with room for the experts, or gpu_pool='all'"
                )
        self.seconds += time.perf_counter() - t0
        if model_layer in self.pending:
            self.pending.discard(model_layer)
            self.bar.update(1)
        if not self.pending:
            self.bar.close()
            log.info(
                "moet: expert weights ready in %.2f s: %d layers %s, %d from the pack cache%s",
                self.seconds,
                self.quantized,
                "re-quantized" if self.source.kind == OfficialSource.kind else "read as W2",
                self.from_pack,
                f"; packing to the kernels' layout took {self.pack_seconds:.2f} s"
                if self.native
                else "",
            )
        if not keep:
            return None
        if self.native and isinstance(rows, np.ndarray):
            rows = torch.from_numpy(rows).to(self.device)
        return rows

    def _fp4_rows(self, model_layer: int, ordinal: int) -> None:
        """With an FP4 tier: the layer's FP4 rows into their pack, unless it has them."""
        fc = self.fp4_cache
        if fc is None or ordinal in fc.cached_layers():
            return
        rows = self._pack(self.source.fp4_layer(model_layer), self.fp4_layout)
        fc.write_rows(ordinal, rows if isinstance(rows, np.ndarray) else rows.cpu().numpy())
        if not fc.enabled:
            raise MoetResidencyError(
                f"moet: the FP4 tier (fp4_tier={self.cfg.fp4_tier!r}) serves its rows from the "
                f"pack files, but its pack cannot be written ({fc.reason}); give the cache a "
                "writable cache_dir with room for them, or fp4_tier='none'"
            )

    def _pack(self, secs: dict, layout=None) -> np.ndarray | torch.Tensor:
        layout = self.layout if layout is None else layout
        if not self.native:
            return layout.pack(**secs)
        t0 = time.perf_counter()
        rows = pack_native(layout, secs, self.device)
        if rows.is_cuda:
            torch.cuda.synchronize(rows.device)
        self.pack_seconds += time.perf_counter() - t0
        return rows

    def sections(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Logical rows -> their four sections [E, ...] (the torch reference's parameters)."""
        return self.layout.unpack(rows)

    @property
    def done(self) -> bool:
        return not self.pending

    def close(self) -> None:
        self.cache.close()
        if self.fp4_cache is not None:
            self.fp4_cache.close()
        self.source.close()
