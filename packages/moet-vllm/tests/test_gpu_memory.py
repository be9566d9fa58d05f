"""GPU memory accounting with tiered residency (marker `gpu`, run by ci/gpu.sh on the H200 after
the other GPU tests, alone on the GPU: vLLM's memory profiling measures the whole device).

design.md: an explicit pool is allocated at load, so vLLM's profiling counts it as weights and the
KV cache gets the rest: KV bytes with the pool = without it - pool bytes, +-1%. The model is the
CPU suite's wide random Qwen3-MoE (2 MoE layers x 64 experts of intermediate 24576, 2.65 MB per
expert row, 2.4 GB of bf16): pools at the boot floor and of every expert differ by ~313 MB."""

from __future__ import annotations

import pytest
from serving import check_gpu_prerequisites, run_vllm
from tiny_models import config, write_tiny_model

from moet_kernels.layout import NativeRowLayout
from moet_quant import convert
from moet_vllm.residency.sizing import boot_floor

pytestmark = pytest.mark.gpu
WIDE = {"num_experts": 64, "moe_intermediate_size": 24576}


@pytest.fixture(scope="module", autouse=True)
def prerequisites():
    check_gpu_prerequisites()


def test_an_explicit_pool_comes_out_of_the_kv_cache_on_the_gpu(tmp_path):
    """Three boots, vLLM's profiling on (no fixed KV size): the first writes the packs, then a
    pool at the boot floor and one of every expert; their KV caches differ by the pools' bytes."""
    src = write_tiny_model("qwen3_moe", tmp_path / "wide", overrides=WIDE)
    model = convert.convert(src, tmp_path / "wide-moet", progress=False).out
    cfg = config("qwen3_moe", WIDE)
    keys = cfg["num_hidden_layers"] * cfg["num_experts"]
    floor = boot_floor(cfg["num_hidden_layers"], cfg["num_experts_per_tok"], 1, 1)
    flags = ["--graphs", "1", "--max-num-seqs", "1", "--gpu-memory-utilization", "0.3"]
    flags += ["--prompts", "1", "--max-tokens", "2"]
    runs = {}
    for name, slots in (("packs", keys), ("floor", floor), ("all", keys)):
        env = {"MOET_GPU_POOL": str(slots), "MOET_CACHE_DIR": str(tmp_path / "packs")}
        runs[name] = run_vllm(model, tmp_path, f"kv-{name}", env=env, dtype="bfloat16", extra=flags)
        assert f"tiered residency: {slots} expert slots" in runs[name]["log"]
    assert runs["floor"]["tokens"] == runs["all"]["tokens"] == runs["packs"]["tokens"]
    # bfloat16 K and V per token: layers x 2 x kv heads x head dim x 2 bytes
    token_bytes = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    kv_delta = (runs["floor"]["kv_cache_tokens"] - runs["all"]["kv_cache_tokens"]) * token_bytes
    row_bytes = NativeRowLayout(cfg["hidden_size"], cfg["moe_intermediate_size"]).row_bytes
    pool_delta = (keys - floor) * row_bytes
    print(f"KV cache: {kv_delta / 1e6:.1f} MB less for {pool_delta / 1e6:.1f} MB more pool")
    assert kv_delta == pytest.approx(pool_delta, rel=0.01), (kv_delta, pool_delta)
