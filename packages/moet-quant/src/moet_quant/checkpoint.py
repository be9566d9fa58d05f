"""A checkpoint directory seen as routed experts plus everything else.

`open_checkpoint(path)` reads config.json and the safetensors headers (never the weights), finds
every routed expert projection, decides its source format from the tensors present, checks the
geometry, and returns a `Checkpoint` whose `info` (a `CheckpointInfo`) says format, layers,
experts, geometry and bytes per tier. `Checkpoint.load(src)` then decodes one projection at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import formats
from .arch import PROJECTIONS, ExpertKey, Family, classify, config_int, family_for
from .errors import CheckpointError, FormatError
from .safetensors_io import ShardedSafetensors

# float storage dtype -> (source format name, decoder)
FLOAT_SOURCES = {
    "BF16": ("bf16", formats.from_bf16),
    "F16": ("fp16", formats.from_f16),
    "F32": ("fp32", formats.f32_to_f64),
}
SOURCE_FORMATS = (
    "bf16",
    "fp16",
    "fp32",
    "fp8-block",
    "fp8-pb-wo",
    "fp8-tensor",
    "fp8-channel",
    "nvfp4",
    "mxfp4",
    "int4-pack",
)
SUPPORTED_TEXT = (
    "bf16/fp16/fp32; FP8 e4m3 block (weight_scale_inv, or modelopt fp8_pb_wo "
    "weight_scale), FP8 per-tensor or per-channel (compressed-tensors float-quantized); "
    "modelopt NVFP4; MXFP4 (gpt-oss); compressed-tensors int4 pack-quantized"
)


@dataclass
class ProjectionSource:
    """One routed expert projection in the source checkpoint, logical shape [N, K]."""

    key: ExpertKey
    moe: str  # the MoE module's name, e.g. "model.layers.3.mlp"
    fmt: str  # one of SOURCE_FORMATS
    shape: tuple[int, int]
    tensors: tuple[str, ...]  # the source tensors it reads (fused tensors are shared)
    source_bytes: int  # this projection's share of source bytes
    _load: Callable[[], formats.Encoded | np.ndarray] = field(repr=False)
    _fp4x: Callable[[], dict] | None = field(default=None, repr=False)
    projection_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Family's

    @property
    def name(self) -> str:
        """The projection's name in a moet checkpoint (before the .w2_codes/... suffix), in the
        family's own naming (arch.Family.projection_names)."""
        proj = self.projection_names[PROJECTIONS.index(self.key.proj)]
        return f"{self.moe}.experts.{self.key.expert}.{proj}"

    def load(self):
        """-> formats.Encoded (integer-coded sources) or float64 ndarray (fp32 sources)."""
        return self._load()

    def dequant(self) -> np.ndarray:
        src = self._load()
        return src if isinstance(src, np.ndarray) else src.dequant()

    def fp4x(self) -> dict:
        """The checkpoint's own FP4 data for the fp4x tier: {"codes", "scales"[, "scale_2"]}."""
        if self._fp4x is None:
            raise FormatError(
                f"{self.name}: fp4x needs an NVFP4 or MXFP4 source, this one is "
                f"{self.fmt}; use fp4_tier fp4r"
            )
        return self._fp4x()


# tensor suffixes of one projection; a group with any of QUANTIZED_PARTS is quantized
DENSE_PARTS = (
    "weight",
    "weight_scale",
    "weight_scale_inv",
    "weight_scale_2",
    "input_scale",
    "weight_packed",
    "weight_shape",
    "weight_zero_point",
    "weight_g_idx",
)
QUANTIZED_PARTS = {"weight_scale", "weight_scale_inv", "weight_packed"}


@dataclass
class DenseProjection:
    """One quantized dense projection (attention, shared expert, dense MLP), shape [N, K]."""

    base: str  # e.g. "model.layers.0.self_attn.q_proj"
    fmt: str
    shape: tuple[int, int]
    tensors: tuple[str, ...]
    _load: Callable[[], formats.Encoded | np.ndarray] = field(repr=False)

    def dequant(self) -> np.ndarray:
        """The exact float64 weight [N, K]."""
        src = self._load()
        return src if isinstance(src, np.ndarray) else src.dequant()


@dataclass
class CheckpointInfo:
    path: str
    architecture: str
    family: str
    source_format: str  # the experts' format ("mixed" if they differ)
    dense_quantization: dict | None  # the checkpoint's own quantization_config, if any
    n_experts: int
    top_k: int | None
    hidden_size: int
    moe_intermediate_size: int
    moe_layers: list[int]  # model layer indices holding routed experts, MTP layers last
    mtp_layers: list[int]
    n_projections: int
    bytes: dict[str, int]  # source_experts, dense, w2, fp4r, fp4x (0 when not available)
    ckpt_id: str | None

    def to_dict(self) -> dict:
        return asdict(self)


# --- identity --------------------------------------------------------------------------------


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def checkpoint_identity(path: str | os.PathLike, revision: str | None = None) -> dict | None:
    """What identifies a checkpoint's bytes: path, revision, config and index digests, and each
    shard's name/size/mtime. None when something cannot be resolved (never trusted then)."""
    p = Path(path).resolve()
    cfg = _digest(p / "config.json")
    if cfg is None:
        return None
    shards = []
    for f in sorted(p.glob("*.safetensors")):
        try:
            st = f.stat()
        except OSError:
            return None
        shards.append([f.name, st.st_size, st.st_mtime_ns])
    if not shards:
        return None
    index = p / ShardedSafetensors.INDEX
    return {
        "path": str(p),
        "revision": revision,
        "config_sha256": cfg,
        "index_sha256": _digest(index) if index.exists() else None,
        "shards": shards,
    }


def ckpt_id(identity: dict | None) -> str | None:
    if identity is None:
        return None
    blob = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# --- the checkpoint -------------------------------------------------------------------------


def read_config(path: str | os.PathLike) -> dict:
    cfg_path = Path(path) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{cfg_path}: not found; pass a Hugging Face checkpoint directory"
        ) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: corrupt JSON ({e}); re-download it") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object")
    return cfg


def text_config(cfg: dict) -> dict:
    """Multimodal wrappers keep the language model's keys in text_config."""
    tc = cfg.get("text_config")
    return {**cfg, **tc} if isinstance(tc, dict) else cfg


class Checkpoint:
    def __init__(self, path: str | os.PathLike, revision: str | None = None):
        self.path = Path(path)
        self.config = read_config(self.path)
        self.tcfg = text_config(self.config)
        self.family: Family = family_for(self.tcfg, str(self.path / "config.json"))
        self.st = ShardedSafetensors(self.path)
        self.identity = checkpoint_identity(self.path, revision)
        qc = self.config.get("quantization_config")
        self.source_qconfig = qc if isinstance(qc, dict) else None
        if self.source_qconfig and self.source_qconfig.get("quant_method") == "moet":
            raise CheckpointError(
                f"{self.path}: already a moet checkpoint (quantization_config "
                "quant_method 'moet'); serve it directly, nothing to convert"
            )
        self.sources: list[ProjectionSource] = []
        self._scan()
        self.info = self._info()

    # -- scanning --

    def _scan(self) -> None:
        per_expert: dict[str, dict[str, str]] = defaultdict(dict)  # base -> suffix -> name
        keys: dict[str, ExpertKey] = {}
        moes: dict[str, str] = {}
        fused: dict[str, dict] = {}
        for name in self.st.names():
            key, suffix, m = classify(name)
            if key is not None:
                per_expert[m["base"]][suffix] = name
                keys[m["base"]], moes[m["base"]] = key, m["moe"]
            elif suffix is not None:
                g = fused.setdefault(
                    m["base"],
                    {"layer": m["layer"], "proj": m["fused"], "moe": m["moe"], "parts": {}},
                )
                g["parts"][suffix] = name
        for base, parts in per_expert.items():
            self.sources.append(self._per_expert_source(keys[base], moes[base], base, parts))
        for base, g in fused.items():
            self.sources.extend(self._fused_sources(base, g))
        if not self.sources:
            raise CheckpointError(
                f"{self.path}: no routed expert tensors found (looked for "
                "'...layers.<L>.mlp.experts.<e>.<gate|up|down>_proj...' and fused "
                "'...experts.gate_up_proj'); is this a MoE checkpoint?"
            )
        self.sources.sort(
            key=lambda s: (s.key.layer, s.key.expert, ("gate", "up", "down").index(s.key.proj))
        )

    def _per_expert_source(
        self, key: ExpertKey, moe: str, base: str, parts: dict[str, str]
    ) -> ProjectionSource:
        fmt, shape, load, fp4x = decode_projection(
            self.path, self.st, self.source_qconfig, base, parts, "expert tensor"
        )
        names = tuple(parts.values())
        nbytes = sum(self.st.info(n).nbytes for n in names)
        return ProjectionSource(
            key, moe, fmt, shape, names, nbytes, load, fp4x, self.family.projection_names
        )

    def _fused_sources(self, base: str, g: dict) -> list[ProjectionSource]:
        st, parts, layer = self.st, g["parts"], g["layer"]
        gptoss = self.family.fused_layout == "gptoss"
        out: list[ProjectionSource] = []
        if "_blocks" in parts:  # MXFP4
            if "_scales" not in parts:
                raise CheckpointError(f"{self.path}: {base}_blocks has no {base}_scales")
            bi = st.info(parts["_blocks"])
            if len(bi.shape) != 4 or bi.shape[-1] != 16:
                raise CheckpointError(
                    f"{self.path}: {bi.name} has shape {list(bi.shape)}, expected "
                    "[E, N, K/32, 16] (MXFP4 blocks)"
                )
            n_e, n_rows, kb = bi.shape[0], bi.shape[1], bi.shape[2]
            names = (parts["_blocks"], parts["_scales"])
            share = (bi.nbytes + st.info(parts["_scales"]).nbytes) // n_e

            def rows_of(e: int, proj: str) -> tuple[np.ndarray, np.ndarray]:
                blocks, scales = st.part(parts["_blocks"], e), st.part(parts["_scales"], e)
                if proj == "down":
                    return blocks, scales
                half = {"gate": 0, "up": 1}[proj]
                sel = (
                    slice(half, None, 2)
                    if gptoss
                    else slice(half * n_rows // 2, (half + 1) * n_rows // 2)
                )
                return blocks[sel], scales[sel]

            projs = ("down",) if g["proj"] == "down_proj" else ("gate", "up")
            for e in range(n_e):
                for proj in projs:
                    n = n_rows if proj == "down" else n_rows // 2

                    def load(e=e, proj=proj):
                        b, s = rows_of(e, proj)
                        return formats.from_mxfp4(b, s, f"{base}[{e}].{proj}")

                    def fp4x(e=e, proj=proj):
                        b, s = rows_of(e, proj)
                        codes, sc = formats.check_mxfp4(b, s, f"{base}[{e}].{proj}")
                        return {"codes": codes, "scales": sc}

                    out.append(
                        ProjectionSource(
                            ExpertKey(layer, e, proj),
                            g["moe"],
                            "mxfp4",
                            (n, kb * 32),
                            names,
                            share // len(projs),
                            load,
                            fp4x,
                            self.family.projection_names,
                        )
                    )
            return out
        if "" not in parts:
            found = ", ".join(parts.values())
            raise CheckpointError(
                f"{self.path}: fused expert tensors {found} have an unsupported "
                f"format; supported expert formats: {SUPPORTED_TEXT}"
            )
        t = st.info(parts[""])
        if t.dtype not in FLOAT_SOURCES or len(t.shape) != 3:
            raise CheckpointError(
                f"{self.path}: fused expert tensor {t.name} is {t.dtype}"
                f"{list(t.shape)}; expected a 3-D bf16/fp16/fp32 tensor (quantized "
                f"fused experts other than MXFP4 are not supported)"
            )
        fmt, loader = FLOAT_SOURCES[t.dtype]
        n_e = t.shape[0]
        projs = ("down",) if g["proj"] == "down_proj" else ("gate", "up")

        def view(e: int, proj: str) -> np.ndarray:
            x = st.part(t.name, e)
            if gptoss:  # K-major: [K, N] (down) or [K, 2N] interleaved (gate_up)
                x = x if proj == "down" else x[:, {"gate": 0, "up": 1}[proj] :: 2]
                return np.ascontiguousarray(x.T)
            if proj == "down":
                return x
            half = x.shape[0] // 2
            return x[:half] if proj == "gate" else x[half:]

        shapes = {p: tuple(view(0, p).shape) for p in projs}
        for e in range(n_e):
            for proj in projs:
                out.append(
                    ProjectionSource(
                        ExpertKey(layer, e, proj),
                        g["moe"],
                        fmt,
                        shapes[proj],
                        (t.name,),
                        t.nbytes // (n_e * len(projs)),
                        lambda e=e, proj=proj: loader(view(e, proj), f"{t.name}[{e}].{proj}"),
                        projection_names=self.family.projection_names,
                    )
                )
        return out

    # -- summary --

    def _info(self) -> CheckpointInfo:
        where = str(self.path / "config.json")
        n_experts = config_int(self.tcfg, self.family.experts_key, where)
        top_k = self.tcfg.get("num_experts_per_tok") or self.tcfg.get("experts_per_token")
        by_layer: dict[int, dict[tuple[int, str], ProjectionSource]] = defaultdict(dict)
        for s in self.sources:
            by_layer[s.key.layer][(s.key.expert, s.key.proj)] = s
        layers = sorted(by_layer)
        first = by_layer[layers[0]]
        gate = next((s for (e, p), s in first.items() if p == "gate"), None)
        if gate is None:
            raise CheckpointError(
                f"{self.path}: layer {layers[0]} has no gate projection for its experts"
            )
        inter, hidden = gate.shape
        expect = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        for layer in layers:
            for e in range(n_experts):
                for p in ("gate", "up", "down"):
                    s = by_layer[layer].get((e, p))
                    if s is None:
                        raise CheckpointError(
                            f"{self.path}: layer {layer} expert {e} has no {p} "
                            f"projection (config says {n_experts} experts); the "
                            "checkpoint is incomplete"
                        )
                    if s.shape != expect[p]:
                        raise CheckpointError(
                            f"{self.path}: {s.tensors[0]}: {p} projection of "
                            f"expert {e} is {list(s.shape)}, expected "
                            f"{list(expect[p])} like expert 0 of layer {layers[0]}"
                        )
            extra = [k for k in by_layer[layer] if k[0] >= n_experts]
            if extra:
                raise CheckpointError(
                    f"{self.path}: layer {layer} has expert {extra[0][0]} but "
                    f"config says {n_experts} experts"
                )
        n_hidden = int(self.tcfg.get("num_hidden_layers") or 0)
        mtp = [layer for layer in layers if n_hidden and layer >= n_hidden]
        fmts = sorted({s.fmt for s in self.sources})
        expert_names = {n for s in self.sources for n in s.tensors}
        dense = sum(self.st.info(n).nbytes for n in self.st.names() if n not in expert_names)
        numel = sum(s.shape[0] * s.shape[1] for s in self.sources)
        fp4x = 0
        if fmts in (["nvfp4"], ["mxfp4"]):
            fp4x = sum(s.source_bytes for s in self.sources)
        return CheckpointInfo(
            path=str(self.path),
            architecture=(self.tcfg.get("architectures") or ["?"])[0],
            family=self.family.name,
            source_format=fmts[0] if len(fmts) == 1 else "mixed",
            dense_quantization=self.source_qconfig,
            n_experts=n_experts,
            top_k=int(top_k) if top_k else None,
            hidden_size=hidden,
            moe_intermediate_size=inter,
            moe_layers=layers,
            mtp_layers=mtp,
            n_projections=len(self.sources),
            bytes={
                "source_experts": sum(s.source_bytes for s in self.sources),
                "dense": dense,
                "w2": numel // 4 + numel // 32,
                "fp4r": numel * 5 // 16,
                "fp4x": fp4x,
            },
            ckpt_id=ckpt_id(self.identity),
        )

    def close(self) -> None:
        self.st.close()


def decode_projection(
    path: Path, st: ShardedSafetensors, qc: dict | None, base: str, parts: dict[str, str], what: str
):
    """-> (format, (N, K), load, fp4x or None) of one projection from its tensors (suffix ->
    name), for routed experts and dense projections alike; `qc` is the checkpoint's
    quantization_config."""
    found = ", ".join(f"{s} {st.info(n).dtype}{list(st.info(n).shape)}" for s, n in parts.items())

    def unsupported() -> CheckpointError:
        return CheckpointError(
            f"{path}: {what} {base} has an unsupported format "
            f"({found}); supported formats: {SUPPORTED_TEXT}"
        )

    if "weight_packed" in parts:
        wp = st.info(parts["weight_packed"])
        if "weight_scale" not in parts or wp.dtype != "I32" or len(wp.shape) != 2:
            raise unsupported()
        if set(parts) - {"weight_packed", "weight_scale", "weight_shape"}:
            raise unsupported()  # e.g. asymmetric (weight_zero_point) or act-order
        group = _int4_group(path, qc, base)
        n, k = wp.shape[0], wp.shape[1] * 8
        if "weight_shape" in parts:
            shp = st.array(parts["weight_shape"]).reshape(-1)
            n, k = int(shp[0]), int(shp[1])

        def load_int4():
            sc = st.info(parts["weight_scale"])
            return formats.from_int4_packed(
                st.array(parts["weight_packed"]),
                formats.scale_to_f64(st.array(sc.name), sc.dtype),
                (n, k),
                group,
                base,
            )

        return "int4-pack", (n, k), load_int4, None
    if "weight" not in parts:
        raise unsupported()
    w = st.info(parts["weight"])
    if len(w.shape) != 2:
        raise CheckpointError(
            f"{path}: {what} {w.name} has shape {list(w.shape)}, expected a 2-D [N, K] weight"
        )
    n, k = w.shape
    extra = set(parts) - {"weight", "input_scale"}
    if w.dtype in FLOAT_SOURCES and not extra:
        fmt, loader = FLOAT_SOURCES[w.dtype]
        return fmt, (n, k), lambda: loader(st.array(w.name), base), None
    if w.dtype == "F8_E4M3" and extra == {"weight_scale_inv"}:
        block = tuple((qc or {}).get("weight_block_size") or (128, 128))
        return (
            "fp8-block",
            (n, k),
            lambda: formats.from_fp8_block(
                st.array(w.name), st.array(parts["weight_scale_inv"]), block, base
            ),
            None,
        )
    if w.dtype == "F8_E4M3" and extra == {"weight_scale"}:
        s = st.info(parts["weight_scale"])
        if len(s.shape) == 4:
            return (
                "fp8-pb-wo",
                (n, k),
                lambda: formats.from_fp8_block(
                    st.array(w.name), st.array(s.name), (128, 128), base
                ),
                None,
            )
        scales = int(np.prod(s.shape))
        if scales in (1, n):
            return (
                "fp8-tensor" if scales == 1 else "fp8-channel",
                (n, k),
                lambda: formats.from_fp8_tensor(
                    st.array(w.name), formats.scale_to_f64(st.array(s.name), s.dtype), base
                ),
                None,
            )
        raise unsupported()
    if (
        w.dtype == "U8"
        and extra == {"weight_scale", "weight_scale_2"}
        and st.info(parts["weight_scale"]).dtype == "F8_E4M3"
    ):

        def load_nvfp4():
            return formats.from_nvfp4(
                st.array(w.name),
                st.array(parts["weight_scale"]),
                st.array(parts["weight_scale_2"]),
                base,
            )

        def fp4x_nvfp4():
            load_nvfp4()  # validates
            return {
                "codes": np.array(st.array(w.name)),
                "scales": np.array(st.array(parts["weight_scale"])),
                "scale_2": np.array(st.array(parts["weight_scale_2"]), dtype=np.float32),
            }

        return "nvfp4", (n, 2 * k), load_nvfp4, fp4x_nvfp4
    raise unsupported()


def _int4_group(path: Path, qc: dict | None, base: str) -> int:
    qc = qc or {}
    for grp in (qc.get("config_groups") or {}).values():
        wq = (grp or {}).get("weights") or {}
        if wq.get("num_bits", 4) != 4 or wq.get("symmetric", True) is not True:
            raise CheckpointError(
                f"{path}: {base}: compressed-tensors weights with "
                f"num_bits={wq.get('num_bits')} symmetric={wq.get('symmetric')}; "
                "only 4-bit symmetric pack-quantized is supported"
            )
        return int(wq.get("group_size") or 32)
    return 32


def dense_projections(path: str | os.PathLike) -> dict[str, DenseProjection]:
    """Every quantized projection of a checkpoint that is not a routed expert (attention, shared
    experts, dense MLPs), by base name: what a server dequantizes where it cannot run the
    checkpoint's own method. Works on moet checkpoints too (their dense tensors are the source's,
    described by `source_quantization_config`)."""
    path = Path(path)
    qc = read_config(path).get("quantization_config") or {}
    if qc.get("quant_method") == "moet":
        qc = qc.get("source_quantization_config") or {}
    st = ShardedSafetensors(path)
    groups: dict[str, dict[str, str]] = defaultdict(dict)
    for name in st.names():
        if classify(name)[1] is not None:
            continue  # routed experts
        base, _, suffix = name.rpartition(".")
        if suffix in DENSE_PARTS:
            groups[base][suffix] = name
    out = {}
    for base, parts in sorted(groups.items()):
        if parts.keys() & QUANTIZED_PARTS:
            fmt, shape, load, _ = decode_projection(path, st, qc, base, parts, "dense tensor")
            out[base] = DenseProjection(base, fmt, shape, tuple(parts.values()), load)
    return out


def open_checkpoint(path: str | os.PathLike, revision: str | None = None) -> Checkpoint:
    return Checkpoint(path, revision)
