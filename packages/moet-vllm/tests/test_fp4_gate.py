"""The FP4 tier's decisions (residency/fp4tier.py) and the gate simulation (gate_eval.py) on the
trained fixture: token-by-token decoding reproduces a whole-window forward, the gate replays
exactly the steps below tau, and FP4 rows served by the pool or the gate bring the loss down."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from serving import FIXTURE, split_prompt

from moet_vllm.gate_eval import (
    ORACLE,
    GateConfig,
    SimOptions,
    _Experts,
    _simulate,
    _teacher_forced,
)
from moet_vllm.residency.fp4tier import Fp4Tier, confidence

# --- the tier's rules -----------------------------------------------------------------------------


@pytest.mark.parametrize("sigmas", [0.0, 2.0])
def test_heat_fills_free_slots_then_swaps_only_pairs_hotter_by_the_margin(sigmas):
    """At most max_promotions a step; a swap needs a count above the resident's by `sigmas`
    standard deviations (sqrt of the sum): with 2, 5 routings against 3 are noise, 12 are not."""
    tier = Fp4Tier(4, 2, 8, max_promotions=1, half_life_steps=1e9, swap_sigmas=sigmas)  # counts
    for _ in range(3):  # 0, 1, 2, 3 routed three times each: they fill the pool
        tier.observe(np.array([0, 1, 2, 3]), gated=False)
        tier.commit(tier.heat_plan(np.array([0, 1, 2, 3])))
    assert sorted(np.flatnonzero(tier.resident.ravel())) == [0, 1, 2, 3]
    tier.observe(np.array([8, 9, 0]), gated=False)  # 8, 9 once: colder than every resident
    assert len(tier.heat_plan(np.array([8, 9, 0])).fetch_keys) == 0
    for _ in range(4):  # 8 and 9 routed 5 times in all against 3 for 1, 2, 3
        tier.observe(np.array([8, 9, 0]), gated=False)
    plan = tier.heat_plan(np.array([8, 9, 0]))
    if sigmas:  # 5 - 3 < 2 sqrt(8): no swap yet; at 12 routings 12 - 3 > 2 sqrt(15)
        assert len(plan.fetch_keys) == 0
        for _ in range(7):
            tier.observe(np.array([8, 9, 0]), gated=False)
        plan = tier.heat_plan(np.array([8, 9, 0]))
    assert len(plan.fetch_keys) == 1 and len(plan.evict_keys) == 1  # max_promotions
    assert plan.fetch_keys[0] in (8, 9) and plan.evict_keys[0] in (1, 2, 3)
    tier.commit(plan)
    assert tier.counters.promotions == 5 and tier.counters.evictions == 1


@pytest.mark.parametrize("zipf", [0.0, 1.0], ids=["uniform", "zipf"])
@pytest.mark.parametrize("batch", [1, 8])
def test_the_swap_margin_stops_noise_swaps_without_losing_hits(zipf, batch):
    """Random routing (4 layers x 64 experts, top-8) through a 25% pool: without the margin the
    heat rule keeps swapping rows (0.5-4 a step, past the fill); 2 sd swap at most a fifth as
    often, and the routed pairs found in the pool are as many or more."""
    n_layers, n_exp, k = 4, 64, 8
    p = 1.0 / np.arange(1, n_exp + 1) ** zipf
    p /= p.sum()

    def run(sigmas: float) -> tuple[float, float]:
        rng = np.random.default_rng(1)
        tier = Fp4Tier(n_layers * n_exp // 4, n_layers, n_exp, swap_sigmas=sigmas)
        promotions = hits = routed = 0
        for step in range(600):
            keys = np.concatenate([
                layer * n_exp + rng.choice(n_exp, k, replace=False, p=p)
                for layer in range(n_layers) for _ in range(batch)
            ])  # fmt: skip
            if step >= 200:  # past the fill
                pairs = np.unique(keys)
                hits += int(tier.resident.ravel()[pairs].sum())
                routed += len(pairs)
            tier.observe(keys, gated=False)
            plan = tier.heat_plan(keys)
            tier.commit(plan)
            promotions += len(plan.fetch_keys) if step >= 200 else 0
        return promotions / 400, hits / routed

    (noisy, hit0), (calm, hit2) = run(0.0), run(2.0)
    assert noisy >= 0.5 and calm <= noisy / 5, (noisy, calm)
    assert hit2 >= hit0 - 0.01, (hit0, hit2)


def _ranked_heat_plan(tier: Fp4Tier, routed: np.ndarray) -> np.ndarray:
    """The heat rule of fp4tier's module doc, spelled out: every outsider ranked hottest first,
    every resident the step did not route ranked coldest first, pairs taken while a slot is
    free or the margin holds -> the pairs that enter (what heat_plan must fetch)."""
    pol = tier.policy
    keys = np.unique(routed)
    table = pol.slot_table.ravel()
    out = keys[table[keys] < 0]
    resident = np.setdiff1d(np.flatnonzero(table >= 0), keys)
    hottest = sorted(out, key=lambda k: (-pol.score[k], k))
    coldest = sorted(resident, key=lambda k: (pol.score[k], k))
    free = int(np.count_nonzero(pol.slot_keys < 0))
    taken = []
    for i, k in enumerate(hottest):
        if i < free:
            taken.append(k)
            continue
        j = i - free
        if j >= tier.max_promotions or j >= len(coldest):
            break
        hot, cold = pol.score[k], pol.score[coldest[j]]
        if not hot - cold > tier.swap_sigmas * np.sqrt(hot + cold):
            break
        taken.append(k)
    return np.array(taken, dtype=np.int64)


@pytest.mark.parametrize("sigmas", [0.0, 2.0])
@pytest.mark.parametrize("zipf", [0.0, 1.0], ids=["uniform", "zipf"])
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_the_heat_plan_takes_the_pairs_a_full_ranking_takes(sigmas, zipf, batch):
    """heat_plan skips the sorts when a full pool swaps nothing (the usual step) and takes a
    routed mask's sorted keys as they come: step for step, over the fill and long after it, it
    fetches exactly the pairs the rule ranked in full takes."""
    n_layers, n_exp, k = 4, 64, 8
    p = 1.0 / np.arange(1, n_exp + 1) ** zipf
    p /= p.sum()
    rng = np.random.default_rng(batch)
    tier = Fp4Tier(n_layers * n_exp // 4, n_layers, n_exp, swap_sigmas=sigmas)
    for step in range(300):
        keys = np.concatenate([
            layer * n_exp + rng.choice(n_exp, k, replace=False, p=p)
            for layer in range(n_layers) for _ in range(batch)
        ])  # fmt: skip
        if step % 2:  # as the serving runner passes them: a routed mask's keys
            keys = np.unique(keys)
        tier.observe(keys, gated=False)
        plan = tier.heat_plan(keys)
        assert sorted(plan.fetch_keys) == sorted(_ranked_heat_plan(tier, keys)), step
        tier.commit(plan)


def test_the_gate_plan_makes_every_routed_pair_resident():
    tier = Fp4Tier(4, 2, 8)
    tier.commit(tier.heat_plan(np.array([0, 1, 2, 3])))
    plan = tier.gate_plan(np.array([5, 9, 9, 0]))
    tier.commit(plan)
    assert set(np.flatnonzero(tier.resident.ravel())) >= {0, 5, 9}
    assert len(plan.evict_keys) == 2


def test_confidence_is_the_top_probability_or_the_top_two_margin():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    p = torch.softmax(logits.double(), -1)
    assert torch.allclose(confidence(logits, "prob"), p.max(-1).values)
    margin = confidence(logits, "margin")
    assert margin[0].item() == pytest.approx(1.0) and margin[1].item() == 0.0
    with pytest.raises(ValueError, match="confidence metric"):
        confidence(logits, "entropy")


def test_the_gate_scales_tau_by_the_share_of_the_steps_pairs_at_w2():
    """A step whose routed pairs all hold FP4 rows never replays (it would compute the same);
    with half of them at W2 the threshold is half of tau; repeated keys count once."""
    tier = Fp4Tier(4, 2, 8)
    tier.commit(tier.policy.plan(np.array([0, 1, 2, 3])))
    assert tier.w2_share(np.array([0, 1, 1, 2])) == 0.0
    assert not tier.gates(0.0, np.array([0, 1, 1, 2]), 1e9)
    half = np.array([0, 1, 8, 9, 9])
    assert tier.w2_share(half) == 0.5
    assert tier.gates(0.49, half, 1.0) and not tier.gates(0.5, half, 1.0)
    assert tier.gates(0.99, np.array([10, 11]), 1.0) and not tier.gates(1.0, np.array([10]), 1.0)


# --- the simulation -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim():
    """The fixture in float32 with its W2 and fp4r copies, over 320 test-split tokens in
    windows of 160."""
    from transformers import AutoModelForCausalLM

    from moet_quant.quality import quantized_copy, windows_of

    _, ids = split_prompt(321)
    tokens = np.asarray(ids, dtype=np.int64)
    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURE), dtype=torch.float32).eval()
    w2, _ = quantized_copy(ref, "w2-reference")
    fp4, _ = quantized_copy(ref, "fp4r")
    wins = windows_of(tokens.size, 160)
    return {"tokens": tokens, "wins": wins, "ref": ref, "w2": w2, "fp4": fp4,
            "experts": _Experts(w2, w2, fp4)}  # fmt: skip


def run(sim, cfg):
    return _simulate(sim["w2"], sim["experts"], sim["tokens"], sim["wins"], cfg, lambda _n: None)


def test_decoding_token_by_token_without_a_pool_is_the_w2_models_forward(sim):
    """No FP4 pool: every step runs W2, so the incremental decode (KV cache, one token a step)
    gives the logits of a whole-window forward of the W2 model."""
    top, nll = _teacher_forced(sim["w2"], sim["tokens"], sim["wins"])
    r = run(sim, GateConfig(0.0, 0.9))
    assert not r["gated"].any() and r["promotions"] == 0  # no pool: nothing to promote
    np.testing.assert_allclose(r["nll"], nll, atol=1e-4)
    assert np.mean(r["top"] == top) >= 0.99  # float32 reorderings may flip exact near-ties


def test_the_gate_replays_the_steps_below_tau_and_fp4_lowers_the_loss(sim):
    """A pool of 25%: without the gate nothing replays, and the pool's FP4 rows alone lower the
    loss below bare W2's; with tau = 0.5 exactly the steps whose first pass's confidence was
    below it times the share of its routed pairs at W2 replay, and the loss falls further,
    towards all-FP4's."""
    bare = run(sim, GateConfig(0.0, 0.0))
    heat = run(sim, GateConfig(0.25, 0.0))
    gate = run(sim, GateConfig(0.25, 0.5))
    _, fp4_nll = _teacher_forced(sim["fp4"], sim["tokens"], sim["wins"])
    assert not heat["gated"].any() and heat["promotions"] > 0
    assert np.array_equal(gate["gated"], gate["conf"] < 0.5 * gate["w2_share"])
    assert gate["gated"].any() and (gate["w2_share"] < 1).any()  # the pool scaled some steps
    assert fp4_nll.mean() < gate["nll"].mean() < heat["nll"].mean() < bare["nll"].mean()


def test_the_oracle_replays_exactly_the_steps_that_disagree_with_all_fp4(sim):
    """The oracle's confidence is 0 where the first pass's greedy token differs from all-FP4's
    and 1 elsewhere: every such step with a routed pair at W2 replays and no other, so every
    step it leaves alone agrees with all-FP4 already, and it agrees more often than heat alone."""
    fp4_top, _ = _teacher_forced(sim["fp4"], sim["tokens"], sim["wins"])
    heat = run(sim, GateConfig(0.25, 0.0))
    cfg = GateConfig(0.25, 1.0, ORACLE)
    r = _simulate(sim["w2"], sim["experts"], sim["tokens"], sim["wins"], cfg, lambda _n: None,
                  fp4_top)  # fmt: skip
    assert set(np.unique(r["conf"])) <= {0.0, 1.0} and (r["conf"] == 0).any()
    assert np.array_equal(r["gated"], (r["conf"] == 0) & (r["w2_share"] > 0))
    left = ~r["gated"] & (r["w2_share"] > 0)  # ran their W2 pairs and were not replayed
    assert (r["top"][left] == fp4_top[left]).all()
    assert np.mean(r["top"] == fp4_top) > np.mean(heat["top"] == fp4_top)
    with pytest.raises(ValueError, match="oracle"):
        run(sim, cfg)  # without all-FP4's tokens


def test_eval_gate_reports_every_configuration(tmp_path):
    from moet_vllm.gate_eval import evaluate_gate, format_table

    _, ids = split_prompt(161)
    cfgs = [GateConfig(0.0, 0.0), GateConfig(0.1, 0.3, "margin"), GateConfig(0.1, 1.0, ORACLE)]
    report = evaluate_gate(FIXTURE, np.asarray(ids), cfgs, SimOptions(window=80, n_boot=50))
    assert report["tokens"] == 160 and report["windows"] == 2
    rows = report["configs"]
    assert list(rows) == [c.name for c in cfgs] and rows[cfgs[1].name]["slots"] == 19  # of 192
    assert rows[cfgs[0].name]["gated_pct"] == 0.0
    table = format_table(report)
    assert "| 10% (19) | 0.3 margin |" in table and "| 10% (19) | oracle |" in table
    assert rows[cfgs[2].name]["gated_pct"] > 0  # all-FP4's tokens reached the oracle


def test_eval_gate_refuses_bad_input_with_one_line(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "tokens.npy"
    np.save(bad, np.zeros((2, 3), dtype=np.int32))
    cmd = [sys.executable, "-m", "moet_vllm.cli", "eval-gate", str(FIXTURE), "--tokens", str(bad)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"moet: error: {bad}: expected a 1-D array of token ids, got (2, 3)"
    good = tmp_path / "ok.npy"
    np.save(good, np.arange(64, dtype=np.int32))
    report = tmp_path / "missing" / "report.json"  # refused before the run, not after it
    cmd[-1] = str(good)
    r = subprocess.run([*cmd, "--json", str(report)], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (
        f"moet: error: cannot write the report {report}: {report.parent} is not a writable folder"
    )
