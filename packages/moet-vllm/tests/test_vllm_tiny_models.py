"""The tiny seeded checkpoints of tiny_models.py: complete, loadable, reproducible.

Each architecture's checkpoint is written once per session; transformers loads it unchanged with
no missing tensor and gives finite logits, moet-quant's reader finds the routed experts (and GLM's
MTP layer), the tokenizer loads and round-trips, and a second write is byte-identical. vLLM itself
is not needed here (its check is a separate script).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tiny_models import (
    ARCHS,
    CONFIGS,
    EXPECTED,
    MARKER,
    MTP_EXTRA,
    SPECIAL_TOKENS,
    WEATHER_TOOL,
    write_all,
    write_tiny_model,
)

from moet_quant.checkpoint import open_checkpoint

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
TEXT = "Hello, world! Experts route tokens: 2.25 bits/weight. Ünïcødé → ok\n"


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_all(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_is_complete(models: dict[str, Path], arch: str) -> None:
    d = models[arch]
    for f in FILES:
        assert (d / f).is_file(), f
    assert not [p for p in d.parent.iterdir() if p.name.startswith(".")], "temp dirs left over"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg == CONFIGS[arch]
    assert cfg["vocab_size"] == 512 and cfg["max_position_embeddings"] <= 512


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_and_runs(models: dict[str, Path], arch: str) -> None:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        models[arch], dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == CONFIGS[arch]["architectures"][0]
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    n = CONFIGS[arch]["num_hidden_layers"]
    # only GLM's MTP layer is foreign to transformers (it has no MTP module)
    unexpected = sorted(info["unexpected_keys"])
    if arch == "glm4_moe":
        assert unexpected and all(k.startswith(f"model.layers.{n}.") for k in unexpected)
    else:
        assert not unexpected, unexpected
    ids = torch.tensor([[1, 17, 100, 311, 5, 42, 511, 7]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 8, 512)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1  # not degenerate


@pytest.mark.parametrize("arch", ARCHS)
def test_moet_quant_reads_experts(models: dict[str, Path], arch: str) -> None:
    ck = open_checkpoint(models[arch])
    try:
        info = ck.info
        exp = EXPECTED[arch]
        assert info.architecture == CONFIGS[arch]["architectures"][0]
        assert info.source_format == "bf16"
        assert info.n_experts == exp["n_experts"]
        assert info.top_k == exp["top_k"]
        assert info.moe_layers == exp["moe_layers"]
        assert info.mtp_layers == exp["mtp_layers"]
        assert info.hidden_size % 32 == 0 and info.moe_intermediate_size % 32 == 0
        assert info.n_projections == 3 * exp["n_experts"] * len(exp["moe_layers"])
        assert info.ckpt_id
        # one projection decodes to the bf16 values the file holds
        src = ck.sources[0]
        w = src.dequant()
        assert w.shape == src.shape and float(abs(w).max()) > 0
    finally:
        ck.close()


def test_glm_mtp_tensors(models: dict[str, Path]) -> None:
    """The MTP layer carries vLLM Glm4MoeMTP's own tensors plus a full MoE decoder layer."""
    from safetensors import safe_open

    n = CONFIGS["glm4_moe"]["num_hidden_layers"]
    h, v = CONFIGS["glm4_moe"]["hidden_size"], CONFIGS["glm4_moe"]["vocab_size"]
    with safe_open(models["glm4_moe"] / "model.safetensors", "pt") as f:
        names = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in names}
        n_ = f"model.layers.{n}."
        assert torch.equal(
            f.get_tensor(n_ + "shared_head.head.weight"), f.get_tensor("lm_head.weight")
        )
    p = f"model.layers.{n}."
    for extra in MTP_EXTRA:
        assert p + extra in names
    assert shapes[p + "eh_proj.weight"] == (h, 2 * h)
    assert shapes[p + "shared_head.head.weight"] == (v, h)
    # the decoder block of the MTP layer has the same tensors as MoE layer n-1
    block = {k[len(p) :] for k in names if k.startswith(p)} - set(MTP_EXTRA)
    last = {
        k[len(f"model.layers.{n - 1}.") :] for k in names if k.startswith(f"model.layers.{n - 1}.")
    }
    assert block == last
    assert not any(k.startswith(f"model.layers.{n + 1}.") for k in names)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips(models: dict[str, Path], arch: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models[arch])
    assert len(tok) <= CONFIGS[arch]["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        CONFIGS[arch]["bos_token_id"],
        CONFIGS[arch]["eos_token_id"],
        CONFIGS[arch]["pad_token_id"],
    )
    ids = tok(TEXT)["input_ids"]
    assert max(ids) < CONFIGS[arch]["vocab_size"]
    assert tok.decode(ids) == TEXT
    assert len(tok("The quick brown fox")["input_ids"]) < len("The quick brown fox")  # merges
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    if arch == "glm4_moe":  # GLM-4.5's format: the model opens <think> itself
        assert chat == "[gMASK]<sop><|user|>\nhi<|assistant|>"
    else:
        assert chat == "<|user|>\nhi\n<|assistant|>\n"
    assert tok.convert_tokens_to_ids("<|assistant|>") in tok(chat)["input_ids"]


@pytest.mark.parametrize("arch", ARCHS)
def test_special_tokens_are_single_ids(models: dict[str, Path], arch: str) -> None:
    """GLM's chat and tool-call markup (what vLLM's glm45 parsers look up by id) is one token
    each, encodes as that token inside text, and decodes back unless special tokens are skipped."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models[arch])
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(t) == i, t
        assert tok.get_vocab()[t] == i
    glm = "<|assistant|>\n<think>hm</think><tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value>"
    ids = tok(glm + "</tool_call>")["input_ids"]
    markup = [i for i in ids if i < len(SPECIAL_TOKENS)]
    assert tok.convert_ids_to_tokens(markup) == [
        "<|assistant|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "</tool_call>",
    ]
    assert tok.decode(ids) == glm + "</tool_call>"
    assert tok.decode(ids, skip_special_tokens=True) == "\nhmfkv"


GLM_TOOLS = [WEATHER_TOOL]  # the tool of the round trips (tiny_models.py)


def test_glm_chat_template_renders_tools_calls_and_results(models: dict[str, Path]) -> None:
    """GLM-4.5's format: tools as JSON lines in a system block, assistant tool calls as
    <tool_call>NAME + <arg_key>/<arg_value> pairs (strings verbatim, others JSON), tool results
    after one <|observation|>, reasoning in <think>, and the thinking switch."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["glm4_moe"])
    call = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Use the tool.",
            "tool_calls": [{"id": "c1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "wind 3 m/s"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    chat = tok.apply_chat_template(
        messages, tools=GLM_TOOLS, tokenize=False, add_generation_prompt=True
    )
    tools_json = json.dumps(GLM_TOOLS[0]["function"])
    assert chat.startswith("[gMASK]<sop><|system|>\n# Tools\n")
    assert f"<tools>\n{tools_json}\n</tools>" in chat
    assert chat.endswith(
        "<|system|>\nBe brief."
        "<|user|>\nWeather in Paris?"
        "<|assistant|>\n<think>Use the tool.</think>"
        "\n<tool_call>get_weather"
        "\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>"
        "\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>"
        "\n</tool_call>"
        "<|observation|>\n<tool_response>\nsunny, 21 C\n</tool_response>"
        "\n<tool_response>\nwind 3 m/s\n</tool_response>"
        "<|assistant|>\n<think></think>\nSunny."
        "<|user|>\nThanks"
        "<|assistant|>"
    )
    ids = tok(chat)["input_ids"]
    assert tok.decode(ids) == chat
    for t in ("<|observation|>", "<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>"):
        assert tok.convert_tokens_to_ids(t) in ids, t
    # no tools: no tool block; thinking off: /nothink and an empty, closed think block
    off = tok.apply_chat_template(
        messages[1:2], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert off == "[gMASK]<sop><|user|>\nWeather in Paris?/nothink<|assistant|>\n<think></think>"


def test_rewrite_is_byte_identical(models: dict[str, Path], tmp_path: Path) -> None:
    for arch in ARCHS:
        again = write_tiny_model(arch, tmp_path / arch, seed=0)
        for f in FILES:
            assert (again / f).read_bytes() == (models[arch] / f).read_bytes(), (arch, f)
    other = write_tiny_model("mixtral", tmp_path / "mixtral-seed1", seed=1)
    a = (other / "model.safetensors").read_bytes()
    assert a != (models["mixtral"] / "model.safetensors").read_bytes()
    assert len(a) == (models["mixtral"] / "model.safetensors").stat().st_size


def test_idempotent_and_replaces_stale(tmp_path: Path) -> None:
    d = write_tiny_model("mixtral", tmp_path / "m", seed=0)
    st = (d / "model.safetensors").stat()
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, 1))
    assert write_tiny_model("mixtral", d, seed=0) == d
    assert (d / "model.safetensors").stat().st_mtime_ns == 1  # skipped: not rewritten
    # another seed in the same directory: rewritten, marker updated
    write_tiny_model("mixtral", d, seed=3)
    assert json.loads((d / MARKER).read_text())["seed"] == 3
    assert (d / "model.safetensors").stat().st_mtime_ns != 1
    # a directory without the marker (e.g. an interrupted copy) is not trusted
    (d / MARKER).unlink()
    (d / "model.safetensors").write_bytes(b"truncated")
    write_tiny_model("mixtral", d, seed=3)
    assert (d / "model.safetensors").stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp dirs left
    with pytest.raises(ValueError, match="unknown arch"):
        write_tiny_model("llama", tmp_path / "x")
