"""GPU memory accounting with tiered residency (marker `gpu`, run by ci/gpu.sh on the H200 after
the other GPU tests, alone on the GPU: vLLM's memory profiling measures the whole device).

design.md: an explicit pool is allocated at load, so vLLM's profiling counts it as weights and the
KV cache gets the rest: KV bytes with the pool = without it - pool bytes, +-1%. The model is the
CPU suite's wide random Qwen3-MoE (2 MoE layers x 64 experts of intermediate 24576, 2.65 MB per
expert row, 2.4 GB of bf16): pools at the boot floor and of every expert differ by ~313 MB."""

from __future__ import annotations

import pytest
from serving import pool_and_kv_deltas

from moet_kernels.layout import NativeRowLayout

pytestmark = pytest.mark.gpu


def test_an_explicit_pool_comes_out_of_the_kv_cache_on_the_gpu(tmp_path):
    """Three eager boots with vLLM's profiling on (no fixed KV size): the first writes the packs,
    then a pool at the boot floor and one of every expert (native rows); their KV caches differ by
    the pools' bytes (serving.pool_and_kv_deltas)."""
    flags = ["--gpu-memory-utilization", "0.3"]
    kv_delta, pool_delta = pool_and_kv_deltas(tmp_path, flags, NativeRowLayout, "bfloat16")
    print(f"KV cache: {kv_delta / 1e6:.1f} MB less for {pool_delta / 1e6:.1f} MB more pool")
    assert kv_delta == pytest.approx(pool_delta, rel=0.01), (kv_delta, pool_delta)
