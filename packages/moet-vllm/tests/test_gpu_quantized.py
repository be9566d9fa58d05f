"""Official FP8 checkpoints served on the GPU (marker `gpu`, run by ci/gpu.sh on the H200): the
scheme of Qwen3-235B-A22B-FP8 and DeepSeek-V3 (e4m3 weights, a scale per 128 x 128 block, dynamic
activations; routers and lm_head in `modules_to_not_convert`) on the tiny Qwen3-MoE, its dense
projections made multiples of 128 wide (the block; vLLM refuses a merged QKV whose k/v parts are
not). Routed experts are re-quantized to W2 at load and run by moet-kernels; dense layers run
vLLM's own FP8 method (`dense=auto` picks it on CUDA), in CUDA graphs.

- captured and uncaptured steps compute the same (tokens and logprobs bit for bit), as for the
  bf16 architectures (test_gpu_architectures.py);
- the checkpoint converted by `moet convert` (dense tensors kept, experts as W2) serves the same
  tokens and logprobs as the FP8 checkpoint re-quantized at load;
- GLM-4.5-Air-FP8's scheme (compressed-tensors, e4m3 with a scale per output row, activations per
  token) serves too, its dense layers by vLLM's own W8A8 FP8 scheme: captured equals uncaptured;
- `dense=dequantize` (the dense layers decoded exactly to bf16) serves too; its agreement with the
  FP8 engine is printed, not asserted: vLLM's FP8 method quantizes activations to e4m3 per 128
  columns, which moves the random tiny model's near-tied logits."""

from __future__ import annotations

import pytest
from quantized_models import write_quantized
from serving import BITWISE_ENV, BITWISE_FLAGS, GPU_KV_FLAGS, KERNEL_LINE, run_vllm_side_by_side
from tiny_models import write_tiny_model

from moet_quant import convert

pytestmark = pytest.mark.gpu
# q 256, k and v 128 each, o_proj's K 256, experts 128 x 128: every dense shape a multiple of 128
FP8_DIMS = {
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "moe_intermediate_size": 128,
}
LINEAR_FLAGS = ["--linear-backend", "cutlass"]
LINEAR_LINE = "Selected CutlassFp8BlockScaledMMKernel for Fp8LinearMethod"
FP8_LINE = "moet: dense layers run the checkpoint's own method 'fp8'"
RELOADED = "re-quantized at load (fp8-block, 2 MoE layers x 16 experts)"
CHANNEL_LINES = (
    "re-quantized at load (fp8-channel, 2 MoE layers x 16 experts)",
    "moet: dense layers run the checkpoint's own method 'compressed-tensors'",
    "for CompressedTensorsW8A8Fp8",  # vLLM's kernel choice for the scheme
)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("fp8")
    bf16 = write_tiny_model("qwen3_moe", tmp / "qwen3", overrides=FP8_DIMS)
    fp8 = write_quantized(bf16, tmp / "fp8", "fp8-block")
    channel = write_quantized(bf16, tmp / "fp8-channel", "fp8-channel")
    moet = convert.convert(fp8, tmp / "fp8-moet", progress=False).out
    flags = ["--graphs", "1", "2", *BITWISE_FLAGS, *GPU_KV_FLAGS, "--max-num-seqs", "2",
             # vLLM 0.24's first choice on Hopper, FlashInfer's block-scale FP8 GEMM, is
             # JIT-compiled at first use: past this file's 300 s budget on a fresh machine beside
             # the other files (run 28); CUTLASS's ships compiled in vLLM
             *LINEAR_FLAGS]  # fmt: skip

    def engine(model, name: str, extra=(), quantization="moet", **env) -> dict:
        # each engine its own pack cache: they boot side by side
        env = {**BITWISE_ENV, "MOET_CACHE_DIR": str(tmp / f"{name}-packs"), **env}
        job = {"model": model, "dtype": "bfloat16", "env": env, "extra": [*flags, *extra]}
        return {**job, "quantization": quantization} if quantization else job

    return run_vllm_side_by_side(
        tmp,
        {
            "graphs": engine(fp8, "graphs"),
            "uncaptured": engine(fp8, "uncaptured", ["--no-cuda-graphs"]),
            "converted": engine(moet, "converted", quantization=None),
            "dequantized": engine(fp8, "dequantized", MOET_DENSE="dequantize"),
            "channel": engine(channel, "channel"),
            "channel-uncaptured": engine(channel, "channel-uncaptured", ["--no-cuda-graphs"]),
        },
    )


def test_fp8_dense_layers_run_vllms_method_and_a_captured_step_equals_the_uncaptured(engines):
    graphs, uncaptured = engines["graphs"], engines["uncaptured"]
    for r in (graphs, uncaptured):
        assert RELOADED in r["log"] and FP8_LINE in r["log"], r["log"][-3000:]
        assert LINEAR_LINE in r["log"], r["log"][-3000:]
    assert KERNEL_LINE in graphs["log"]
    assert graphs["tokens"] == uncaptured["tokens"]
    assert graphs["logprobs"] == uncaptured["logprobs"]


def test_the_converted_fp8_checkpoint_serves_what_the_source_serves(engines):
    converted, graphs = engines["converted"], engines["graphs"]
    assert "from a moet checkpoint" in converted["log"] and FP8_LINE in converted["log"]
    assert KERNEL_LINE in converted["log"]
    assert converted["tokens"] == graphs["tokens"]
    assert converted["logprobs"] == graphs["logprobs"]


def test_fp8_per_channel_checkpoint_runs_vllms_scheme_and_a_captured_step_equals_the_uncaptured(
    engines,
):
    graphs, uncaptured = engines["channel"], engines["channel-uncaptured"]
    for r in (graphs, uncaptured):
        for line in CHANNEL_LINES:
            assert line in r["log"], r["log"][-3000:]
    assert KERNEL_LINE in graphs["log"]
    assert graphs["tokens"] == uncaptured["tokens"]
    assert graphs["logprobs"] == uncaptured["logprobs"]


def test_fp8_dense_layers_dequantized_on_request(engines):
    r, fp8 = engines["dequantized"], engines["graphs"]
    assert "dequantized exactly to bfloat16 at load" in r["log"], r["log"][-3000:]
    assert FP8_LINE not in r["log"] and KERNEL_LINE in r["log"]
    same = sum(a == b for x, y in zip(r["tokens"], fp8["tokens"]) for a, b in zip(x, y))
    total = sum(len(x) for x in fp8["tokens"])
    print(f"dense FP8 (activations e4m3) against dequantized bf16: {same} of {total} tokens equal")
