"""Tiered residency served by vLLM 0.24 on a GPU (marker `gpu`, run by ci/gpu.sh on the H200):
the trained fixture (serving.FIXTURE: GLM-4.5 family, 3 MoE layers x 64 experts of intermediate
32, top-4), converted by `moet convert` and served in bfloat16 through moet-kernels with vLLM's
compilation and CUDA graphs (GPU_DRIVER_FLAGS). Engines of one comparison run the same prompts,
batch limit and capture sizes, so the batches vLLM forms (and so the dense layers' arithmetic)
are the same; what differs is where the experts come from. On a CUDA machine a missing
prerequisite fails, never skips.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from serving import (
    GPU_DRIVER_FLAGS,
    KERNEL_LINE,
    corrupt_packs,
    fixture_prompts,
    run_vllm,
)

from moet_vllm.residency.sizing import boot_floor

pytestmark = pytest.mark.gpu
SEQS = 4  # max_num_seqs of the comparisons: 8 prompts, 4 decoding together
FLOOR = boot_floor(3, 4, 1, SEQS)  # 56 of the fixture's 192 (layer, expert) pairs


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu-packs")


def drive(model, tmp_path, name, env=None, prompts=8, seqs=SEQS) -> dict:
    """One engine (vllm_driver.py, its own process): GPU_DRIVER_FLAGS, greedy, bfloat16."""
    return run_vllm(
        model, tmp_path, name, env=env, dtype="bfloat16",
        extra=[*GPU_DRIVER_FLAGS, "--max-num-seqs", str(seqs)], prompts=fixture_prompts(prompts),
    )  # fmt: skip


# --- tiered residency against all-resident ------------------------------------------------------


@pytest.fixture(scope="module")
def resident(fixture_moet, cache, tmp_path_factory) -> dict:
    """gpu_pool=all: every expert resident in native rows, through the same op and layout."""
    run = drive(
        fixture_moet,
        tmp_path_factory.mktemp("resident"),
        "resident",
        {"MOET_CACHE_DIR": str(cache)},
    )
    assert KERNEL_LINE in run["log"]
    return run


@pytest.mark.parametrize(
    "pool, extra_env",
    [("96", {}), (str(FLOOR), {}), (str(FLOOR - 16), {"MOET_BELOW_FLOOR_OK": "1"})],
    ids=["50%", "the-floor", "below-the-floor"],
)
def test_tiered_tokens_and_logprobs_equal_all_resident_bit_for_bit(
    fixture_moet, resident, tmp_path, pool, extra_env
):
    """A pool of 50%, of the boot floor, and below it (consented): every generated token and its
    logprob equals the all-resident engine's, bit for bit, and the pool did miss: replayed
    steps and fetched experts are counted (a run that never missed cannot pass)."""
    # a cache of its own: no hot set saved by another run warms this pool up
    env = {"MOET_CACHE_DIR": str(tmp_path / "packs"), "MOET_GPU_POOL": pool, "MOET_KPI_EVERY": "1"}
    env.update(extra_env)
    tiered = drive(fixture_moet, tmp_path, f"tiered-{pool}", env)
    assert KERNEL_LINE in tiered["log"]
    assert f"tiered residency: {pool} expert slots for 3 MoE layers x 64 experts" in tiered["log"]
    assert tiered["tokens"] == resident["tokens"]
    assert tiered["logprobs"] == resident["logprobs"]
    counters = tiered["residency"]
    assert counters["replayed_steps"] > 0 and counters["replays"] > 0, counters
    assert counters["fetched_rows"] > 0, counters
    assert counters["unrestored_steps"] == 0, counters
    print(f"pool {pool}: {counters}")


def test_a_corrupt_pack_fails_the_request_instead_of_serving_zeroed_experts(fixture_moet, tmp_path):
    """Fail closed (strict, the default): the packs of a first run are corrupted on disk (one
    byte of every row flipped: each row's checksum no longer matches) and the hot set removed, so
    a second boot reads the packs only when a step misses, from the page cache; the first fetch
    fails its checks, is retried, and the step fails: the engine stops with moet's message and
    no output is written, so no zeroed-expert token is ever returned (test_vllm_tiered.py runs
    the same on CPU)."""
    cache = tmp_path / "packs"
    env = {"MOET_CACHE_DIR": str(cache), "MOET_GPU_POOL": "96", "MOET_HOST_TIER": "pagecache"}
    drive(fixture_moet, tmp_path, "writes-the-packs", env, prompts=2)
    corrupt_packs(cache)
    extra = [*GPU_DRIVER_FLAGS, "--max-num-seqs", str(SEQS)]
    r = run_vllm(fixture_moet, tmp_path, "corrupt", env=env, dtype="bfloat16", extra=extra,
                 prompts=fixture_prompts(2), check=False)  # fmt: skip
    assert r["returncode"] != 0, r["log"][-3000:]
    assert "the step's experts cannot be restored" in r["log"], r["log"][-3000:]
    assert not (tmp_path / "corrupt.json").exists()
