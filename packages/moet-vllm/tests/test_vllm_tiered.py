"""Tiered residency end to end on vLLM CPU (float32), on the trained fixture (serving.FIXTURE:
3 MoE layers x 64 experts, top-4) and prompts of the text it was trained on, so the pool works
with real routing: a pool smaller than the experts gives the greedy tokens of a fully resident run
scheduled the same way, which are transformers' with the same W2 experts; KPI lines show the
replays; the next boot preloads the saved hot set; a pool below the boot floor is refused with the
number that works. An explicit pool comes out of the KV cache, byte for byte (a wider random
model, so the pool's bytes stand well above the run-to-run noise of vLLM's memory accounting).
"""

from __future__ import annotations

import re
import time
import urllib.request

import pytest
from serving import (
    FIXTURE,
    FIXTURE_TEXTS,
    NAME,
    Server,
    convert_fixture,
    corrupt_packs,
    fixture_prompts,
    hf_reference_tokens,
    pool_and_kv_deltas,
    run_vllm,
)

from moet_kernels.layout import RowLayout

pytest.importorskip("vllm")

KEYS = 3 * 64  # (MoE layer, expert) pairs of the fixture


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return convert_fixture(tmp_path_factory.mktemp("tiered") / "fixture-moet")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("packs")


def kpis(log: str) -> list[float]:
    return [float(m) for m in re.findall(r"moet KPI: \d+ steps: replay ([\d.]+)% of steps", log)]


def test_a_pool_of_37_percent_serves_the_resident_tokens(model, cache, tmp_path):
    one_seq = ["--max-num-seqs", "1"]
    prompts = fixture_prompts(2)
    resident = run_vllm(model, tmp_path, "resident", extra=one_seq, prompts=prompts)
    assert resident["tokens"] == hf_reference_tokens(FIXTURE, model, prompts=prompts)
    env = {"MOET_GPU_POOL": "72", "MOET_KPI_EVERY": "2", "MOET_CACHE_DIR": str(cache)}
    tiered = run_vllm(model, tmp_path, "tiered", env=env, extra=one_seq, prompts=prompts)
    assert tiered["tokens"] == resident["tokens"]
    log = tiered["log"]
    assert (
        "tiered residency: 72 expert slots for 3 MoE layers x 64 experts (pool coverage 37.5%"
        in log
    )
    assert kpis(log) and max(kpis(log)) > 0  # steps did replay
    assert "warm start: 0 experts preloaded" in log


def test_reading_in_place_serves_the_resident_tokens_and_logprobs_without_a_replay(model, tmp_path):
    """read_in_place (host_tier=ram): a pool of 25% computes what it lacks from the host rows:
    every token and logprob equals the resident run's, bit for bit, no step replays, and steps
    did read experts in place."""
    flags, prompts = ["--max-num-seqs", "2"], fixture_prompts(4)
    resident = run_vllm(model, tmp_path, "resident-in-place", extra=flags, prompts=prompts)
    env = {"MOET_GPU_POOL": "48", "MOET_READ_IN_PLACE": "1", "MOET_KPI_EVERY": "2",
           "MOET_CACHE_DIR": str(tmp_path / "packs")}  # fmt: skip  # its hot set warms no other test
    tiered = run_vllm(model, tmp_path, "in-place", env=env, extra=flags, prompts=prompts)
    assert tiered["tokens"] == resident["tokens"]
    assert tiered["logprobs"] == resident["logprobs"]
    log = tiered["log"]
    assert kpis(log) and max(kpis(log)) == 0.0, log[-3000:]  # no step replayed
    read = [float(m) for m in re.findall(r"read in place ([\d.]+)% of steps", log)]
    assert read and max(read) > 0, log[-3000:]


def test_sixteen_concurrent_requests_below_the_floor_with_a_warm_start(model, cache, tmp_path):
    """16 prompts queued at once, 4 running together, a pool of 48 slots (below the floor of 56
    for 4 sequences: consented): every output equals the resident run's; the hot set saved by
    the previous boot is preloaded."""
    flags = ["--max-num-seqs", "4"]
    prompts = fixture_prompts(16)
    resident = run_vllm(model, tmp_path, "resident16", extra=flags, prompts=prompts)
    env = {
        "MOET_GPU_POOL": "48",
        "MOET_BELOW_FLOOR_OK": "1",
        "MOET_KPI_EVERY": "4",
        "MOET_CACHE_DIR": str(cache),
    }
    tiered = run_vllm(model, tmp_path, "tiered16", env=env, extra=flags, prompts=prompts)
    assert len(tiered["tokens"]) == 16 and all(len(t) == 8 for t in tiered["tokens"])
    assert tiered["tokens"] == resident["tokens"]
    assert "48 expert slots for 3 MoE layers x 64 experts (pool coverage 25.0%" in tiered["log"]
    preloaded = re.search(r"warm start: (\d+) experts preloaded", tiered["log"])
    assert preloaded and int(preloaded.group(1)) > 0, tiered["log"][-3000:]


def test_a_pool_below_the_floor_is_refused_with_the_number_that_works(model, cache, tmp_path):
    env = {"MOET_GPU_POOL": "8", "MOET_CACHE_DIR": str(cache)}
    r = run_vllm(model, tmp_path, "floor", env=env, extra=["--max-num-seqs", "1"], check=False)
    assert r["returncode"] != 0
    # 1.15 x 3 MoE layers x top-4 x 1 token/step x 1 sequence = 13.8
    assert "gives 8 expert slots, below the boot floor of 14" in r["log"]
    assert "set gpu_pool >= 14" in r["log"]


def test_an_auto_pool_takes_what_the_kv_cache_leaves(model, cache, tmp_path):
    """gpu_pool=auto: one slot at load, then, once vLLM has allocated the KV cache and before it
    warms up, every slot the host's available memory holds less the reserve: here all 192 pairs
    (the fixture is small), so the tokens are the resident run's; a reserve larger than the
    machine is refused at that point, naming the memory that would work."""
    one_seq = ["--max-num-seqs", "1"]
    prompts = fixture_prompts(2)
    env = {"MOET_GPU_POOL": "auto", "MOET_KPI_EVERY": "2", "MOET_CACHE_DIR": str(cache)}
    auto = run_vllm(model, tmp_path, "auto", env=env, extra=one_seq, prompts=prompts)
    assert auto["tokens"] == hf_reference_tokens(FIXTURE, model, prompts=prompts)
    log = auto["log"]
    assert "tiered residency: 1 expert slots" in log and "re-sized once the KV cache" in log
    sized = re.search(r"gpu_pool=auto: [\d.]+ GiB free after the KV cache, 2.00 GiB kept free "
                      r"\(pool_reserve_gib\): 192 expert slots \(pool coverage 100.0%", log)  # fmt: skip
    assert sized, log[-3000:]
    assert log.index("GiB for KV cache") < sized.start()  # vLLM's KV cache line comes first
    env["MOET_POOL_RESERVE_GIB"] = "100000"
    r = run_vllm(model, tmp_path, "auto-refused", env=env, extra=one_seq, check=False)
    assert r["returncode"] != 0
    assert re.search(r"GiB free after the KV cache, less pool_reserve_gib=100000, hold 1 "
                     r"expert slots of [\d.]+ MiB, below the boot floor of 14: leave at least "
                     r"100000\.\d\d GiB free", r["log"]), r["log"][-3000:]  # fmt: skip


def test_an_explicit_pool_comes_out_of_the_kv_cache(tmp_path):
    """design.md: KV bytes with the pool = without it - pool bytes, +-1%. With
    VLLM_CPU_KVCACHE_SPACE unset, vLLM CPU sizes the KV cache as gpu_memory_utilization x the
    host's memory less what the worker holds once the model is loaded and profiled (the GPU worker
    subtracts its measured memory the same way), so a pool allocated at load must come out of it.
    The first boot writes the pack files (its allocator keeps some of that memory); the next two,
    a pool at the boot floor and one of every expert, read them and differ only in the pool
    (serving.pool_and_kv_deltas)."""
    kv_delta, pool_delta, _ = pool_and_kv_deltas(
        tmp_path, ["--gpu-memory-utilization", "0.15"], RowLayout
    )
    assert kv_delta == pytest.approx(pool_delta, rel=0.01), (kv_delta, pool_delta)


def test_a_corrupt_pack_fails_the_request_instead_of_serving_zeroed_experts(model, tmp_path):
    """Fail closed (strict, the default): the packs of a first run corrupted on disk (every row's
    checksum fails) and its hot set removed, the next boot reads rows only when a step misses
    (host tier `pagecache`); the fetch fails its checks three times and the step fails: the
    engine stops with moet's message and writes no output."""
    cache = tmp_path / "packs"
    env = {"MOET_CACHE_DIR": str(cache), "MOET_GPU_POOL": "96", "MOET_HOST_TIER": "pagecache"}
    run_vllm(model, tmp_path, "writes-the-packs", env=env, prompts=fixture_prompts(1))
    corrupt_packs(cache)
    r = run_vllm(model, tmp_path, "corrupt", env=env, prompts=fixture_prompts(1), check=False)
    assert r["returncode"] != 0, r["log"][-3000:]
    assert "failed 3 times" in r["log"] and "the step's experts cannot be restored" in r["log"]
    assert not (tmp_path / "corrupt.json").exists()


def test_openai_server_reports_residency_on_metrics(model, tmp_path):
    """`moet serve` with a partial pool: completions work, and the workers' residency counters
    reach the API server's Prometheus `/metrics` (residency/metrics.py)."""
    env = {"MOET_GPU_POOL": "72", "MOET_KPI_EVERY": "2"}
    srv = Server(model, tmp_path / "server.log", tmp_path / "cache", ["--max-num-seqs", "1"], env)
    try:
        srv.wait_ready()
        for prompt in FIXTURE_TEXTS[:2]:
            body = {"model": NAME, "prompt": prompt, "max_tokens": 6, "ignore_eos": True}
            r = srv.post("/v1/completions", body)
            assert r["usage"]["completion_tokens"] == 6
        time.sleep(1.5)  # workers publish at most once a second
        srv.post("/v1/completions", {"model": NAME, "prompt": "again", "max_tokens": 2})
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        assert srv.stop() == 0
    metric = dict(re.findall(r'^(moet_\w+)\{rank="0"\} ([\d.e+]+)$', text, re.M))
    assert float(metric["moet_steps_total"]) >= 10, text[-2000:]
    assert float(metric["moet_replayed_steps_total"]) > 0
    assert float(metric["moet_fetched_bytes_total"]) > 0
    assert float(metric["moet_pool_coverage"]) == pytest.approx(0.375)
    assert "moet KPI:" in srv.log()
