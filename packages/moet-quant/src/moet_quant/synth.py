"""Seeded synthetic MoE checkpoints in every supported family, layout and source format.

They are real safetensors checkpoints with real tensor names (what the readers see), filled with
seeded random weights; tests, benchmarks and the main job use them until the trained fixture model
exists. The FP8/NVFP4/MXFP4/INT4 encoders here are plain round-to-nearest producers of test data;
nvidia-modelopt's exports are the independent reference in the tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .numerics import E2M1_MAGNITUDES, E4M3_MAGNITUDES, f64_to_bf16_bits, pack_nibbles
from .safetensors_io import OutTensor, write_safetensors

FAMILY_CONFIGS = {
    "qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "experts_key": "num_experts",
        "inter_key": "moe_intermediate_size",
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "experts_key": "num_local_experts",
        "inter_key": "intermediate_size",
    },
    "glm": {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "experts_key": "n_routed_experts",
        "inter_key": "moe_intermediate_size",
    },
    "deepseek": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "experts_key": "n_routed_experts",
        "inter_key": "moe_intermediate_size",
    },
    "gpt-oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "experts_key": "num_local_experts",
        "inter_key": "intermediate_size",
    },
}
FORMATS = (
    "bf16",
    "fp16",
    "fp32",
    "fp8-block",
    "fp8-pb-wo",
    "fp8-channel",
    "nvfp4",
    "mxfp4",
    "int4-pack",
)


# --- round-to-nearest encoders (test data producers) --------------------------------------------


def _nearest(table: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of an ascending table (ties to the lower)."""
    i = np.clip(np.searchsorted(table, x), 1, table.size - 1)
    lo, hi = table[i - 1], table[i]
    return np.where(x - lo <= hi - x, i - 1, i)


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    mags = E4M3_MAGNITUDES[:0x7F]
    code = _nearest(mags, np.minimum(np.abs(x), mags[-1])).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 7)


def encode_e2m1(x: np.ndarray) -> np.ndarray:
    code = _nearest(E2M1_MAGNITUDES, np.minimum(np.abs(x), 6.0)).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 3)


def fp8_block(w: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    pad = np.zeros((nb * block, kb * block))
    pad[:n, :k] = w
    amax = np.abs(pad.reshape(nb, block, kb, block)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32).astype(np.float64)
    full = np.repeat(np.repeat(scale, block, 0), block, 1)[:n, :k]
    return encode_e4m3(w / full), scale.astype(np.float32)


def fp8_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 with one fp32 scale per output row, [N, 1] (llm-compressor's `channel` strategy)."""
    amax = np.abs(w).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    return encode_e4m3(w / scale.astype(np.float64)), scale


def nvfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, k = w.shape
    scale_2 = max(np.abs(w).max() / (6.0 * 448.0), 1e-12)
    amax = np.abs(w.reshape(n, k // 16, 16)).max(-1)
    s1 = encode_e4m3(amax / 6.0 / scale_2)
    s = E4M3_MAGNITUDES[s1 & 0x7F] * scale_2
    full = np.repeat(np.where(s > 0, s, 1.0), 16, axis=1)
    return pack_nibbles(encode_e2m1(w / full)), s1, np.array(scale_2, dtype=np.float32)


def mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n, k = w.shape
    amax = np.abs(w.reshape(n, k // 32, 32)).max(-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127)
    e = np.clip(e, -127, 127)
    full = np.repeat(np.exp2(e), 32, axis=1)
    return pack_nibbles(encode_e2m1(w / full)), (e + 127).astype(np.uint8)


def int4_pack(w: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    n, k = w.shape
    amax = np.abs(w.reshape(n, k // group, group)).max(-1)
    scale_bits = f64_to_bf16_bits(np.where(amax > 0, amax / 7.0, 1.0))
    scale = (scale_bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    q = np.clip(np.rint(w / np.repeat(scale, group, axis=1)), -8, 7).astype(np.int64) + 8
    q = q.reshape(n, k // 8, 8).astype(np.uint32)
    packed = np.zeros((n, k // 8), dtype=np.uint32)
    for i in range(8):
        packed |= q[:, :, i] << (4 * i)
    return packed.view(np.int32), scale_bits


# --- checkpoints --------------------------------------------------------------------------------


def projection_tensors(prefix: str, w: np.ndarray, fmt: str) -> list[tuple[str, str, np.ndarray]]:
    """(name, dtype, array) for one per-expert projection stored in `fmt`."""
    if fmt == "bf16":
        return [(f"{prefix}.weight", "BF16", f64_to_bf16_bits(w))]
    if fmt == "fp16":
        return [(f"{prefix}.weight", "F16", w.astype(np.float16))]
    if fmt == "fp32":
        return [(f"{prefix}.weight", "F32", w.astype(np.float32))]
    if fmt == "fp8-block":
        q, s = fp8_block(w)
        return [(f"{prefix}.weight", "F8_E4M3", q), (f"{prefix}.weight_scale_inv", "F32", s)]
    if fmt == "fp8-pb-wo":
        q, s = fp8_block(w)
        return [
            (f"{prefix}.weight", "F8_E4M3", q),
            (f"{prefix}.weight_scale", "F32", s.reshape(s.shape[0], 1, s.shape[1], 1)),
        ]
    if fmt == "fp8-channel":
        q, s = fp8_channel(w)
        return [(f"{prefix}.weight", "F8_E4M3", q), (f"{prefix}.weight_scale", "F32", s)]
    if fmt == "nvfp4":
        q, s1, s2 = nvfp4(w)
        return [
            (f"{prefix}.weight", "U8", q),
            (f"{prefix}.weight_scale", "F8_E4M3", s1),
            (f"{prefix}.weight_scale_2", "F32", s2),
            (f"{prefix}.input_scale", "F32", np.array(1.0, dtype=np.float32)),
        ]
    if fmt == "int4-pack":
        q, s = int4_pack(w)
        return [
            (f"{prefix}.weight_packed", "I32", q),
            (f"{prefix}.weight_scale", "BF16", s),
            (f"{prefix}.weight_shape", "I64", np.array(w.shape, dtype=np.int64)),
        ]
    raise ValueError(f"format {fmt!r} has no per-expert layout here")


def quantization_config(fmt: str) -> dict | None:
    """The `quantization_config` a checkpoint in source format `fmt` carries (None: unquantized)."""
    if fmt == "fp8-block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    if fmt == "int4-pack":
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": 32,
                        "dynamic": False,
                        "actorder": None,
                    },
                    "input_activations": None,
                    "output_activations": None,
                }
            },
        }
    if fmt == "fp8-channel":  # zai-org/GLM-4.5-Air-FP8's scheme (llm-compressor FP8 dynamic)
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "symmetric": True,
                        "strategy": "channel",
                        "dynamic": False,
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "symmetric": True,
                        "strategy": "token",
                        "dynamic": True,
                    },
                    "output_activations": None,
                }
            },
        }
    if fmt in ("nvfp4", "fp8-pb-wo"):
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4" if fmt == "nvfp4" else "FP8_PB_WO",
        }
    if fmt == "mxfp4":
        return {"quant_method": "mxfp4"}
    return None


def write_checkpoint(
    out: str | Path,
    family: str = "qwen3-moe",
    fmt: str = "bf16",
    n_layers: int = 2,
    n_experts: int = 8,
    hidden: int = 64,
    inter: int = 32,
    top_k: int = 2,
    seed: int = 0,
    shards: int = 2,
    fused: bool = False,
    zero_fraction: float = 0.0,
    std: float = 0.02,
) -> Path:
    """Write a synthetic MoE checkpoint; returns its directory.

    `fused` stores experts as transformers' fused [E, 2I, H] / [E, H, I] tensors (bf16 only);
    gpt-oss always uses its own fused layout (bf16, or MXFP4 when fmt == "mxfp4").
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fc = FAMILY_CONFIGS[family]
    rng = np.random.default_rng(seed)
    tensors: list[tuple[str, str, np.ndarray]] = []

    def weight(n: int, k: int) -> np.ndarray:
        w = rng.standard_normal((n, k)) * std
        if zero_fraction:
            w[rng.random((n, k)) < zero_fraction] = 0.0
        return w

    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    tensors.append(("model.embed_tokens.weight", "BF16", f64_to_bf16_bits(weight(128, hidden))))
    for layer in range(n_layers):
        p = f"model.layers.{layer}"
        tensors.append((f"{p}.input_layernorm.weight", "BF16", f64_to_bf16_bits(np.ones(hidden))))
        tensors.append(
            (f"{p}.self_attn.q_proj.weight", "BF16", f64_to_bf16_bits(weight(hidden, hidden)))
        )
        tensors.append(
            (f"{p}.{moe}.gate.weight", "BF16", f64_to_bf16_bits(weight(n_experts, hidden)))
        )
        if family == "gpt-oss" or fused:
            gu = np.stack(
                [
                    np.concatenate([weight(inter, hidden), weight(inter, hidden)])
                    for _ in range(n_experts)
                ]
            )  # [E, 2I, H], gate rows first
            dn = np.stack([weight(hidden, inter) for _ in range(n_experts)])  # [E, H, I]
            base = f"{p}.{moe}.experts"
            if family == "gpt-oss":
                inter_rows = np.empty_like(gu)  # interleave gate/up rows
                inter_rows[:, 0::2], inter_rows[:, 1::2] = gu[:, :inter], gu[:, inter:]
                if fmt == "mxfp4":
                    for nm, x in (("gate_up_proj", inter_rows), ("down_proj", dn)):
                        pairs = [mxfp4(x[e]) for e in range(n_experts)]
                        blocks = np.stack([b for b, _ in pairs])
                        tensors.append(
                            (
                                f"{base}.{nm}_blocks",
                                "U8",
                                blocks.reshape(n_experts, x.shape[1], -1, 16),
                            )
                        )
                        tensors.append(
                            (f"{base}.{nm}_scales", "U8", np.stack([s for _, s in pairs]))
                        )
                else:
                    tensors.append(
                        (
                            f"{base}.gate_up_proj",
                            "BF16",
                            f64_to_bf16_bits(inter_rows.transpose(0, 2, 1)),
                        )
                    )
                    tensors.append(
                        (f"{base}.down_proj", "BF16", f64_to_bf16_bits(dn.transpose(0, 2, 1)))
                    )
                tensors.append(
                    (
                        f"{base}.gate_up_proj_bias",
                        "BF16",
                        f64_to_bf16_bits(np.zeros((n_experts, 2 * inter))),
                    )
                )
            else:
                tensors.append((f"{base}.gate_up_proj", "BF16", f64_to_bf16_bits(gu)))
                tensors.append((f"{base}.down_proj", "BF16", f64_to_bf16_bits(dn)))
            continue
        for e in range(n_experts):
            for nm, (n, k) in zip(names, ((inter, hidden), (inter, hidden), (hidden, inter))):
                tensors.extend(projection_tensors(f"{p}.{moe}.experts.{e}.{nm}", weight(n, k), fmt))
    tensors.append(("lm_head.weight", "BF16", f64_to_bf16_bits(weight(128, hidden))))

    # shard by cumulative size, in order
    total = sum(a.nbytes for _, _, a in tensors)
    per = -(-total // shards)
    groups: list[list[tuple[str, str, np.ndarray]]] = [[]]
    acc = 0
    for t in tensors:
        if acc >= per and len(groups) < shards:
            groups.append([])
            acc = 0
        groups[-1].append(t)
        acc += t[2].nbytes
    weight_map = {}
    for i, grp in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        metas = [OutTensor(n, d, tuple(a.shape)) for n, d, a in grp]
        write_safetensors(out / fname, metas, (a for _, _, a in grp), {"format": "pt"})
        weight_map.update({n: fname for n, _, _ in grp})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    config = {
        "architectures": fc["architectures"],
        "model_type": fc["model_type"],
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        fc["experts_key"]: n_experts,
        fc["inter_key"]: inter,
        "num_experts_per_tok": top_k,
        "vocab_size": 128,
        "torch_dtype": "bfloat16",
    }
    qc = quantization_config(fmt)
    if qc is not None:
        config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    return out
