"""nvidia-modelopt as the independent reference for the NVFP4 and FP8-blockwise readers.

modelopt quantizes a tiny seeded Qwen3-MoE and exports it with `export_hf_checkpoint`
(modelopt_export.py); moet_quant reads the export with `open_checkpoint`, and every routed expert
projection's exact float64 dequantization is compared with modelopt's own `QTensor.dequantize`
of the same exported tensors:

* float64: modelopt's dequantize evaluated in float64 (inputs upcast exactly) computes the exact
  value (every product fits 53 bits). Ours must equal it exactly, element for element (compared
  as values: modelopt's e2m1 table maps nibble 0x8 to +0.0, ours keeps the sign bit as -0.0).
* float32, modelopt's native arithmetic:
  - FP8 (`fl32(e4m3 * scale)`, one rounding): ours rounded to float32 equals it bit for bit, so
    |ours - theirs| <= half an ulp of float32 and rounding is the only difference.
  - NVFP4 rounds twice, `fl32(e2m1 * fl32(weight_scale * weight_scale_2))`: the same two roundings
    applied to our decoded (e2m1 magnitude, combined scale) equal it bit for bit, and it lies within
    those two roundings (relative 2**-24 each) of our exact value; the correctly rounded exact value
    can differ from it by one ulp, which is modelopt's double rounding, not a reader difference.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("modelopt.torch.quantization")
pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import modelopt_export as mx  # noqa: E402  (tests/ helper, after the skips)

from moet_quant import formats  # noqa: E402
from moet_quant.checkpoint import open_checkpoint  # noqa: E402

U32 = 2.0**-24  # float32 unit roundoff


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("modelopt")
    return {fmt: mx.quantize_and_export(fmt, root / fmt) for fmt in mx.FORMATS}


def _weight_base(src) -> str:
    (w,) = [t for t in src.tensors if t.endswith(".weight")]
    return w[: -len(".weight")]


@pytest.mark.parametrize("fmt", list(mx.FORMATS))
def test_modelopt_export_is_read_exactly(exports, fmt):
    d = exports[fmt]
    assert mx.detect_format(d) == fmt
    ck = open_checkpoint(d)
    try:
        info = ck.info
        assert info.source_format == fmt
        assert info.family == "qwen3-moe" and info.n_experts == mx.N_EXPERTS
        assert info.moe_layers == list(range(mx.N_LAYERS))
        assert info.n_projections == mx.N_LAYERS * mx.N_EXPERTS * 3
        assert info.dense_quantization["quant_method"] == "modelopt"
        dims = (
            (mx.FP8_HIDDEN, mx.FP8_MOE_INTER) if fmt == "fp8-pb-wo" else (mx.HIDDEN, mx.MOE_INTER)
        )
        assert (info.hidden_size, info.moe_intermediate_size) == dims

        theirs = mx.expert_tensors(d)
        assert set(theirs) == {_weight_base(s) for s in ck.sources}
        for src in ck.sources:
            name = _weight_base(src)
            assert src.fmt == fmt, name
            ours = src.dequant()  # exact, float64
            assert ours.dtype == np.float64 and ours.shape == src.shape, name

            ref64 = mx.modelopt_dequant(fmt, theirs[name], torch.float64)
            assert ref64.shape == ours.shape, name
            bad = ours != ref64
            assert not bad.any(), (
                f"{name}: {int(bad.sum())} of {bad.size} elements differ from "
                f"modelopt's float64 dequantization, first at "
                f"{np.argwhere(bad)[0].tolist()}"
            )

            ref32 = mx.modelopt_dequant(fmt, theirs[name], torch.float32)
            assert ref32.dtype == np.float32, name
            if fmt == "fp8-pb-wo":
                assert np.array_equal(ours.astype(np.float32), ref32), name
                half_ulp = np.spacing(np.abs(ref32)).astype(np.float64) / 2
                assert (np.abs(ours - ref32) <= half_ulp).all(), name
            else:
                enc = src.load()
                assert isinstance(enc, formats.Encoded)
                scale32 = np.repeat(enc.scale.astype(np.float32), enc.group, axis=1)
                mag32 = (enc.table[enc.mag] * scale32.astype(np.float64)).astype(np.float32)
                assert np.array_equal(np.where(enc.neg, -mag32, mag32), ref32), name
                err = np.abs(ref32.astype(np.float64) - ours)
                assert (err <= np.abs(ours) * (2 * U32 + U32 * U32)).all(), name
    finally:
        ck.close()


def test_modelopt_fp8_export_has_partial_and_multiple_blocks(exports):
    """The FP8 export exercises block indexing: >1 block per projection, partial edge blocks."""
    ck = open_checkpoint(exports["fp8-pb-wo"])
    try:
        shapes = {
            s.key.proj: (s.shape, ck.st.info(f"{_weight_base(s)}.weight_scale").shape)
            for s in ck.sources[:3]
        }
    finally:
        ck.close()
    (n, k), sshape = shapes["gate"]
    assert sshape == (-(-n // 128), 1, -(-k // 128), 1) and k % 128 and sshape[2] > 1
    (n, k), sshape = shapes["down"]
    assert sshape == (-(-n // 128), 1, -(-k // 128), 1) and n % 128 and sshape[0] > 1
