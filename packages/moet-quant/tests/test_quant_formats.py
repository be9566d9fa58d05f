"""Exact dequantizers: hand-computed cases, exhaustive code grids and bad scales."""

import numpy as np
import pytest

from moet_quant import formats, numerics, synth
from moet_quant.errors import FormatError

RNG = np.random.default_rng(7)


def test_fp8_block_partial_edge_blocks_against_a_direct_loop():
    n, k = 130, 200  # partial blocks on both edges (block 128)
    q = RNG.integers(0, 256, size=(n, k), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x10  # no NaN codes
    s = RNG.uniform(0.001, 2, size=(2, 2)).astype(np.float32)
    got = formats.from_fp8_block(q, s).dequant()
    for i in range(n):
        for j in range(0, k, 7):
            want = numerics.E4M3_VALUES[q[i, j]] * float(s[i // 128, j // 128])
            assert got[i, j] == want


def test_fp8_pb_wo_4d_scale_equals_2d_layout():
    q = RNG.integers(0, 0x7E, size=(256, 256), dtype=np.uint8)
    s = RNG.uniform(0.5, 1, size=(2, 2)).astype(np.float32)
    a = formats.from_fp8_block(q, s).dequant()
    b = formats.from_fp8_block(q, s.reshape(2, 1, 2, 1)).dequant()
    assert (a == b).all()
    with pytest.raises(
        FormatError, match=r"weight_scale has shape \[2, 2, 1, 1\].*expected \[2, 1, 2, 1\]"
    ):
        formats.from_fp8_block(q, s.reshape(2, 2, 1, 1), name="x")


@pytest.mark.parametrize(
    "bad, match", [(np.nan, "non-finite"), (np.inf, "non-finite"), (-1.0, "negative")]
)
def test_bad_fp8_scales(bad, match):
    s = np.ones((1, 1), np.float32)
    s[0, 0] = bad
    with pytest.raises(FormatError, match=f"'w.*{match}"):
        formats.from_fp8_block(np.zeros((4, 32), np.uint8), s, name="w.0")


def test_fp8_scale_shape_mismatch_names_tensor():
    with pytest.raises(FormatError, match=r"'layers.1.w'.*shape \[3, 1\].*expected \[1, 1\]"):
        formats.from_fp8_block(np.zeros((4, 32), np.uint8), np.ones((3, 1)), name="layers.1.w")


def test_nvfp4_exhaustive_nibbles_and_scales():
    # every nibble value at every position parity, every finite e4m3 scale byte, two scale_2 values
    scales = np.arange(0x7F, dtype=np.uint8)  # finite non-negative e4m3
    n = scales.size
    nib = np.tile(np.arange(16, dtype=np.uint8), (n, 1))  # [n, 16] = one block of 16
    packed = numerics.pack_nibbles(nib)
    for s2 in (1.0, 0.0078125 * 3):
        got = formats.from_nvfp4(packed, scales[:, None], np.float32(s2)).dequant()
        want = numerics.E2M1_VALUES[nib] * numerics.E4M3_MAGNITUDES[scales][:, None] * s2
        assert (got == want).all()


def test_nvfp4_per_row_scale_2_and_bad_shapes():
    packed = np.full((2, 8), 0x21, np.uint8)  # nibbles 1, 2 -> 0.5, 1.0
    sc = np.full((2, 1), 0x38, np.uint8)  # e4m3 0x38 = 1.0
    got = formats.from_nvfp4(packed, sc, np.array([2.0, 4.0], np.float32)).dequant()
    assert got[0, :2].tolist() == [1.0, 2.0] and got[1, :2].tolist() == [2.0, 4.0]
    with pytest.raises(FormatError, match="weight_scale_2 has 3 values"):
        formats.from_nvfp4(packed, sc, np.ones(3, np.float32), name="x")
    with pytest.raises(FormatError, match="NVFP4, one e4m3 scale per 16"):
        formats.from_nvfp4(packed, np.ones((2, 2), np.uint8), 1.0, name="x")


def test_mxfp4_exhaustive_and_nan_scale():
    nib = np.tile(np.arange(16, dtype=np.uint8), (255, 2))  # [255, 32]
    sc = np.arange(255, dtype=np.uint8)[:, None]
    got = formats.from_mxfp4(numerics.pack_nibbles(nib), sc).dequant()
    assert (got == numerics.E2M1_VALUES[nib] * np.exp2(sc.astype(float) - 127)).all()
    with pytest.raises(FormatError, match="255"):
        formats.from_mxfp4(numerics.pack_nibbles(nib[:1]), np.array([[255]], np.uint8), name="x")


def test_int4_pack_quantized_hand_case():
    # q = [-8 .. 7] stored offset-binary (q + 8) = 0..15, first value in the lowest bits
    word = sum(i << (4 * i) for i in range(8))  # nibbles 0..7 -> q = -8..-1
    word2 = sum((i + 8) << (4 * i) for i in range(8))  # nibbles 8..15 -> q = 0..7
    packed = np.array([[word, word2, word, word2]], dtype=np.uint32).view(np.int32)
    got = formats.from_int4_packed(packed, np.full((1, 1), 0.5)).dequant()
    want = np.array(list(range(-8, 0)) + list(range(0, 8))) * 0.5
    assert got[0, :16].tolist() == want.tolist()


def test_int4_encoder_roundtrip_exact_for_grid_values():
    w = RNG.integers(-8, 8, size=(4, 64)) * 0.25
    w[:, 0] = -8 * 0.25  # amax / 7 ... make the scale exact: use the encoder's own scale
    packed, sbits = synth.int4_pack(w)
    back = formats.from_int4_packed(packed, numerics.bf16_bits_to_f64(sbits)).dequant()
    assert np.abs(back - w).max() <= numerics.bf16_bits_to_f64(sbits).max() / 2 + 1e-12


def test_nan_in_bf16_weight_is_named():
    bits = numerics.f64_to_bf16_bits(np.ones((2, 32)))
    bits[1, 5] = 0x7FC0
    with pytest.raises(FormatError, match=r"'L3.e7.up'.*\[1, 5\]"):
        formats.from_bf16(bits, "L3.e7.up").dequant()
