"""The FP4 tier end to end on vLLM CPU (float32) with the trained fixture (serving.FIXTURE: 3 MoE
layers x 64 experts, top-4): a pool of every pair serves transformers' greedy tokens with every
routed expert at fp4r, whether the rows are re-quantized from the official checkpoint or rebuilt
from a moet checkpoint's refinement planes; a pool of 25% fills and swaps by heat (KPI lines and
`/metrics`-bound counters), and the FP4 rows it holds change what is served."""

from __future__ import annotations

import re

import pytest
from serving import FIXTURE, convert_fixture, fixture_prompts, hf_reference_tokens, run_vllm

pytest.importorskip("vllm")

ONE_SEQ = ["--max-num-seqs", "1"]


def fp4_env(cache, pool: str, **more) -> dict:
    return {"MOET_FP4_TIER": "fp4r", "MOET_FP4_POOL": pool, "MOET_CACHE_DIR": str(cache), **more}


def test_a_pool_of_every_pair_serves_fp4r_experts_from_either_checkpoint(tmp_path):
    prompts = fixture_prompts(2)
    want = hf_reference_tokens(FIXTURE, FIXTURE, prompts=prompts, tier="fp4r")
    assert want != hf_reference_tokens(FIXTURE, FIXTURE, prompts=prompts)  # FP4 is not W2 here
    official = run_vllm(FIXTURE, tmp_path, "official", quantization="moet", extra=ONE_SEQ,
                        prompts=prompts, env=fp4_env(tmp_path / "packs-a", "100%"))  # fmt: skip
    assert official["tokens"] == want
    assert "FP4 tier fp4r (fp4_pool='100%')" in official["log"]
    moet = convert_fixture(tmp_path / "fixture-fp4r", fp4_tier="fp4r")
    served = run_vllm(moet, tmp_path, "moet-ckpt", extra=ONE_SEQ, prompts=prompts,
                      env=fp4_env(tmp_path / "packs-b", "100%"))  # fmt: skip
    assert served["tokens"] == want  # the refinement planes rebuild the same nibbles


def test_a_quarter_pool_fills_and_swaps_by_heat(tmp_path):
    prompts = fixture_prompts(4)
    env = fp4_env(tmp_path / "packs", "48", MOET_KPI_EVERY="4", MOET_GATE="0")
    tiered = run_vllm(FIXTURE, tmp_path, "fp4-48", quantization="moet", extra=ONE_SEQ,
                      prompts=prompts, env=env)  # fmt: skip
    w2 = run_vllm(FIXTURE, tmp_path, "w2", quantization="moet", extra=ONE_SEQ, prompts=prompts,
                  env={"MOET_CACHE_DIR": str(tmp_path / "packs")})  # fmt: skip
    assert tiered["logprobs"] != w2["logprobs"]  # FP4 rows served
    lines = re.findall(
        r"FP4 pool coverage ([\d.]+)% \(routed experts at FP4 ([\d.]+)%\), gate replay 0.0% of "
        r"decode steps, FP4 promotions ([\d.]+) / evictions ([\d.]+) per step",
        tiered["log"],
    )
    assert lines, tiered["log"][-3000:]
    assert {cov for cov, *_ in lines} == {"25.0"}  # 48 of 192 pairs
    assert max(float(hit) for _, hit, _, _ in lines) > 0
    assert sum(float(p) for _, _, p, _ in lines) > 0 and sum(float(e) for *_, e in lines) > 0


def test_fp4x_needs_a_checkpoint_with_its_own_fp4_data(tmp_path):
    r = run_vllm(FIXTURE, tmp_path, "fp4x", quantization="moet", check=False,
                 env={"MOET_FP4_TIER": "fp4x", "MOET_CACHE_DIR": str(tmp_path / "p")})  # fmt: skip
    assert r["returncode"] != 0
    assert "fp4_tier='fp4x' serves the checkpoint's own NVFP4 or MXFP4 expert data" in r["log"]
    assert "(experts: bf16); use fp4_tier='fp4r'" in r["log"]


# The gated engine of the serving == harness comparisons: a fresh pool of 25%, the gate at a
# margin of 1 nat (MOET_GATE_TAU), batch 1.
GATED = {"pool": "25%", "share": 0.25, "tau": 1.0, "metric": "margin"}
# Kernel mode's comparison decodes longer: over 6 prompts x 48 tokens exact and kernel
# arithmetic part (the int8 activations move the fixture's greedy tokens), over the short
# comparison they do not.
KERNEL_PROMPTS, KERNEL_TOKENS = 6, 48


def harness_and_served(tmp_path, mode: str, n_prompts: int, max_tokens: int, env=(), extra=()):
    """`gate_eval.simulate_generation` in `mode` and vLLM serving the fixture with the GATED tier
    and gate (fresh packs) on the same prompts -> (simulation, served run)."""
    from moet_vllm.gate_eval import GateConfig, simulate_generation

    prompts = fixture_prompts(n_prompts)
    cfg = GateConfig(GATED["share"], GATED["tau"], GATED["metric"])
    sim = simulate_generation(FIXTURE, prompts, max_tokens, cfg, mode=mode)
    env = fp4_env(tmp_path / "packs", GATED["pool"], MOET_GATE_TAU=str(GATED["tau"]),
                  MOET_KPI_EVERY="1", **dict(env))  # fmt: skip
    served = run_vllm(FIXTURE, tmp_path, f"gated-{mode}", quantization="moet", prompts=prompts,
                      extra=[*ONE_SEQ, "--max-tokens", str(max_tokens), *extra], env=env)  # fmt: skip
    return sim, served


def test_served_tokens_equal_the_harness_simulation_of_the_same_decisions(tmp_path):
    """Batch 1, a fresh pool of 25%, the gate at margin 1 nat: the greedy tokens vLLM serves
    (the torch reference) equal `gate_eval.simulate_generation`'s (transformers, the same
    Fp4Tier decisions), and both gated some steps. The LM head runs once a step, twice a gated
    one: the gate's logits of an ungated step are the ones vLLM samples from (GateLogits)."""
    from vllm_driver import MAX_TOKENS

    sim, served = harness_and_served(tmp_path, "exact", 3, MAX_TOKENS, extra=["--count-head"])
    assert served["tokens"] == sim["tokens"]
    assert 0 < sim["gated"] < sim["steps"]
    gated = re.findall(r"gate replay ([\d.]+)% of decode steps", served["log"])
    assert gated and max(float(g) for g in gated) > 0
    head = served["head"]
    assert 0 < head["gated_steps"] < head["steps"]
    assert head["calls"] == head["steps"] + head["gated_steps"], head


def test_served_tokens_in_the_kernels_arithmetic_equal_the_harness_in_kernel_mode(tmp_path):
    """The same with `compute="oracle"` (the kernels' arithmetic in torch: what a GPU serves)
    against the harness in kernel mode, over prompts where kernel mode's tokens are not exact
    mode's: the harness simulates the arithmetic serving runs, not only its decisions
    (test_gpu_fp4_tier.py compares the kernels themselves)."""
    from moet_vllm.gate_eval import GateConfig, simulate_generation

    sim, served = harness_and_served(tmp_path, "kernel", KERNEL_PROMPTS, KERNEL_TOKENS,
                                     env={"MOET_COMPUTE": "oracle"})  # fmt: skip
    assert "moet-kernels' torch reference in kernel mode" in served["log"]
    assert served["tokens"] == sim["tokens"]
    assert 0 < sim["gated"] < sim["steps"]
    cfg = GateConfig(GATED["share"], GATED["tau"], GATED["metric"])
    exact = simulate_generation(FIXTURE, fixture_prompts(KERNEL_PROMPTS), KERNEL_TOKENS, cfg)
    assert exact["tokens"] != sim["tokens"]


def test_replays_of_mtp_verification_steps_are_kv_safe_and_the_gate_skips_steps_all_at_fp4(
    tmp_path,
):
    """GLM-4.5 with its MTP layer drafting (a tiny random model, re-quantized at load;
    verification steps of 1 + 1 tokens a request; the drafter's experts are pinned W2, not the
    tiers'). A W2 pool of half the pairs (below the boot floor, with consent) replays the
    verification steps that missed and serves the all-resident engine's tokens: a replay
    rewrites the step's KV slots (a gate replay is the same pass again,
    manager._until_resident). With every pair at FP4, a gate at tau 1e9 replays no step (no
    routed expert ran at W2: a replay would compute the same) and serves transformers' tokens
    at fp4r; with a quarter of the pairs at FP4 it replays verification steps."""
    from tiny_models import write_tiny_model

    model = write_tiny_model("glm4_moe", tmp_path / "glm")
    engines = {
        "resident": {},
        "w2-half": {"MOET_GPU_POOL": "50%", "MOET_BELOW_FLOOR_OK": "1"},  # (floor: 74 of 32)
        "fp4-all": {"MOET_FP4_TIER": "fp4r", "MOET_FP4_POOL": "100%", "MOET_GATE_TAU": "1e9"},
        "fp4-quarter": {"MOET_FP4_TIER": "fp4r", "MOET_FP4_POOL": "25%", "MOET_GATE_TAU": "1e9"},
    }
    runs = {
        name: run_vllm(model, tmp_path, name, quantization="moet", mtp=1,
                       env={**env, "MOET_KPI_EVERY": "1", "MOET_CACHE_DIR": str(tmp_path / name)})
        for name, env in engines.items()
    }  # fmt: skip
    for name, r in runs.items():
        assert r["spec_decode"].get("vllm:spec_decode_num_drafts", 0) > 0, name
    assert runs["w2-half"]["tokens"] == runs["resident"]["tokens"]
    replays = re.findall(r"moet KPI: \d+ steps: replay ([\d.]+)% of steps", runs["w2-half"]["log"])
    assert replays and max(float(x) for x in replays) > 0  # verification steps did miss
    assert runs["fp4-all"]["tokens"] == hf_reference_tokens(model, model, tier="fp4r")
    assert runs["fp4-all"]["tokens"] != runs["resident"]["tokens"]  # FP4 is not W2 here
    gated = {n: re.findall(r"gate replay ([\d.]+)% of decode steps", runs[n]["log"])
             for n in ("fp4-all", "fp4-quarter")}  # fmt: skip
    assert gated["fp4-all"] and {float(g) for g in gated["fp4-all"]} == {0.0}
    assert gated["fp4-quarter"] and max(float(g) for g in gated["fp4-quarter"]) > 0


def test_an_auto_fp4_pool_is_sized_before_serving(tmp_path):
    """fp4_pool=auto on vLLM CPU: sized once the KV cache is allocated, from the memory left
    less the reserve, at most a quarter of the pairs (this host has room for that), and it
    serves: the pool swaps by heat."""
    env = fp4_env(tmp_path / "packs", "auto", MOET_KPI_EVERY="4", MOET_GATE="0")
    r = run_vllm(FIXTURE, tmp_path, "fp4-auto", quantization="moet", extra=ONE_SEQ,
                 prompts=fixture_prompts(2), env=env)  # fmt: skip
    assert re.search(r"fp4_pool=auto: [\d.]+ GiB free, [\d.]+ GiB kept for the KV cache: 48 FP4 "
                     r"slots \(FP4 pool coverage 25.0%", r["log"]), r["log"][-3000:]  # fmt: skip
    assert "FP4 pool coverage 25.0% (routed experts at FP4" in r["log"]
