"""GPU memory accounting with tiered residency (marker `gpu`, run by ci/gpu.sh on the H200 after
the other GPU tests, alone on the GPU: vLLM's memory profiling measures the whole device).

design.md: an explicit pool is allocated at load, so vLLM's profiling counts it as weights and the
KV cache gets the rest: KV bytes with the pool = without it - pool bytes, +-1%. The model is the
CPU suite's wide random Qwen3-MoE (2 MoE layers x 64 experts of intermediate 24576, 2.65 MB per
expert row, 2.4 GB of bf16): pools at the boot floor and of every expert differ by ~313 MB.
`gpu_pool=auto` is carved out of vLLM's KV budget instead, so it takes the same bytes from it."""

from __future__ import annotations

import re

import pytest
from serving import pool_and_kv_deltas

from moet_kernels.layout import NativeRowLayout

pytestmark = pytest.mark.gpu


def test_an_explicit_pool_comes_out_of_the_kv_cache_and_an_auto_pool_out_of_its_budget(tmp_path):
    """Four eager boots with vLLM's profiling on (no fixed KV size): the first writes the packs,
    then a pool at the boot floor and one of every expert (native rows): their KV caches differ by
    the pools' bytes (serving.pool_and_kv_deltas); then gpu_pool=auto, one slot at load and, once
    vLLM has its KV budget (determine_available_memory, before any capture), every expert: that
    budget less the reserve holds them all, and the KV cache is the all-expert pool's, +-1% of the
    pools' difference."""
    flags = ["--gpu-memory-utilization", "0.3"]
    kv_delta, pool_delta, runs = pool_and_kv_deltas(
        tmp_path, flags, NativeRowLayout, "bfloat16", then=("auto",)
    )
    print(f"KV cache: {kv_delta / 1e6:.1f} MB less for {pool_delta / 1e6:.1f} MB more pool")
    assert kv_delta == pytest.approx(pool_delta, rel=0.01), (kv_delta, pool_delta)
    log = runs["auto"]["log"]
    sized = re.search(
        r"gpu_pool=auto: [\d.]+ GiB of vLLM's KV-cache budget, 2\.00 GiB kept for the KV cache "
        r"\(pool_reserve_gib\): 128 expert slots \(pool coverage 100\.0%",
        log,
    )
    assert sized, log[-3000:]
    floor, all_, auto = (runs[n]["kv_cache_tokens"] for n in ("floor", "all", "auto"))
    auto_delta = kv_delta * (floor - auto) / (floor - all_)  # KV bytes per token from the pair
    print(f"gpu_pool=auto: KV cache {auto_delta / 1e6:.1f} MB below the floor pool's")
    assert auto_delta == pytest.approx(pool_delta, rel=0.01), (auto_delta, pool_delta)
