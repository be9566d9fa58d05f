"""Quantized variants of the tiny checkpoints: the official formats `--quantization moet` reads.

`write_quantized(src, dst, fmt)` re-encodes every linear projection of a `tiny_models` checkpoint
(routed experts, attention, shared experts; not the router, embeddings or lm_head) with moet-quant's
round-to-nearest test encoders (`moet_quant.synth`) and writes the `quantization_config` vLLM
reads for that format:

* ``fp8-block``  DeepSeek-V3 style: e4m3 weights + `weight_scale_inv` per 128x128 block,
  `quant_method: fp8`, `weight_block_size: [128, 128]`;
* ``fp8-channel``  compressed-tensors `float-quantized` (zai-org/GLM-4.5-Air-FP8's scheme): e4m3
  weights + an fp32 `weight_scale` per output row, activations quantized per token at run time;
* ``int4-pack``  compressed-tensors `pack-quantized` W4A16: int32 `weight_packed` (8 nibbles),
  bf16 `weight_scale` per group of 32, `weight_shape`.

`experts_only=True` leaves the dense projections in bf16 (the `ignore` list says so). An FP8
checkpoint lists its routers and lm_head in `modules_to_not_convert` by full name, as Qwen's FP8
checkpoints do: vLLM's FP8 method (exact names) would otherwise build FP8 parameters for them.
modelopt's own NVFP4 / FP8 exports come from moet-quant's `tests/modelopt_export.py` instead.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np

from moet_quant import synth
from moet_quant.safetensors_io import OutTensor, ShardedSafetensors, write_safetensors
from moet_quant.synth import projection_tensors

FORMATS = ("fp8-block", "fp8-channel", "int4-pack")
PROJECTION = re.compile(r"(_proj|\.w[123])\.weight$")  # Linear weights, Mixtral's w1/w2/w3 too
EXPERT = re.compile(r"\.experts\.\d+\.")


def quantization_config(fmt: str, experts_only: bool) -> dict:
    """moet-quant's config for `fmt`, plus which dense modules stay unquantized."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {FORMATS}")
    qc = synth.quantization_config(fmt)
    if fmt == "fp8-block" and experts_only:
        qc["modules_to_not_convert"] = ["self_attn", "shared_expert"]
    if fmt in ("fp8-channel", "int4-pack"):  # compressed-tensors
        qc["ignore"] = ["lm_head", "re:.*mlp.gate$"]
        if experts_only:
            qc["ignore"] += ["re:.*self_attn.*", "re:.*shared_expert.*"]
    return qc


def _float64(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return raw.astype(np.float64)


def write_quantized(src: str | Path, dst: str | Path, fmt: str, experts_only: bool = False) -> Path:
    """Write `src` with its projections in `fmt` to `dst` (replaced if present); -> dst."""
    src, dst = Path(src), Path(dst)
    qc = quantization_config(fmt, experts_only)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "tiny_model.json"))
    st = ShardedSafetensors(src)
    out: list[tuple[str, str, np.ndarray]] = []
    for name in st.names():
        info = st.info(name)
        raw = np.array(st.array(name))
        if PROJECTION.search(name) and (not experts_only or EXPERT.search(name)):
            base = name[: -len(".weight")]
            out += projection_tensors(base, _float64(raw, info.dtype), fmt)
        else:
            out.append((name, info.dtype, raw))
    if fmt == "fp8-block":
        routers = sorted(n[: -len(".weight")] for n in st.names() if n.endswith(".gate.weight"))
        qc["modules_to_not_convert"] = [*qc.get("modules_to_not_convert", []), "lm_head", *routers]
    st.close()
    write_safetensors(
        dst / "model.safetensors",
        [OutTensor(n, d, tuple(a.shape)) for n, d, a in out],
        iter(np.ascontiguousarray(a) for _, _, a in out),
        metadata={"format": "pt"},
    )
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return dst
