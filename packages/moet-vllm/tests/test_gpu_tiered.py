"""Tiered residency served by vLLM 0.24 on a GPU (marker `gpu`, run by ci/gpu.sh on the H200):
the trained fixture (serving.FIXTURE: GLM-4.5 family, 3 MoE layers x 64 experts of intermediate
32, top-4), converted by `moet convert` and served in bfloat16 through moet-kernels with vLLM's
compilation and CUDA graphs (GPU_DRIVER_FLAGS). Engines of one comparison run the same prompts,
batch limit and capture sizes, so the batches vLLM forms (and so the dense layers' arithmetic)
are the same; what differs is where the experts come from. On a CUDA machine a missing
prerequisite fails, never skips.
"""

from __future__ import annotations

import shutil

import pytest
from serving import (
    BITWISE_ENV,
    BITWISE_FLAGS,
    GPU_DRIVER_FLAGS,
    KERNEL_LINE,
    corrupt_packs,
    fixture_prompts,
    run_vllm,
    run_vllm_side_by_side,
)

from moet_vllm.residency.sizing import boot_floor

pytestmark = pytest.mark.gpu
SEQS = 4  # max_num_seqs of the comparisons: 8 prompts, 4 decoding together
FLOOR = boot_floor(3, 4, 1, SEQS)  # 56 of the fixture's 192 (layer, expert) pairs


def drive(model, env, prompts=8) -> dict:
    """run_vllm's arguments of one engine: GPU_DRIVER_FLAGS, BITWISE_ENV and _FLAGS, greedy,
    bfloat16."""
    return {
        "model": model, "env": {**BITWISE_ENV, **env}, "dtype": "bfloat16",
        "prompts": fixture_prompts(prompts),
        "extra": [*GPU_DRIVER_FLAGS, *BITWISE_FLAGS, "--max-num-seqs", str(SEQS)],
    }  # fmt: skip


POOLS = {"50%": "96", "the-floor": str(FLOOR), "below-the-floor": str(FLOOR - 16)}


@pytest.fixture(scope="module")
def engines(fixture_moet, tmp_path_factory) -> dict:
    """All-resident (gpu_pool=all: every expert in native rows, through the same op and layout),
    its twin, and each of POOLS, side by side; each engine with a pack cache of its own
    (`<name>-packs`), so no hot set saved by another run warms a pool up."""
    tmp = tmp_path_factory.mktemp("tiered")
    runs = {"resident": {}, "resident-twin": {}}
    # the replay path (misses fetched, the step run again), and the floor read in place
    runs.update(
        {name: {"MOET_GPU_POOL": pool, "MOET_READ_IN_PLACE": "0"} for name, pool in POOLS.items()}
    )
    runs["in-place"] = {"MOET_GPU_POOL": str(FLOOR)}  # read_in_place=auto: on here
    runs["below-the-floor"]["MOET_BELOW_FLOOR_OK"] = "1"
    for name, env in runs.items():
        env.update({"MOET_CACHE_DIR": str(tmp / f"{name}-packs"), "MOET_KPI_EVERY": "1"})
    runs = run_vllm_side_by_side(tmp, {n: drive(fixture_moet, env) for n, env in runs.items()})
    for name, run in runs.items():
        assert KERNEL_LINE in run["log"], (name, run["log"][-3000:])
        run["packs"] = tmp / f"{name}-packs"
    return runs


def test_two_all_resident_engines_side_by_side_agree_bit_for_bit(engines):
    """The comparisons below are meaningful only where the environment is deterministic: two
    identical engines run beside the others give the same tokens and logprobs."""
    resident, twin = engines["resident"], engines["resident-twin"]
    assert twin["tokens"] == resident["tokens"]
    assert twin["logprobs"] == resident["logprobs"]


@pytest.mark.parametrize("name", POOLS)
def test_tiered_tokens_and_logprobs_equal_all_resident_bit_for_bit(engines, name):
    """A pool of 50%, of the boot floor, and below it (consented): every generated token and its
    logprob equals the all-resident engine's, bit for bit, and the pool did miss: replayed
    steps and fetched experts are counted (a run that never missed cannot pass)."""
    tiered, resident, pool = engines[name], engines["resident"], POOLS[name]
    assert f"tiered residency: {pool} expert slots for 3 MoE layers x 64 experts" in tiered["log"]
    assert tiered["tokens"] == resident["tokens"]
    assert tiered["logprobs"] == resident["logprobs"]
    counters = tiered["residency"]
    assert counters["replayed_steps"] > 0 and counters["replays"] > 0, counters
    assert counters["fetched_rows"] > 0, counters
    assert counters["unrestored_steps"] == 0, counters
    print(f"pool {pool}: {counters}")


def test_reading_in_place_equals_all_resident_bit_for_bit_without_a_replay(engines):
    """A pool at the boot floor reading in place (the default on a GPU): the kernels compute
    what the pool lacks from the pinned host rows, inside the captured graphs; every token and
    logprob equals the all-resident engine's, no step replayed, steps did read rows in place,
    and the pool took experts in (promotions between steps)."""
    tiered, resident = engines["in-place"], engines["resident"]
    assert f"tiered residency: {FLOOR} expert slots" in tiered["log"], tiered["log"][-3000:]
    assert tiered["tokens"] == resident["tokens"]
    assert tiered["logprobs"] == resident["logprobs"]
    counters = tiered["residency"]
    assert counters["replays"] == 0 and counters["replayed_steps"] == 0, counters
    assert counters["host_read_rows"] > 0 and counters["fetched_rows"] > 0, counters
    print(f"in place, pool {FLOOR}: {counters}")


def test_a_corrupt_pack_fails_the_request_instead_of_serving_zeroed_experts(
    fixture_moet, engines, tmp_path
):
    """Fail closed (strict, the default): the packs of the 50% run are copied and corrupted on
    disk (one byte of every row flipped: each row's checksum no longer matches) and the hot set
    removed, so a boot reads the packs only when a step misses, from the page cache; the first
    fetch fails its checks, is retried, and the step fails: the engine stops with moet's message
    and no output is written, so no zeroed-expert token is ever returned (test_vllm_tiered.py
    runs the same on CPU)."""
    cache = tmp_path / "packs"
    shutil.copytree(engines["50%"]["packs"], cache)
    corrupt_packs(cache)
    env = {
        "MOET_CACHE_DIR": str(cache),
        "MOET_GPU_POOL": POOLS["50%"],
        "MOET_HOST_TIER": "pagecache",
    }
    args = drive(fixture_moet, env, prompts=2)
    r = run_vllm(tmp_path=tmp_path, name="corrupt", check=False, **args)
    assert r["returncode"] != 0, r["log"][-3000:]
    assert "the step's experts cannot be restored" in r["log"], r["log"][-3000:]
    assert not (tmp_path / "corrupt.json").exists()
