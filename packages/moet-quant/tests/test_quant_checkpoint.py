"""Checkpoint scanning: every family and layout, geometry checks, identity, clear errors."""

import json
import os

import numpy as np
import pytest

from moet_quant import checkpoint, numerics, synth
from moet_quant.arch import supported_architectures
from moet_quant.errors import CheckpointError
from moet_quant.safetensors_io import OutTensor, write_safetensors

CASES = [
    ("qwen3-moe", "bf16", False),
    ("qwen3-moe", "bf16", True),
    ("mixtral", "fp16", False),
    ("glm", "fp8-block", False),
    ("deepseek", "fp8-pb-wo", False),
    ("glm", "fp8-channel", False),
    ("qwen3-moe", "nvfp4", False),
    ("gpt-oss", "mxfp4", False),
    ("gpt-oss", "bf16", False),
    ("deepseek", "int4-pack", False),
    ("mixtral", "fp32", False),
]


@pytest.mark.parametrize("family, fmt, fused", CASES)
def test_scan_every_family_and_format(make_ckpt, family, fmt, fused):
    d = make_ckpt(family, fmt, fused=fused, n_layers=3, n_experts=4, hidden=64, inter=32)
    ck = checkpoint.open_checkpoint(d)
    i = ck.info
    assert i.source_format == fmt and i.n_experts == 4 and i.top_k == 2
    assert (i.hidden_size, i.moe_intermediate_size) == (64, 32)
    assert i.moe_layers == [0, 1, 2] and i.n_projections == 3 * 4 * 3
    assert i.bytes["w2"] == 3 * 4 * 3 * (64 * 32 // 4 + 64 * 32 // 32)
    assert (i.bytes["fp4x"] > 0) == (fmt in ("nvfp4", "mxfp4"))
    names = {s.name for s in ck.sources}
    moe, down = ("block_sparse_moe", "w2") if family == "mixtral" else ("mlp", "down_proj")
    assert f"model.layers.2.{moe}.experts.3.{down}" in names  # the family's own names
    for s in ck.sources:
        assert s.dequant().shape == s.shape


def test_gpt_oss_and_fused_layouts_split_to_the_original_matrices(tmp_path):
    """gate/up interleaving and K-major storage undone: each projection is the matrix written."""
    e_, h, i = 2, 64, 32
    rng = np.random.default_rng(0)
    gate, up, down = (
        rng.standard_normal((e_, i, h)),
        rng.standard_normal((e_, i, h)),
        rng.standard_normal((e_, h, i)),
    )
    gu = np.empty((e_, 2 * i, h))
    gu[:, 0::2], gu[:, 1::2] = gate, up
    d = tmp_path / "oss"
    d.mkdir()
    ts = {
        "model.layers.0.mlp.experts.gate_up_proj": gu.transpose(0, 2, 1),
        "model.layers.0.mlp.experts.down_proj": down.transpose(0, 2, 1),
    }
    write_safetensors(
        d / "model.safetensors",
        [OutTensor(n, "F32", a.shape) for n, a in ts.items()],
        (a.astype(np.float32) for a in ts.values()),
    )
    (d / "config.json").write_text(
        json.dumps(
            {"architectures": ["GptOssForCausalLM"], "num_local_experts": 2, "num_hidden_layers": 1}
        )
    )
    ck = checkpoint.open_checkpoint(d)
    by = {(s.key.expert, s.key.proj): s for s in ck.sources}
    for e in range(e_):
        for proj, ref in (("gate", gate), ("up", up), ("down", down)):
            assert np.array_equal(by[(e, proj)].dequant(), ref[e].astype(np.float32))


def test_identity_is_stable_and_tracks_changes(make_ckpt):
    d = make_ckpt()
    a = checkpoint.open_checkpoint(d).info.ckpt_id
    assert a == checkpoint.open_checkpoint(d).info.ckpt_id and len(a) == 16
    assert checkpoint.ckpt_id(checkpoint.checkpoint_identity(d, revision="v2")) != a
    shard = sorted(d.glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    assert checkpoint.open_checkpoint(d).info.ckpt_id != a
    assert checkpoint.checkpoint_identity(d / "nope") is None


def test_unsupported_architecture_lists_supported(make_ckpt):
    d = make_ckpt()
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="LlamaForCausalLM.*Qwen3MoeForCausalLM") as e:
        checkpoint.open_checkpoint(d)
    assert all(a in str(e.value) for a in supported_architectures())


def test_missing_expert_is_named(make_ckpt, tmp_path):
    d = make_ckpt(n_experts=4)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_experts"] = 5
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="layer 0 expert 4 has no gate projection"):
        checkpoint.open_checkpoint(d)


def test_unsupported_expert_format_is_named(tmp_path):
    d = tmp_path / "gptq"
    d.mkdir()
    p = "model.layers.0.mlp.experts.0.gate_proj"
    ts = {f"{p}.qweight": np.zeros((4, 8), np.int32), f"{p}.scales": np.zeros((1, 8), np.float32)}
    write_safetensors(
        d / "model.safetensors",
        [OutTensor(n, "I32" if a.dtype == np.int32 else "F32", a.shape) for n, a in ts.items()],
        iter(ts.values()),
    )
    (d / "config.json").write_text(
        json.dumps({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 1})
    )
    with pytest.raises(
        CheckpointError,
        match=r"experts.0.gate_proj has an unsupported format "
        r"\(qweight I32\[4, 8\].*supported formats",
    ):
        checkpoint.open_checkpoint(d)


def test_shape_mismatch_between_experts(make_ckpt):
    d = synth.write_checkpoint(make_ckpt().parent / "x", n_experts=2, hidden=64, inter=32, shards=1)
    f = d / "model-00001-of-00001.safetensors"
    from moet_quant.safetensors_io import SafetensorsFile

    src = SafetensorsFile(f)
    names = sorted(src.tensors, key=lambda n: src.tensors[n].offset)
    metas, arrays = [], []
    for n in names:
        a = np.array(src.array(n))
        if n == "model.layers.1.mlp.experts.1.up_proj.weight":
            a = a[:, :32]
        metas.append(OutTensor(n, src.tensors[n].dtype, a.shape))
        arrays.append(a)
    write_safetensors(f, metas, iter(arrays))
    with pytest.raises(
        CheckpointError, match=r"up projection of expert 1 is \[32, 32\], expected \[32, 64\]"
    ):
        checkpoint.open_checkpoint(d)


def test_already_moet_is_refused(make_ckpt):
    d = make_ckpt()
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "moet"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="already a moet checkpoint"):
        checkpoint.open_checkpoint(d)


def test_nan_weight_in_checkpoint_named_at_quantization(make_ckpt):
    from moet_quant import w2
    from moet_quant.errors import FormatError

    d = make_ckpt(shards=1)
    f = next(d.glob("*.safetensors"))
    raw = bytearray(f.read_bytes())
    ck = checkpoint.open_checkpoint(d)
    info = ck.st.info("model.layers.1.mlp.experts.2.up_proj.weight")
    ck.close()
    raw[info.offset + 2 * 70 : info.offset + 2 * 71] = numerics.np.uint16(0x7FC0).tobytes()
    f.write_bytes(bytes(raw))
    src = next(
        s
        for s in checkpoint.open_checkpoint(d).sources
        if s.name.endswith("2.up_proj") and s.key.layer == 1
    )
    with pytest.raises(FormatError, match=r"experts.2.up_proj.*NaN/Inf.*\[1, 6\]"):
        w2.quantize(src.load())
