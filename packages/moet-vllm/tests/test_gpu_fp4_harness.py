"""Serving equals the harness on a GPU (marker `gpu`, run by ci/gpu.sh on the H200): in float32,
the greedy tokens moet-kernels serve at batch 1 in CUDA graphs, with a fresh 25% FP4 pool and the
gate at a margin of 1 nat, equal `gate_eval.simulate_generation`'s in kernel mode (the kernels'
arithmetic in torch, on the CPU), over prompts where exact mode's tokens differ
(test_vllm_fp4_tier.py holds the same comparison on the CPU, through the torch reference).

The engine computes its float32 matrix products in IEEE float32 throughout. vLLM keeps cuBLAS
there by default (`VLLM_FLOAT32_MATMUL_PRECISION=highest`), but its float32 attention backend on
the GPU (TRITON_ATTN) is Triton, whose `tl.dot` on float32 defaults to TF32 (10 mantissa bits):
that moved the hidden states by ~1e-3, which flips roundings of the kernels' int8 activations
(steps of 1/254 of a chunk's maximum), and the greedy tokens parted from the harness from the
first token of some prompts (GPU suite run 19, 2026-12-05). `TRITON_F32_DEFAULT=ieee` keeps
Triton's float32 dots exact, in a Triton cache of the test's own (its kernels compiled anew).
"""

from __future__ import annotations

import pytest
from serving import GPU_DRIVER_FLAGS, KERNEL_LINE
from test_vllm_fp4_tier import KERNEL_PROMPTS, KERNEL_TOKENS, harness_and_served

pytestmark = pytest.mark.gpu


def test_served_tokens_of_the_kernels_equal_the_harness_in_kernel_mode(tmp_path):
    # float32 (the driver's default): bfloat16's rounding would part vLLM from transformers
    ieee = {"TRITON_F32_DEFAULT": "ieee", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    sim, served = harness_and_served(
        tmp_path, "kernel", KERNEL_PROMPTS, KERNEL_TOKENS, env=ieee, extra=GPU_DRIVER_FLAGS
    )
    assert KERNEL_LINE in served["log"]
    assert 0 < sim["gated"] < sim["steps"]
    diverged = [(i, next((j for j, (a, b) in enumerate(zip(s, v)) if a != b), None))
                for i, (s, v) in enumerate(zip(sim["tokens"], served["tokens"]))]  # fmt: skip
    print(f"harness (kernel mode) gated {sim['gated']} of {sim['steps']} steps; served counters "
          f"{served['residency']}; first differing token per prompt {diverged}")  # fmt: skip
    assert served["tokens"] == sim["tokens"], diverged
