"""A MoE layer's experts as this rank's W2 sections, from any checkpoint, one layer at a time.

`ExpertSource.open(path, cfg)` reads either a moet checkpoint (its `.w2_codes` / `.w2_scales`
tensors) or an official one, re-quantized exactly by moet-quant (bf16/fp16/fp32, FP8 block in both
layouts, NVFP4, MXFP4, INT4). `layer(model_layer)` returns the four sections of
`moet_kernels.layout.RowLayout` for every expert, sharded for tensor parallelism along the expert
intermediate dimension: w13 (gate over up) takes rows, w2 (down) takes columns of K. Peak memory is
one layer of this rank's W2 data plus one source projection. `fp4_layer(model_layer)` gives the
FP4 tier's rows (`fp4r`: e2m1 nibbles on the W2 reference block scales) the same way: an
official checkpoint re-quantizes them; a moet checkpoint converted with `--fp4-tier fp4r` stores
the refinement plane (2.5 bits a weight beside the W2 codes, against 4 for the nibbles), from
which they are rebuilt exactly.

A checkpoint whose `quantization_config` names an `expert_source` (`{"name": ..., ...}`) gets
the source registered under that name in the process (`register_source`): experts that exist in
no file, such as the benchmark path's synthetic ones (bench/serving_gpu_engine.py), reach the pack
cache and tiered residency through the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from moet_kernels.layout import NativeRowLayout, RowLayout
from moet_quant import fp4, w2
from moet_quant.arch import classify, family_for
from moet_quant.checkpoint import (
    Checkpoint,
    checkpoint_identity,
    ckpt_id,
    read_config,
    text_config,
)
from moet_quant.convert import verify_complete
from moet_quant.safetensors_io import ShardedSafetensors

from .compat import MoetVllmError
from .config import MoetConfig

PROJECTIONS = ("gate", "up", "down")


def check_tp_split(inter: int, tp_size: int, where: str) -> None:
    """Refuses a tensor-parallel size that does not give each rank whole 32-blocks of the
    experts' intermediate size (the W2 scale blocks of the down projection run along it); one
    rank splits nothing."""
    if tp_size > 1 and (inter % tp_size or (inter // tp_size) % w2.BLOCK):
        raise MoetVllmError(
            f"{where}: intermediate size {inter} split {tp_size} ways is not a multiple of "
            f"{w2.BLOCK} per rank; use a tensor-parallel size that divides "
            f"{inter // w2.BLOCK} blocks"
        )


def shard_w2(t: w2.W2Tensor, proj: str, tp_rank: int, tp_size: int, where: str) -> w2.W2Tensor:
    """This rank's part of one projection: gate/up rows [I/tp], down columns [I/tp] of K. `t`
    holds codes [N, K/c] (W2: c = 4; FP4 nibbles: c = 2) and UE8M0 scales [N, K/32]."""
    if tp_size == 1:
        return t
    n, k = t.scales.shape[0], t.scales.shape[1] * w2.BLOCK
    check_tp_split(k if proj == "down" else n, tp_size, where)
    if proj == "down":
        c, s = t.codes.shape[1] // tp_size, k // tp_size // w2.BLOCK
        return w2.W2Tensor(
            t.codes[:, tp_rank * c : (tp_rank + 1) * c],
            t.scales[:, tp_rank * s : (tp_rank + 1) * s],
        )
    r = n // tp_size
    return w2.W2Tensor(
        t.codes[tp_rank * r : (tp_rank + 1) * r], t.scales[tp_rank * r : (tp_rank + 1) * r]
    )


def stack_sections(per_expert: list[dict[str, w2.W2Tensor]]) -> dict[str, np.ndarray]:
    """[{gate, up, down} per expert] -> RowLayout sections [E, ...]."""

    def cat(proj_a: str, proj_b: str | None, part: str) -> np.ndarray:
        parts = [
            getattr(p[proj_a], part)
            if proj_b is None
            else np.concatenate([getattr(p[proj_a], part), getattr(p[proj_b], part)])
            for p in per_expert
        ]
        return np.ascontiguousarray(np.stack(parts))

    return {
        "w13_codes": cat("gate", "up", "codes"),
        "w13_scales": cat("gate", "up", "scales"),
        "w2_codes": cat("down", None, "codes"),
        "w2_scales": cat("down", None, "scales"),
    }


def fp4x_sections(per_expert: list[dict[str, dict]]) -> dict[str, np.ndarray]:
    """[{gate, up, down}: {"codes", "scales"[, "scale_2"]} per expert] (the checkpoint's own FP4
    data, moet_quant's `fp4x()`) -> the fp4x tier's RowLayout sections [E, ...]: codes and scale
    bytes as stored, NVFP4's global scale_2 as one float32 per output row."""

    def part(x: dict, key: str) -> np.ndarray:
        a = np.asarray(x[key])
        if key == "scale_2":  # per tensor (a scalar) or per row
            n = x["codes"].shape[0]
            return np.broadcast_to(a.astype(np.float32).reshape(-1), (n,)).copy()
        return a.view(np.uint8) if a.dtype.itemsize == 1 else a

    def cat(projs: tuple[str, ...], key: str) -> np.ndarray:
        return np.ascontiguousarray(np.stack(
            [np.concatenate([part(p[proj], key) for proj in projs]) for p in per_expert]
        ))  # fmt: skip

    keys = ("codes", "scales") + (("scale_2",) if "scale_2" in per_expert[0]["gate"] else ())
    out = {}
    for k in keys:
        out[f"w13_{k}"] = cat(("gate", "up"), k)
        out[f"w2_{k}"] = cat(("down",), k)
    return out


class ExpertSource(ABC):
    """Where a model's routed experts come from; see the module doc."""

    kind = "?"

    def __init__(self, path: Path, cfg: MoetConfig, tp_rank: int, tp_size: int):
        self.path, self.cfg, self.tp_rank, self.tp_size = path, cfg, tp_rank, tp_size
        self.n_experts: int = 0
        self.hidden: int = 0
        self.inter: int = 0
        self.moe_layers: list[int] = []
        self.ckpt_id: str | None = None
        self.source_format: str = "?"  # the experts' format in the checkpoint
        self.n_hidden_layers = text_config(read_config(path)).get("num_hidden_layers")

    @property
    def mtp_layers(self) -> list[int]:
        """MoE layers past the decoder stack: multi-token-prediction (drafter) layers."""
        n = self.n_hidden_layers
        return [m for m in self.moe_layers if n is not None and m >= n]

    @staticmethod
    def open(path: str | Path, cfg: MoetConfig, tp_rank: int = 0, tp_size: int = 1) -> ExpertSource:
        path = Path(path)
        qc = read_config(path).get("quantization_config") or {}
        named = qc.get("expert_source")
        if named is not None:
            name = named.get("name") if isinstance(named, dict) else None
            if name not in _REGISTERED:
                raise MoetVllmError(
                    f"{path / 'config.json'}: quantization_config.expert_source is {named!r}; "
                    f"expected {{'name': <a source registered in this process>, ...}}, "
                    f"registered: {sorted(_REGISTERED) or 'none'} (register_source adds one)"
                )
            cls = _REGISTERED[name]
        elif qc.get("quant_method") == "moet":
            cls = MoetCheckpointSource
        else:
            cls = OfficialSource
        return cls(path, cfg, tp_rank, tp_size)

    def row_layout(self, native: bool, tier: str = "w2") -> RowLayout | NativeRowLayout:
        """This rank's expert rows of `tier` (`w2`, or the FP4 tier's `fp4r`): the kernels'
        native layout (`native`, what GPU slots hold), or the logical one (the torch
        reference's)."""
        cls = NativeRowLayout if native else RowLayout
        return cls(self.hidden, self.inter // self.tp_size, tier)

    @abstractmethod
    def layer(self, model_layer: int) -> dict[str, np.ndarray]:
        """The RowLayout sections [E, ...] of one MoE layer (by the model's layer index)."""

    fp4x_format: str | None = None  # the experts' own FP4 format, where fp4x can serve it

    @property
    def fp4_kind(self) -> str:
        """The FP4 tier's rows this source serves for `cfg.fp4_tier` (a moet_kernels.layout
        tier): `fp4r`, or `fp4x-nvfp4` / `fp4x-mxfp4`, the checkpoint's own FP4 format."""
        if self.cfg.fp4_tier != "fp4x":
            return "fp4r"
        if self.fp4x_format not in ("nvfp4", "mxfp4"):
            raise MoetVllmError(
                f"{self.path}: fp4_tier='fp4x' serves the checkpoint's own NVFP4 or MXFP4 expert "
                f"data, and this {self.kind} has none (experts: {self.source_format}); use "
                "fp4_tier='fp4r' (or convert the NVFP4/MXFP4 checkpoint with --fp4-tier fp4x)"
            )
        if self.tp_size > 1:
            raise MoetVllmError(
                f"{self.path}: fp4_tier='fp4x' is not served with tensor parallelism yet "
                f"(tp_size {self.tp_size}); use fp4_tier='fp4r', or a single GPU"
            )
        return f"fp4x-{self.fp4x_format}"

    def fp4_layer(self, model_layer: int) -> dict[str, np.ndarray]:
        """The FP4 tier's RowLayout sections [E, ...] of one MoE layer (`fp4_kind`): fp4r
        (e2m1 nibbles on the W2 reference block scales, moet_quant.fp4.fp4r), sharded as
        `layer`'s; or fp4x, the checkpoint's own nibbles and scales, verbatim."""
        raise MoetVllmError(
            f"{self.path}: fp4_tier='fp4r' re-quantizes the experts from the official "
            f"checkpoint, and this source ({self.kind}) holds only W2 experts; serve the "
            "official checkpoint with --quantization moet, or fp4_tier='none'"
        )

    @abstractmethod
    def close(self) -> None:
        """Release the checkpoint's files."""


class OfficialSource(ExpertSource):
    """An official checkpoint: every expert projection re-quantized exactly by moet-quant."""

    kind = "re-quantized at load"

    def __init__(self, path: Path, cfg: MoetConfig, tp_rank: int, tp_size: int):
        super().__init__(path, cfg, tp_rank, tp_size)
        self.ck = Checkpoint(path)
        info = self.ck.info
        self.n_experts, self.hidden = info.n_experts, info.hidden_size
        self.inter, self.moe_layers = info.moe_intermediate_size, info.moe_layers
        self.ckpt_id = info.ckpt_id
        self.source_format = self.fp4x_format = info.source_format
        self._by_layer: dict[int, dict[tuple[int, str], object]] = {}
        for s in self.ck.sources:
            self._by_layer.setdefault(s.key.layer, {})[(s.key.expert, s.key.proj)] = s

    def layer(self, model_layer: int) -> dict[str, np.ndarray]:
        def quantize(s) -> w2.W2Tensor:
            return w2.quantize(s.load(), self.cfg.zero_mode, self.cfg.mode, name=s.name)

        return self._sections(model_layer, quantize)

    def fp4_layer(self, model_layer: int) -> dict[str, np.ndarray]:
        if self.fp4_kind != "fp4r":  # the checkpoint's own FP4 data, verbatim
            srcs = self._layer_sources(model_layer)
            return fp4x_sections([
                {proj: srcs[(e, proj)].fp4x() for proj in PROJECTIONS}
                for e in range(self.n_experts)
            ])  # fmt: skip

        def quantize(s) -> w2.W2Tensor:  # the nibbles, packed two a byte, on the W2 scales
            base, nibbles = fp4.fp4r(s.load(), self.cfg.zero_mode, name=s.name)
            return w2.W2Tensor(fp4.pack_nibbles(nibbles), base.scales)

        return self._sections(model_layer, quantize)

    def _layer_sources(self, model_layer: int) -> dict:
        srcs = self._by_layer.get(model_layer)
        if srcs is None:
            raise MoetVllmError(
                f"{self.path}: layer {model_layer} has no routed experts "
                f"(MoE layers: {self.moe_layers})"
            )
        return srcs

    def _sections(self, model_layer: int, quantize) -> dict[str, np.ndarray]:
        srcs = self._layer_sources(model_layer)
        per_expert = []
        for e in range(self.n_experts):
            q = {}
            for proj in PROJECTIONS:
                s = srcs[(e, proj)]
                q[proj] = shard_w2(quantize(s), proj, self.tp_rank, self.tp_size, s.name)
            per_expert.append(q)
        return stack_sections(per_expert)

    def close(self) -> None:
        self.ck.close()


class MoetCheckpointSource(ExpertSource):
    """A moet checkpoint (`moet convert`): the W2 tensors are read as they are."""

    kind = "moet checkpoint"

    def __init__(self, path: Path, cfg: MoetConfig, tp_rank: int, tp_size: int):
        super().__init__(path, cfg, tp_rank, tp_size)
        verify_complete(path)
        family_for(text_config(read_config(path)), str(path / "config.json"))
        self.st = ShardedSafetensors(path)
        self.ckpt_id = ckpt_id(checkpoint_identity(path))
        self.source_format = "moet"
        qc = read_config(path).get("quantization_config") or {}
        self.qc_fp4_tier = qc.get("fp4_tier")
        if self.qc_fp4_tier == "fp4x":  # converted with the source's own FP4 data
            self.fp4x_format = qc.get("source_format")
        self._names: dict[int, dict[tuple[int, str], str]] = {}
        for name in self.st.names():
            key, suffix, info = classify(name)  # the expert naming of moet-quant's readers
            if key is not None and suffix == "w2_codes":
                self._names.setdefault(key.layer, {})[(key.expert, key.proj)] = info["base"]
        if not self._names:
            raise MoetVllmError(
                f"{path}: a moet checkpoint without any '.w2_codes' expert "
                "tensors; reconvert it with `moet convert`"
            )
        self.moe_layers = sorted(self._names)
        first = self._names[self.moe_layers[0]]
        self.n_experts = 1 + max(e for e, _ in first)
        gate = self.st.info(first[(0, "gate")] + ".w2_codes").shape
        self.inter, self.hidden = gate[0], gate[1] * 4

    def layer(self, model_layer: int) -> dict[str, np.ndarray]:
        return self._sections(model_layer, lambda base, codes: codes)

    @property
    def fp4_kind(self) -> str:
        kind = super().fp4_kind
        if kind == "fp4r" and self.qc_fp4_tier != "fp4r":
            raise MoetVllmError(
                f"{self.path}: fp4_tier='fp4r' serves the refinement planes of a moet checkpoint "
                "converted with `moet convert --fp4-tier fp4r`, and this one was converted "
                f"without (its fp4_tier is {self.qc_fp4_tier!r}): reconvert it with --fp4-tier "
                "fp4r, serve the official checkpoint with --quantization moet, or fp4_tier='none'"
            )
        return kind

    def fp4_layer(self, model_layer: int) -> dict[str, np.ndarray]:
        if self.fp4_kind != "fp4r":  # the `.fp4_*` tensors `moet convert --fp4-tier fp4x` kept
            names = self._layer_names(model_layer)
            parts = ("codes", "scales") + (("scale_2",) if self.fp4_kind == "fp4x-nvfp4" else ())
            return fp4x_sections([
                {proj: {k: self.st.array(names[(e, proj)] + f".fp4_{k}") for k in parts}
                 for proj in PROJECTIONS}
                for e in range(self.n_experts)
            ])  # fmt: skip

        def nibbles(base: str, codes: np.ndarray) -> np.ndarray:  # 2 a byte, as fp4r rows hold
            refine = self.st.array(base + ".fp4_refine")
            return fp4.pack_nibbles(fp4.nibbles_from_refinement(codes, refine))

        return self._sections(model_layer, nibbles)

    def _layer_names(self, model_layer: int) -> dict[tuple[int, str], str]:
        names = self._names.get(model_layer)
        if names is None:
            raise MoetVllmError(
                f"{self.path}: layer {model_layer} has no W2 experts "
                f"(MoE layers: {self.moe_layers})"
            )
        return names

    def _sections(self, model_layer: int, codes_of) -> dict[str, np.ndarray]:
        """The layer's sections with each projection's codes as `codes_of(base name, W2
        codes)` gives them (on the W2 scales)."""
        names = self._layer_names(model_layer)
        expect = {
            "gate": (self.inter, self.hidden),
            "up": (self.inter, self.hidden),
            "down": (self.hidden, self.inter),
        }
        per_expert = []
        for e in range(self.n_experts):
            q = {}
            for proj in PROJECTIONS:
                base = names.get((e, proj))
                if base is None:
                    raise MoetVllmError(
                        f"{self.path}: layer {model_layer} expert {e} has no "
                        f"{proj}_proj W2 tensors; the checkpoint is incomplete"
                    )
                n, k = expect[proj]
                codes, scales = (
                    self.st.array(base + ".w2_codes"),
                    self.st.array(base + ".w2_scales"),
                )
                if codes.shape != (n, k // 4) or scales.shape != (n, k // 32):
                    raise MoetVllmError(
                        f"{self.path}: {base}: w2_codes {list(codes.shape)} / "
                        f"w2_scales {list(scales.shape)}, expected "
                        f"{[n, k // 4]} / {[n, k // 32]}"
                    )
                q[proj] = shard_w2(
                    w2.W2Tensor(codes_of(base, codes), scales), proj, self.tp_rank, self.tp_size,
                    base,
                )  # fmt: skip
            per_expert.append(q)
        return stack_sections(per_expert)

    def close(self) -> None:
        self.st.close()


_REGISTERED: dict[str, type[ExpertSource]] = {}


def register_source(name: str, cls: type[ExpertSource]) -> None:
    """Serve checkpoints whose quantization_config says `"expert_source": {"name": name, ...}`
    from `cls` (constructed as ExpertSource subclasses are, with the checkpoint's path)."""
    _REGISTERED[name] = cls


__all__ = [
    "ExpertSource",
    "MoetCheckpointSource",
    "OfficialSource",
    "register_source",
    "shard_w2",
    "stack_sections",
]
