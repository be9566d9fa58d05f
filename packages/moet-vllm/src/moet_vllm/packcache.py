"""The persistent quantization cache: a model's expert rows in moet-store packs, one pack per
tier (`w2`; `fp4r` or `fp4x` for the FP4 tier).

The first boot quantizes experts and writes each MoE layer's rows (one row per expert of this
rank, in the layout its compute path reads: `moet_kernels.layout.NativeRowLayout` for the GPU
kernels, `RowLayout` for the torch reference); later boots read them and skip re-quantization. A
pack is
keyed by an identity that changes with the checkpoint (`ckpt_id`), the format, layout and row
sections (the ABI string), the quantizer's settings and the TP size, so a stale pack is never
served (moet-store rebuilds it). When the cache cannot be used (disabled, an unresolvable
checkpoint identity, an unwritable or full directory) the model still serves, re-quantizing,
with one warning.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

import moet_store
from moet_kernels.layout import NativeRowLayout, RowLayout

from .config import MoetConfig
from .residency.sizing import arena_bytes

log = logging.getLogger(__name__)


def abi_string(cfg: MoetConfig, layout: RowLayout | NativeRowLayout) -> str:
    """`<format>+<layout>+<row sections>` (design.md, Identity and ABI): packs of another row
    layout have another identity, so they are rebuilt, never misread."""
    return f"{cfg.format}+{layout.layout_id}+{layout.spec}"


class ExpertPackCache:
    def __init__(
        self,
        cfg: MoetConfig,
        ckpt_id: str | None,
        layout: RowLayout | NativeRowLayout,
        n_layers: int,
        n_experts: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        stage: list[int] | None = None,
        layers: list[int] | None = None,
    ):
        """`stage`: under pipeline parallelism, the model layers of this stage's MoE layers (the
        pack's rows, in order): part of the identity, so another split rebuilds the pack.
        `layers`: the model layer of each row, where the caller knows them (`of_rank`)."""
        self.layout = layout  # its tier's tag names the pack (design.md, Pack files)
        self.directory = Path(cfg.cache_dir) if cfg.cache_dir else moet_store.default_cache_dir()
        identity = {
            "ckpt_id": ckpt_id,
            "abi": abi_string(cfg, layout),
            "zero_mode": cfg.zero_mode,
            "mode": cfg.mode,
            "tp_size": tp_size,
        }
        if stage is not None:
            identity["pp_stage_layers"] = list(stage)
        self.spec = moet_store.PackSpec(
            layout.tier.tag, tp_rank, pp_rank, n_layers, n_experts, layout.row_bytes, identity
        )
        self.reason = "enabled"
        if not cfg.pack_cache:
            self.reason = f"disabled ({cfg.sources.get('pack_cache', 'config')})"
        elif ckpt_id is None:
            self.reason = "disabled: the checkpoint's identity cannot be resolved"
        self.enabled = self.reason == "enabled"
        self._writer: moet_store.PackWriter | None = None
        self._store: moet_store.Store | None = None
        self._cached: set[int] | None = None
        self.layers = layers

    @classmethod
    def of_rank(
        cls, cfg: MoetConfig, source, layout, tp_rank: int, tp_size: int, pp_rank: int = 0,
        stage: range | None = None,
    ) -> ExpertPackCache:  # fmt: skip
        """The pack of one (TP, PP) rank of `source`'s experts. Under pipeline parallelism
        (`stage`: the decoder layers vLLM builds on the stage) it holds only the stage's MoE
        layers; `layers` are the model layers of its rows, in order."""
        layers = [m for m in source.moe_layers if stage is None or m in stage]
        return cls(
            cfg, source.ckpt_id, layout, len(layers), source.n_experts, tp_rank, tp_size, pp_rank,
            stage=None if stage is None else layers, layers=layers,
        )  # fmt: skip

    def _disable(self, why: str) -> None:
        if self.enabled:
            log.warning(
                "moet: expert pack cache off for this boot: %s; serving without it "
                "(experts are re-quantized at every boot)",
                why,
            )
        self.enabled = False
        self.reason = f"disabled: {why}"

    def cached_layers(self) -> set[int]:
        """Layers whose rows are in a valid pack (read once: packs are read-only after boot)."""
        if not self.enabled:
            return set()
        if self._cached is None:
            try:
                self._cached = set(moet_store.read_sidecar(self.directory, self.spec))
            except (ValueError, OSError):  # missing, stale or foreign: nothing is cached
                self._cached = set()
        return self._cached

    def read_rows(self, layer: int) -> np.ndarray | None:
        """This rank's expert rows of `layer` uint8 [E, row_bytes] (a copy), or None if not
        cached."""
        if not self.enabled or layer not in self.cached_layers():
            return None
        try:
            if self._store is None:
                self._store = moet_store.open_store(
                    self.directory,
                    self.spec,
                    backend="pagecache",
                    stage_bytes=self.spec.stride * self.spec.n_experts,
                )
            keys = [(layer, e) for e in range(self.spec.n_experts)]
            with self._store.fetch(keys) as batch:
                rows = [
                    np.frombuffer(v, dtype=np.uint8)[: self.layout.row_bytes] for v in batch.views
                ]
                return np.stack(rows)
        except (OSError, moet_store.StoreError) as e:
            log.warning("moet: cached experts of layer %d unreadable (%s); re-quantizing", layer, e)
            return None

    def write_rows(self, layer: int, rows: np.ndarray) -> None:
        """Store `layer`'s rows uint8 [E, row_bytes]; a cache that cannot be written turns off
        for this boot (one warning), never failing the load."""
        if not self.enabled:
            return
        try:
            if self._writer is None:
                self._writer = moet_store.open_pack_for_write(self.directory, self.spec)
            self._writer.write_layer(layer, rows)
            self.cached_layers().add(layer)
        except OSError as e:  # moet_store.StoreError is an OSError: unwritable, full, ...
            self._disable(str(e))

    def hot_path(self) -> Path:
        """Where tiered residency persists the device pool's hot set (next to the pack)."""
        return self.directory / (self.spec.file_name + ".pool-hot.json")

    def open_store(self, backend: str, host_arena: str = "auto") -> moet_store.Store:
        """The packs as a host tier for tiered residency (after every layer is written); the
        `tiered` backend's pinned arena sized by `host_arena` (GiB, or "auto")."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        kwargs = {}
        if backend == "tiered":
            kwargs["arena_bytes"] = arena_bytes(host_arena, self.spec.n_rows * self.spec.stride)
        return moet_store.open_store(self.directory, self.spec, backend=backend, **kwargs)

    def close(self) -> None:
        for handle in (self._writer, self._store):
            if handle is not None:
                handle.close()
        self._writer = self._store = None
