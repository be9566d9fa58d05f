"""The tiny architectures of the CPU suite on a GPU (marker `gpu`, run by ci/gpu.sh on the
H200): Qwen3-MoE, Mixtral, DeepSeek-V3 (MLA: kv_lora_rank 512 + rope 64, the 576 of vLLM's MLA
backends) and GLM-4.5 with its MTP layer (one speculative token), each converted by `moet convert`
and served in bfloat16 with moet-kernels, once with vLLM's compilation and CUDA graphs and once
eager: the graphs give the eager tokens (a captured step replays the kernels eager runs), the
kernels' boot line is in both, and MTP drafts are accepted."""

from __future__ import annotations

import pytest
from serving import GPU_DRIVER_FLAGS, GPU_KV_FLAGS, KERNEL_LINE, run_vllm_side_by_side
from tiny_models import ARCHS, write_tiny_model

from moet_quant import convert

pytestmark = pytest.mark.gpu
EAGER_LINE = "moet: compute: moet-kernels (sm_90a cubins) on cuda:0, eager (no CUDA graphs)"


@pytest.mark.parametrize("arch", ARCHS)
def test_serves_through_the_kernels_in_cuda_graphs_as_it_does_eagerly(arch, tmp_path):
    moet = convert.convert(
        write_tiny_model(arch, tmp_path / arch), tmp_path / f"{arch}-moet", progress=False
    ).out
    mtp = 1 if arch == "glm4_moe" else 0
    seqs = ["--max-num-seqs", "2"]
    both = {"model": moet, "dtype": "bfloat16", "mtp": mtp}
    runs = run_vllm_side_by_side(tmp_path, {
        "graphs": {**both, "extra": [*GPU_DRIVER_FLAGS, *seqs]},
        "eager": {**both, "extra": [*GPU_KV_FLAGS, *seqs]},
    })  # fmt: skip
    graphs, eager = runs["graphs"], runs["eager"]
    assert KERNEL_LINE in graphs["log"] and EAGER_LINE in eager["log"]
    assert graphs["tokens"] == eager["tokens"]
    if mtp:
        accepted = graphs["spec_decode"].get("vllm:spec_decode_num_accepted_tokens", 0)
        assert accepted > 0, graphs["spec_decode"]
