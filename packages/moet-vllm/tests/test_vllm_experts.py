"""Expert sources: official (re-quantized at load) and moet checkpoints give the same sections;
tensor-parallel shards tile the whole."""

import numpy as np
import pytest

from moet_quant import convert, synth, w2
from moet_quant.errors import MoetError
from moet_vllm.compat import MoetVllmError
from moet_vllm.config import resolve
from moet_vllm.experts import ExpertSource, MoetCheckpointSource, OfficialSource

CFG = resolve(None, None, {})


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block", "nvfp4"])
def test_official_and_converted_sources_agree(tmp_path, fmt):
    src = synth.write_checkpoint(
        tmp_path / "src",
        "qwen3-moe",
        fmt,
        n_layers=2,
        n_experts=4,
        hidden=128,
        inter=64,
        zero_fraction=0.05,
    )
    convert.convert(src, tmp_path / "moet", progress=False)
    a = ExpertSource.open(src, CFG)
    b = ExpertSource.open(tmp_path / "moet", CFG)
    assert isinstance(a, OfficialSource) and isinstance(b, MoetCheckpointSource)
    assert (
        (a.n_experts, a.hidden, a.inter, a.moe_layers)
        == (b.n_experts, b.hidden, b.inter, b.moe_layers)
        == (4, 128, 64, [0, 1])
    )
    for layer in a.moe_layers:
        sa, sb = a.layer(layer), b.layer(layer)
        for k in sa:
            assert np.array_equal(sa[k], sb[k]), k
        # the sections are the W2 of the source: expert 2's up projection, checked directly
        up = next(s for s in a.ck.sources if s.key == type(s.key)(layer, 2, "up"))
        ref = w2.quantize_f64(up.dequant())
        assert np.array_equal(sa["w13_codes"][2, 64:], ref.codes)
        assert np.array_equal(sa["w13_scales"][2, 64:], ref.scales)
    a.close()
    b.close()


def test_tensor_parallel_shards_tile_the_whole(tmp_path):
    src = synth.write_checkpoint(
        tmp_path / "src", "mixtral", "bf16", n_layers=1, n_experts=2, hidden=64, inter=128
    )
    whole = ExpertSource.open(src, CFG).layer(0)
    parts = [ExpertSource.open(src, CFG, tp_rank=r, tp_size=2).layer(0) for r in range(2)]
    i = 128 // 2
    for r, p in enumerate(parts):
        gate, up = whole["w13_codes"][:, :128], whole["w13_codes"][:, 128:]
        assert np.array_equal(p["w13_codes"][:, :i], gate[:, r * i : (r + 1) * i])
        assert np.array_equal(p["w13_codes"][:, i:], up[:, r * i : (r + 1) * i])
        assert np.array_equal(p["w2_codes"], whole["w2_codes"][:, :, r * i // 4 : (r + 1) * i // 4])
        assert np.array_equal(
            p["w2_scales"], whole["w2_scales"][:, :, r * i // 32 : (r + 1) * i // 32]
        )
    assert ExpertSource.open(src, CFG, 0, 2).row_layout(native=False).inter == 64
    with pytest.raises(MoetVllmError, match="not a multiple of 32 per rank"):
        ExpertSource.open(src, CFG, tp_rank=0, tp_size=8).layer(0)


def test_interrupted_conversion_is_refused(tmp_path):
    src = synth.write_checkpoint(
        tmp_path / "src", n_layers=1, n_experts=2, hidden=64, inter=32, shards=2
    )
    out = tmp_path / "moet"
    convert.convert(src, out, progress=False)
    (out / ".moet-convert.json").write_text('{"complete": false, "shards": {}}')
    with pytest.raises(MoetError, match="interrupted moet conversion"):
        ExpertSource.open(out, CFG)


def test_a_named_expert_source_is_the_registered_one_or_refused(tmp_path):
    """A checkpoint's quantization_config may name its `expert_source` (experts in no file, as
    the benchmark's synthetic ones): the class registered under that name serves it; a name not
    registered is refused, naming the file, what was found and what is registered."""
    import json

    from moet_vllm import experts

    model = tmp_path / "m"
    model.mkdir()
    qc = {"quant_method": "moet", "expert_source": {"name": "test-constant", "value": 7}}
    (model / "config.json").write_text(
        json.dumps({"num_hidden_layers": 1, "quantization_config": qc})
    )
    with pytest.raises(MoetVllmError, match=r"config.json: quantization_config.expert_source .*"
                       r"'test-constant'.*registered: none"):  # fmt: skip
        ExpertSource.open(model, CFG)

    class Constant(ExpertSource):
        def __init__(self, path, cfg, tp_rank, tp_size):
            super().__init__(path, cfg, tp_rank, tp_size)
            self.value = json.loads((path / "config.json").read_text())["quantization_config"][
                "expert_source"
            ]["value"]

        def layer(self, model_layer):
            return {"w13_codes": np.full((1, 1), self.value, np.uint8)}

        def close(self):
            pass

    experts.register_source("test-constant", Constant)
    try:
        src = ExpertSource.open(model, CFG)
        assert isinstance(src, Constant) and src.layer(0)["w13_codes"][0, 0] == 7
    finally:
        experts._REGISTERED.pop("test-constant")


def test_the_fp4_tier_rows_of_an_official_source_are_fp4r_and_shard_like_w2(tmp_path):
    """fp4_layer: the fp4r nibbles and scales of every projection (the float64 dequantization
    equals moet_quant.fp4's of the source), packed in the fp4r RowLayout; tensor-parallel shards
    tile the whole as the W2 sections do; a moet checkpoint, W2 only, refuses with the way out."""
    from moet_kernels.layout import RowLayout
    from moet_quant import fp4
    from moet_quant.numerics import unpack_nibbles

    src = synth.write_checkpoint(
        tmp_path / "src", "qwen3-moe", "bf16", n_layers=1, n_experts=3, hidden=64, inter=64
    )
    a = ExpertSource.open(src, CFG)
    whole = a.fp4_layer(0)
    RowLayout(64, 64, "fp4r").pack(**whole)  # the tier's sections, shapes and values
    down = next(s for s in a.ck.sources if s.key == type(s.key)(0, 1, "down"))
    base, nibbles = fp4.fp4r(down.load())
    got = fp4.dequant_fp4r(unpack_nibbles(whole["w2_codes"][1]), whole["w2_scales"][1])
    assert np.array_equal(got, fp4.dequant_fp4r(nibbles, base.scales))
    parts = [ExpertSource.open(src, CFG, tp_rank=r, tp_size=2).fp4_layer(0) for r in range(2)]
    for name in ("w2_codes", "w2_scales"):  # down: columns of K
        assert np.array_equal(np.concatenate([p[name] for p in parts], axis=2), whole[name])
    for name in ("w13_codes", "w13_scales"):  # gate over up: rows
        halves = [np.split(p[name], 2, axis=1) for p in parts]
        gate = np.concatenate([h[0] for h in halves], axis=1)
        up = np.concatenate([h[1] for h in halves], axis=1)
        assert np.array_equal(np.concatenate([gate, up], axis=1), whole[name])
    convert.convert(src, tmp_path / "moet", progress=False)
    with pytest.raises(MoetVllmError, match="converted without .its fp4_tier is 'none'.: reconv"):
        ExpertSource.open(tmp_path / "moet", CFG).fp4_layer(0)
    # converted with the refinement planes: the same rows, rebuilt exactly, whole and per rank
    convert.convert(src, tmp_path / "moet-fp4r", convert.ConvertOptions(fp4_tier="fp4r"),
                    progress=False)  # fmt: skip
    for r, tp in ((0, 1), (0, 2), (1, 2)):
        want = ExpertSource.open(src, CFG, tp_rank=r, tp_size=tp).fp4_layer(0)
        got = ExpertSource.open(tmp_path / "moet-fp4r", CFG, tp_rank=r, tp_size=tp).fp4_layer(0)
        assert want.keys() == got.keys()
        assert all(np.array_equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("family, fmt", [("qwen3-moe", "nvfp4"), ("gpt-oss", "mxfp4")])
def test_fp4x_rows_are_the_checkpoint_own_fp4_data_byte_for_byte(tmp_path, family, fmt):
    """fp4_tier=fp4x: the FP4 rows of an NVFP4 or MXFP4 checkpoint (gpt-oss: fused [E, K, 2N]
    experts) are its own nibbles and scales (and NVFP4's global scales), verbatim, from the
    official checkpoint and from its `moet convert --fp4-tier fp4x` alike; they pack into the
    tier's logical and kernel-native rows and back unchanged."""
    import torch

    from moet_kernels.layout import NativeRowLayout, RowLayout

    src = synth.write_checkpoint(tmp_path / "src", family, fmt, n_layers=2, n_experts=4,
                                 hidden=128, inter=64)  # fmt: skip
    convert.convert(src, tmp_path / "moet", convert.ConvertOptions(fp4_tier="fp4x"),
                    progress=False)  # fmt: skip
    cfg = resolve(None, None, {"MOET_FP4_TIER": "fp4x"})
    official, moet = ExpertSource.open(src, cfg), ExpertSource.open(tmp_path / "moet", cfg)
    assert official.fp4_kind == moet.fp4_kind == f"fp4x-{fmt}"
    by_key = {(s.key.layer, s.key.expert, s.key.proj): s for s in official.ck.sources}
    for layer in official.moe_layers:
        rows, again = official.fp4_layer(layer), moet.fp4_layer(layer)
        assert rows.keys() == again.keys()
        assert all(np.array_equal(rows[k], again[k]) for k in rows)
        for e in range(4):
            down, gate = by_key[(layer, e, "down")].fp4x(), by_key[(layer, e, "gate")].fp4x()
            assert rows["w2_codes"][e].tobytes() == np.asarray(down["codes"]).tobytes()
            assert rows["w2_scales"][e].tobytes() == np.asarray(down["scales"]).tobytes()
            assert rows["w13_codes"][e][:64].tobytes() == np.asarray(gate["codes"]).tobytes()
            if fmt == "nvfp4":
                assert np.all(rows["w2_scale_2"][e] == np.float32(down["scale_2"]))
        logical = RowLayout(128, 64, official.fp4_kind)
        packed = logical.unpack(logical.pack(**rows))
        assert all(np.array_equal(packed[k], rows[k]) for k in rows)
        native = NativeRowLayout(128, 64, official.fp4_kind)
        tensors = {k: torch.from_numpy(v) for k, v in rows.items()}
        back = native.views(native.pack(**tensors)[1])
        assert all(np.array_equal(np.asarray(back[k]), rows[k][1]) for k in rows)
    with pytest.raises(MoetVllmError, match=r"has none \(experts: bf16\); use fp4_tier='fp4r'"):
        bf16 = synth.write_checkpoint(tmp_path / "bf16", "qwen3-moe", "bf16", n_layers=1,
                                      n_experts=4, hidden=128, inter=64)  # fmt: skip
        _ = ExpertSource.open(bf16, cfg).fp4_kind
