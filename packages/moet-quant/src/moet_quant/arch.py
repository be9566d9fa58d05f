"""Where each supported MoE architecture keeps its routed experts, and how to split them.

Every layout is reduced to one form: one expert's one projection as a logical [N, K] tensor
(K = contraction dim): gate and up are [I, H], down is [H, I]. Layouts:

* per-expert  `<moe>.experts.<e>.<gate_proj|up_proj|down_proj>.<weight...>` (Qwen3-MoE, GLM-4.x/5,
  DeepSeek-V3/V4, Kimi-K2) or `.<w1|w3|w2>` (Mixtral; DeepSeek's reference naming): w1 = gate,
  w3 = up, w2 = down;
* fused       `<moe>.experts.gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I]
  (transformers' fused-experts layout);
* gpt-oss     `<moe>.experts.gate_up_proj` [E, H, 2I] with gate/up interleaved along the last dim
  and `down_proj` [E, I, H] (both K-major), or MXFP4 `*_blocks` [E, N, K/32, 16] + `*_scales`
  [E, N, K/32] with interleaved gate/up rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import CheckpointError

PROJECTIONS = ("gate", "up", "down")
_PROJ_NAMES = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    experts_key: tuple[str, ...]  # config keys for the routed expert count, first present wins
    intermediate_key: tuple[str, ...]
    fused_layout: str  # how a fused gate_up tensor is laid out: "concat" or "gptoss"
    # the per-expert projection names (gate, up, down) a moet checkpoint of the family writes:
    # the ones the family's own checkpoints use, which every vLLM version's loader maps
    # (vLLM 0.24's Mixtral loads only w1/w3/w2)
    projection_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


FAMILIES = (
    Family(
        "glm",
        ("Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM", "Glm4MoeMTPModel"),
        ("n_routed_experts",),
        ("moe_intermediate_size",),
        "concat",
    ),
    Family(
        "deepseek",
        (
            "DeepseekV3ForCausalLM",
            "DeepseekV32ForCausalLM",
            "DeepseekV4ForCausalLM",
            "DeepseekV2ForCausalLM",
        ),
        ("n_routed_experts",),
        ("moe_intermediate_size",),
        "concat",
    ),
    Family(
        "kimi", ("KimiK2ForCausalLM",), ("n_routed_experts",), ("moe_intermediate_size",), "concat"
    ),
    # transformers >= 5 saves Qwen3-MoE's `num_experts` as `num_local_experts` (attribute_map)
    Family(
        "qwen3-moe",
        ("Qwen3MoeForCausalLM",),
        ("num_experts", "num_local_experts"),
        ("moe_intermediate_size",),
        "concat",
    ),
    Family(
        "mixtral",
        ("MixtralForCausalLM",),
        ("num_local_experts",),
        ("intermediate_size",),
        "concat",
        ("w1", "w3", "w2"),
    ),
    Family(
        "gpt-oss",
        ("GptOssForCausalLM",),
        ("num_local_experts", "num_experts"),
        ("intermediate_size",),
        "gptoss",
    ),
)


def supported_architectures() -> list[str]:
    return [a for f in FAMILIES for a in f.architectures]


def family_for(config: dict, where: str) -> Family:
    archs = config.get("architectures") or []
    for f in FAMILIES:
        if any(a in f.architectures for a in archs):
            return f
    raise CheckpointError(
        f"{where}: architecture {archs or config.get('model_type')!r} is not a "
        f"supported MoE; supported: {', '.join(supported_architectures())}"
    )


def config_int(config: dict, keys: tuple[str, ...], where: str) -> int:
    for k in keys:
        if isinstance(config.get(k), int):
            return int(config[k])
    raise CheckpointError(
        f"{where}: config.json lacks {' or '.join(keys)}; it is required to read the experts"
    )


# `<moe prefix>.experts.<e>.<proj>.<suffix>` and `<moe prefix>.experts.<fused>[_blocks|_scales]`
PER_EXPERT = re.compile(
    r"^(?P<moe>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe|ffn))\.experts\."
    r"(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<suffix>\w+)$"
)
FUSED = re.compile(
    r"^(?P<moe>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe|ffn))\.experts\."
    r"(?P<proj>gate_up_proj|down_proj)(?P<suffix>_blocks|_scales|_bias|_weight_scale\w*|)$"
)


@dataclass(frozen=True)
class ExpertKey:
    layer: int  # the model's layer index (an MTP layer has index >= num_hidden_layers)
    expert: int
    proj: str  # gate | up | down


def classify(name: str) -> tuple[ExpertKey | None, str | None, dict]:
    """-> (key, suffix, match info) for a per-expert tensor, (None, suffix, info) for a fused one,
    (None, None, {}) for anything else."""
    m = PER_EXPERT.match(name)
    if m:
        key = ExpertKey(int(m["layer"]), int(m["expert"]), _PROJ_NAMES[m["proj"]])
        return key, m["suffix"], {"base": name[: -len(m["suffix"]) - 1], "moe": m["moe"]}
    m = FUSED.match(name)
    if m:
        return (
            None,
            m["suffix"],
            {
                "fused": m["proj"],
                "layer": int(m["layer"]),
                "moe": m["moe"],
                "base": f"{m['moe']}.experts.{m['proj']}",
            },
        )
    return None, None, {}
