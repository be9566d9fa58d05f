"""The tiny architectures of the CPU suite on a GPU (marker `gpu`, run by ci/gpu.sh on the
H200): Qwen3-MoE, Mixtral, DeepSeek-V3 (MLA: kv_lora_rank 512 + rope 64, the 576 of vLLM's MLA
backends) and GLM-4.5 with its MTP layer (one speculative token), each converted by `moet convert`
and served in bfloat16 with moet-kernels under vLLM's compilation, once with CUDA graphs and once
without (cudagraph_mode NONE: the same compiled code, launched eagerly): a captured step replays
what the uncaptured one computes, so tokens and logprobs are equal bit for bit, and the MTP layer
drafts. Graphs are captured at batch sizes 1 and 2 only, the sizes the decode batches have, so no
step is padded (a padded step computes its GEMMs at another shape, which moves bf16 results).
Eager mode (no torch.compile) is not compared: compiled and uncompiled bf16 differ in fusion, and
the random tiny models' near-tied logits turn that into other tokens.

Beside them, on the same models: GLM with its MTP layer tiered at the boot floor (the drafter's
experts pinned in the pool, the others fetched and replayed), bit for bit the captured resident
engine's; and tiering under vLLM's V2 model runner, refused at boot."""

from __future__ import annotations

import pytest
from serving import BITWISE_ENV, BITWISE_FLAGS, GPU_KV_FLAGS, KERNEL_LINE, run_vllm_side_by_side
from tiny_models import ARCHS, write_tiny_model

from moet_quant import convert
from moet_vllm.residency.sizing import boot_floor

pytestmark = pytest.mark.gpu
UNCAPTURED_LINE = "moet: compute: moet-kernels (sm_90a cubins) on cuda:0, eager (no CUDA graphs)"
# the tiny GLM: 2 tiered MoE layers x 16 experts, top-4, steps of 1 token + 1 draft, 1 sequence
GLM_FLOOR = boot_floor(2, 4, 2, 1)  # 19 of 32


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict:
    """{"<arch>-graphs" | "<arch>-uncaptured": run}: every engine of every architecture, side by
    side."""
    tmp = tmp_path_factory.mktemp("archs")
    jobs = {}
    for arch in ARCHS:
        moet = convert.convert(
            write_tiny_model(arch, tmp / arch), tmp / f"{arch}-moet", progress=False
        ).out
        mtp = 1 if arch == "glm4_moe" else 0
        # decode batches of 2 tokens: 2 sequences, or 1 and its draft (captured as one FULL graph)
        seqs = "1" if mtp else "2"
        flags = ["--graphs", "1", "2", *BITWISE_FLAGS, *GPU_KV_FLAGS, "--max-num-seqs", seqs]
        both = {"model": moet, "dtype": "bfloat16", "mtp": mtp, "env": BITWISE_ENV}
        jobs[f"{arch}-graphs"] = {**both, "extra": flags}
        jobs[f"{arch}-uncaptured"] = {**both, "extra": [*flags, "--no-cuda-graphs"]}
        tiered = {"MOET_GPU_POOL": str(GLM_FLOOR), "MOET_CACHE_DIR": str(tmp / f"{arch}-packs"),
                  "MOET_READ_IN_PLACE": "0"}  # fmt: skip  # misses fetched and replayed
        if arch == "glm4_moe":
            jobs["glm4_moe-tiered"] = {**both, "env": {**BITWISE_ENV, **tiered}, "extra": flags}
        if arch == "qwen3_moe":
            v2 = {**tiered, "MOET_GPU_POOL": "50%", "VLLM_USE_V2_MODEL_RUNNER": "1"}
            jobs["v2-runner"] = {**both, "env": v2, "extra": flags, "check": False}
    return run_vllm_side_by_side(tmp, jobs)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_captured_step_computes_what_the_uncaptured_one_does(arch, engines):
    graphs, uncaptured = engines[f"{arch}-graphs"], engines[f"{arch}-uncaptured"]
    assert KERNEL_LINE in graphs["log"] and UNCAPTURED_LINE in uncaptured["log"]
    assert graphs["tokens"] == uncaptured["tokens"]
    assert graphs["logprobs"] == uncaptured["logprobs"]
    if arch == "glm4_moe":  # random weights: acceptance near zero (test_vllm_serving.py)
        assert graphs["spec_decode"].get("vllm:spec_decode_num_drafts", 0) > 0, graphs[
            "spec_decode"
        ]
        print("MTP:", graphs["spec_decode"])


def test_mtp_with_tiering_pins_the_drafters_experts_and_replays_bit_for_bit(engines):
    """GLM at the boot floor: the MTP layer's 16 experts pinned, the 2 other MoE layers' fetched
    on a miss; every token and logprob equals the captured resident engine's, and the pool did
    miss (replays and fetched experts counted) while the drafter drafted."""
    tiered, resident = engines["glm4_moe-tiered"], engines["glm4_moe-graphs"]
    boot = f"tiered residency: {GLM_FLOOR} expert slots for 2 MoE layers x 16 experts"
    assert boot in tiered["log"] and "16 pinned (MTP)" in tiered["log"], tiered["log"][-3000:]
    assert KERNEL_LINE in tiered["log"]
    assert tiered["tokens"] == resident["tokens"]
    assert tiered["logprobs"] == resident["logprobs"]
    counters = tiered["residency"]
    assert counters["replayed_steps"] > 0 and counters["fetched_rows"] > 0, counters
    assert tiered["spec_decode"].get("vllm:spec_decode_num_drafts", 0) > 0, tiered["spec_decode"]
    print(f"MTP, pool {GLM_FLOOR}: {counters}")


def test_tiering_refuses_the_v2_model_runner(engines):
    """VLLM_USE_V2_MODEL_RUNNER=1 with a pool: the boot stops with moet's reason and the way out
    (the V2 runner has no single forward to replay)."""
    r = engines["v2-runner"]
    assert r["returncode"] != 0, r["log"][-3000:]
    assert "cannot run with vLLM's V2 model runner" in r["log"], r["log"][-3000:]
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in r["log"]
