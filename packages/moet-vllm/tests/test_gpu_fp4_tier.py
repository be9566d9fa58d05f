"""The FP4 tier served by vLLM 0.24 on a GPU (marker `gpu`, run by ci/gpu.sh on the H200): the
trained fixture, re-quantized at load (`--quantization moet`, `fp4_tier=fp4r`), in bfloat16.

* Every expert at FP4 (a pool of every pair, gate off) through moet-kernels' fp4r GEMMs in CUDA
  graphs against their oracle (`compute="oracle"`, eager), teacher-forced over test-split text,
  with test_gpu_oracle's bound: a flip to a token the oracle rates more than DELTA below its best
  fails, as does an agreement below 97%.
* The gate inside CUDA graphs: a pool of 25% and the gate at a margin of 1 nat, greedy: the gate
  replays steps (a replay of the captured graph) and the pool fills and swaps, and a twin engine
  gives the same tokens and logprobs bit for bit (the gated path is deterministic).

Serving against the harness in kernel mode is test_gpu_fp4_harness.py (its own process: the three
engines here fill the file's time budget).
"""

from __future__ import annotations

import pytest
from serving import (
    BITWISE_ENV,
    BITWISE_FLAGS,
    FIXTURE,
    GPU_DRIVER_FLAGS,
    GPU_KV_FLAGS,
    KERNEL_LINE,
    fixture_prompts,
    run_vllm_side_by_side,
    split_prompt,
)
from test_gpu_oracle import DELTA, MIN_AGREEMENT, TOP, against_oracle

pytestmark = pytest.mark.gpu


def test_all_fp4_kernels_agree_with_their_oracle_teacher_forced(tmp_path):
    _, prompt = split_prompt()
    forced = ["--max-model-len", "1024", "--prompt-logprobs", str(TOP), "--max-num-seqs", "1"]
    fp4 = {"MOET_FP4_TIER": "fp4r", "MOET_FP4_POOL": "100%", "MOET_GATE": "0"}
    same = {"model": FIXTURE, "quantization": "moet", "dtype": "bfloat16", "prompts": [prompt]}
    runs = run_vllm_side_by_side(tmp_path, {
        "kernel": {**same, "extra": [*forced, *GPU_DRIVER_FLAGS],
                   "env": {**fp4, "MOET_CACHE_DIR": str(tmp_path / "k")}},
        "oracle": {**same, "extra": [*forced, *GPU_KV_FLAGS],
                   "env": {**fp4, "MOET_COMPUTE": "oracle", "MOET_CACHE_DIR": str(tmp_path / "o")}},
    })  # fmt: skip
    assert KERNEL_LINE in runs["kernel"]["log"]
    assert "FP4 tier fp4r (fp4_pool='100%')" in runs["kernel"]["log"]
    kernel, oracle = (runs[k]["prompt_logprobs"][0] for k in ("kernel", "oracle"))
    agreement, flips, moves = against_oracle(kernel, oracle)
    print(f"all-FP4 kernel/oracle agreement {agreement:.4f}, {len(flips)} flips, logprob moves "
          f"median {moves[len(moves) // 2]:.4g}, max {moves[-1]:.4g} nats")  # fmt: skip
    assert all(gap < DELTA for _, gap in flips), flips
    assert agreement >= MIN_AGREEMENT, (agreement, flips)


def test_the_gate_replays_captured_steps_deterministically(tmp_path):
    env = {**BITWISE_ENV, "MOET_FP4_TIER": "fp4r", "MOET_FP4_POOL": "25%", "MOET_GATE_TAU": "1.0",
           "MOET_KPI_EVERY": "1"}  # fmt: skip
    drive = {"model": FIXTURE, "quantization": "moet", "dtype": "bfloat16",
             "prompts": fixture_prompts(4),
             "extra": [*GPU_DRIVER_FLAGS, *BITWISE_FLAGS, "--max-num-seqs", "1"]}  # fmt: skip
    runs = run_vllm_side_by_side(tmp_path, {
        name: {**drive, "env": {**env, "MOET_CACHE_DIR": str(tmp_path / name)}}
        for name in ("gated", "twin")
    })  # fmt: skip
    gated, twin = runs["gated"], runs["twin"]
    assert KERNEL_LINE in gated["log"]
    assert twin["tokens"] == gated["tokens"] and twin["logprobs"] == gated["logprobs"]
    counters = gated["residency"]
    assert counters["fp4_gated_steps"] > 0, counters
    assert counters["fp4_promotions"] > 48 and counters["fp4_evictions"] > 0, counters
    assert counters["fp4_hit_pairs"] > 0, counters
    print(f"gated engine: {counters}")
