"""nvidia-modelopt as an independent producer of NVFP4 and FP8-blockwise MoE checkpoints.

Builds a tiny seeded `Qwen3MoeForCausalLM` with transformers, calibrates it on seeded random
tokens, quantizes it with modelopt (`NVFP4_EXPERTS_ONLY_CFG`, or `FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG`
for FP8 e4m3 with one fp32 scale per 128x128 block, which modelopt exports as `fp8_pb_wo`) and
writes it with `modelopt.torch.export.export_hf_checkpoint`.

modelopt's own dequantization of the exported bytes
---------------------------------------------------
`modelopt_dequant()` decodes the *exported* tensors with modelopt's `QTensor.dequantize`:
`NVFP4QTensor(shape, dtype, packed).dequantize(scale=weight_scale, double_scale=weight_scale_2,
block_sizes={-1: 16})` and `FP8QTensor(shape, dtype, fp8).dequantize(scale=weight_scale,
block_sizes={-1: 128, -2: 128})` (modelopt.torch.quantization.qtensor). These are the inverse
that modelopt pairs with the `NVFP4QTensor.quantize` / `FP8QTensor.quantize` calls its exporter
(`export.quant_utils.to_quantized_weight`) uses to produce those very bytes, and the function
modelopt itself calls to turn packed weights back into floats (`QTensorWrapper`, `mtq.compress`
models). It owns every convention a reader can get wrong: nibble order, the e2m1 table, the e4m3
scale decode, the block-to-element mapping (with padding of partial 128 blocks) and how the two
NVFP4 scales combine. A fake-quant output of the weight quantizer would instead be modelopt's
*simulation* before export (scales recomputed from amax), not a decode of the exported file.

`dequantize` evaluates in the dtype it is given. modelopt's native dtype here is float32, where
NVFP4 rounds twice (`fl32(e2m1 * fl32(weight_scale * weight_scale_2))`); with float64 inputs every
product is exact (e2m1: 2 significant bits, e4m3: 4, fp32 scale: 24), so the float64 evaluation is
the exact value of the exported weight. Both evaluations are returned.

Run as a script to write both exports: `python modelopt_export.py OUT_DIR`.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HIDDEN = 128
MOE_INTER = 64
N_EXPERTS = 8
TOP_K = 2
N_LAYERS = 2
VOCAB = 256
SEED = 0
# FP8 blocks are 128x128. With hidden 128 / intermediate 64 every projection would be one partial
# block, so the FP8 model uses hidden 192 / intermediate 128: gate/up [128, 192] -> 1 x 2 blocks and
# down [192, 128] -> 2 x 1 blocks, the second one partial. (The intermediate must stay a multiple
# of 128: modelopt 0.47 splits the fused gate_up_proj's per-block amax at row I, which fails with
# "Mismatch in expected scale shape" when a 128-row block straddles gate and up.)
FP8_HIDDEN = 192
FP8_MOE_INTER = 128

FORMATS = {"nvfp4": "NVFP4_EXPERTS_ONLY_CFG", "fp8-pb-wo": "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"}


def _quiet():
    warnings.filterwarnings("ignore", message=".*is not tested with current version of modelopt.*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"modelopt\..*")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_model(hidden: int = HIDDEN, moe_inter: int = MOE_INTER, seed: int = SEED):
    """A tiny seeded Qwen3-MoE in bfloat16 (every layer MoE, eager experts)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=moe_inter,
        moe_intermediate_size=moe_inter,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=N_EXPERTS,
        num_experts_per_tok=TOP_K,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=256,
        tie_word_embeddings=False,
        norm_topk_prob=True,
        architectures=["Qwen3MoeForCausalLM"],  # modelopt's export reads it
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


def calib_batches(seed: int = SEED, n: int = 4, batch: int = 4, seq: int = 32):
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def quantize_and_export(
    fmt: str, export_dir: str | Path, seed: int = SEED, reference: bool = False
) -> Path:
    """Build, calibrate, quantize (modelopt) and export (export_hf_checkpoint); -> export_dir.

    With `reference`, also writes `modelopt_reference.npz` there (see `write_reference`).
    """
    _quiet()
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint

    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {sorted(FORMATS)}")
    export_dir = Path(export_dir)
    dims = (FP8_HIDDEN, FP8_MOE_INTER) if fmt == "fp8-pb-wo" else (HIDDEN, MOE_INTER)
    model = build_model(*dims, seed=seed)
    batches = calib_batches(seed)

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches:
                m(input_ids=ids)

    mtq.quantize(model, getattr(mtq, FORMATS[fmt]), forward_loop)
    with torch.no_grad():
        export_hf_checkpoint(model, export_dir=export_dir)
    if reference:
        write_reference(export_dir)
    return export_dir


def modelopt_dequant(fmt: str, tensors: dict, dtype) -> np.ndarray:
    """modelopt's QTensor.dequantize of one exported projection's tensors, evaluated in `dtype`
    (torch.float32: modelopt's arithmetic; torch.float64: exact). `tensors` holds torch tensors
    keyed by suffix (weight, weight_scale[, weight_scale_2])."""
    import torch
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor

    w = tensors["weight"]
    if fmt == "nvfp4":
        shape = torch.Size((w.shape[0], w.shape[1] * 2))
        q = NVFP4QTensor(shape, dtype, w)
        s1, s2 = tensors["weight_scale"], tensors["weight_scale_2"]
        if dtype != torch.float32:
            # dequantize multiplies weight_scale.to(float32) by weight_scale_2, a 0-dim tensor
            # that does not promote a dimensioned float32 tensor: upcast both (exactly, from e4m3
            # and fp32) so the scale product is evaluated in `dtype` too.
            s1, s2 = s1.to(dtype), s2.to(dtype)
        out = q.dequantize(dtype, scale=s1, double_scale=s2, block_sizes={-1: 16})
    elif fmt == "fp8-pb-wo":
        s = tensors["weight_scale"]
        q = FP8QTensor(w.shape, dtype, w)
        # The exporter keeps the scale as [N/128, 1, K/128, 1] (`to_quantized_weight` squeezes it
        # before FP8QTensor.quantize): dequantize takes the same squeezed [N/128, K/128].
        out = q.dequantize(
            dtype, scale=s.reshape(s.shape[0], s.shape[2]).to(dtype), block_sizes={-1: 128, -2: 128}
        )
    else:
        raise ValueError(fmt)
    assert out.dtype == dtype, (out.dtype, dtype)
    return out.numpy()


def expert_tensors(export_dir: Path) -> dict[str, dict]:
    """Exported expert tensors: {base: {suffix: torch tensor}} (base = '...experts.E.gate_proj')."""
    from safetensors.torch import load_file

    out: dict[str, dict] = {}
    for f in sorted(Path(export_dir).glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if ".experts." not in name:
                continue
            base, suffix = name.rsplit(".", 1)
            out.setdefault(base, {})[suffix] = t
    return out


def detect_format(export_dir: Path) -> str:
    qc = json.loads((Path(export_dir) / "hf_quant_config.json").read_text())["quantization"]
    algo = str(qc["quant_algo"]).upper()
    return {"NVFP4": "nvfp4", "FP8_PB_WO": "fp8-pb-wo"}[algo]


def write_reference(export_dir: Path) -> Path:
    """`modelopt_reference.npz`: modelopt's own dequantization of every exported expert
    projection (`modelopt_dequant`), keys `<tensor base>@f32` and `<tensor base>@f64`."""
    import torch

    fmt = detect_format(export_dir)
    ref = {}
    for base, t in expert_tensors(export_dir).items():
        ref[f"{base}@f32"] = modelopt_dequant(fmt, t, torch.float32)
        ref[f"{base}@f64"] = modelopt_dequant(fmt, t, torch.float64)
    path = Path(export_dir) / "modelopt_reference.npz"
    np.savez(path, **ref)
    return path


def main(argv: list[str]) -> int:
    out = Path(argv[1] if len(argv) > 1 else "modelopt_exports")
    for fmt in FORMATS:
        t0 = time.perf_counter()
        d = quantize_and_export(fmt, out / fmt, reference=True)
        print(f"{fmt}: {d} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
