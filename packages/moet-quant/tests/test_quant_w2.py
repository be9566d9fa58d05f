"""The W2 quantizer: the literal specification by hand, and the fast path bit-identical to it."""

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moet_quant import formats, fp4, numerics, synth, w2
from moet_quant.errors import FormatError


def q1(values, **kw):
    """Quantize one row of 32 values with the float64 specification."""
    w = np.zeros((1, 32))
    w[0, : len(values)] = values
    t = w2.quantize_f64(w, **kw)
    return w2.unpack_codes(t.codes)[0], int(t.scales[0, 0])


def test_block_scale_is_rint_log2_amax_over_6():
    assert q1([6.0])[1] == 127  # e = 0
    assert q1([12.0])[1] == 128
    assert q1([6.0 * 2**0.49])[1] == 127 and q1([6.0 * 2**0.51])[1] == 128
    assert q1([0.0])[1] == 0  # all-zero block -> e = -127
    assert q1([1e300])[1] == 254 and q1([1e-300])[1] == 0  # clamped to [-127, 127]


def test_level_classes_and_midpoint_ties_go_low():
    codes, _ = q1([6.0, 2.5, 2.5000001, -2.5, -3.0, 0.25, -0.1, 4.0, 1.0])
    # 6 -> +4 (3); 2.5 is the 2|3 midpoint -> 2 -> +1 (2); just above -> 3 -> +4; -2.5 -> -1 (1)
    assert codes[:9].tolist() == [3, 2, 3, 1, 0, 2, 1, 3, 2]


def test_exact_zero_signs_and_balancing_modes():
    w = np.zeros((1, 64))
    w[0, 0] = 6.0
    w[0, 32] = 6.0
    # all other entries are +0: the minority sign (none) holds 0% < 5% -> k parity in auto
    auto = w2.unpack_codes(w2.quantize_f64(w, zero_mode="auto").codes)[0]
    sign = w2.unpack_codes(w2.quantize_f64(w, zero_mode="sign").codes)[0]
    assert (sign[1:32] == 2).all()
    k = np.arange(64)
    zero = w[0] == 0
    assert (auto[zero] == np.where(k[zero] % 2 == 1, 1, 2)).all()


def test_auto_balancing_threshold_is_5_percent():
    n_zero = 100
    w = np.zeros((1, 128))
    w[0, :28] = np.linspace(1, 6, 28)
    zeros = np.arange(28, 128)
    for n_neg, balanced in ((5, False), (4, True)):
        x = w.copy()
        x[0, zeros[:n_neg]] = -0.0
        assert np.signbit(x[0, zeros]).sum() == n_neg and len(zeros) == n_zero
        c = w2.unpack_codes(w2.quantize_f64(x, zero_mode="auto").codes)[0][zeros]
        parity = np.where(zeros % 2 == 1, 1, 2)
        assert (c == parity).all() == balanced


def test_pack_layout_and_dequantize():
    codes = np.array([[0, 1, 2, 3] * 8], dtype=np.uint8)
    packed = w2.pack_codes(codes)
    assert packed[0, 0] == 0b11100100  # code k at bits 2*(k % 4)
    assert (w2.unpack_codes(packed) == codes).all()
    deq = w2.dequantize(packed, np.array([[128]], np.uint8))
    assert deq[0, :4].tolist() == [-8.0, -2.0, 2.0, 8.0]


def test_geometry_and_mode_errors():
    with pytest.raises(FormatError, match=r"'t'.*\[4, 48\].*multiple of 32"):
        w2.quantize_f64(np.ones((4, 48)), name="t")
    with pytest.raises(FormatError, match="zero_mode 'bogus'"):
        w2.quantize_f64(np.ones((4, 32)), zero_mode="bogus")
    with pytest.raises(FormatError, match="non-finite"):
        w2.quantize_f64(np.full((1, 32), np.inf))


def _adversarial(rng, n, k):
    """Weights with exact ties (|w| = 2.5 * 2**e), zeros of both signs, subnormal-ish values."""
    w = rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-6, 1, size=(n, 1))
    blocks = w.reshape(n, k // 32, 32)
    e = w2.block_exponent(np.abs(blocks).max(-1)).astype(float)
    tie = np.exp2(e) * 2.5
    sel = rng.random((n, k // 32, 32)) < 0.1
    blocks[sel] = (
        np.sign(rng.standard_normal(sel.sum())) * np.broadcast_to(tie[..., None], sel.shape)[sel]
    )
    w = blocks.reshape(n, k)
    w[rng.random((n, k)) < 0.05] = 0.0
    w[rng.random((n, k)) < 0.01] = -0.0
    return w


SOURCES = {
    "bf16": lambda w: formats.from_bf16(numerics.f64_to_bf16_bits(w)),
    "fp16": lambda w: formats.from_f16(np.clip(w, -6e4, 6e4).astype(np.float16)),
    "fp8-block": lambda w: formats.from_fp8_block(*synth.fp8_block(w)),
    "fp8-tensor": lambda w: formats.from_fp8_tensor(
        synth.encode_e4m3(w / np.abs(w).max() * 400), np.float32(0.5)
    ),
    "fp8-channel": lambda w: formats.from_fp8_tensor(*synth.fp8_channel(w)),
    "nvfp4": lambda w: formats.from_nvfp4(*synth.nvfp4(w)),
    "mxfp4": lambda w: formats.from_mxfp4(*synth.mxfp4(w)),
    "int4": lambda w: formats.from_int4_packed(
        synth.int4_pack(w)[0], numerics.bf16_bits_to_f64(synth.int4_pack(w)[1])
    ),
}


@pytest.mark.parametrize("fmt", list(SOURCES))
@pytest.mark.parametrize("zero_mode", w2.ZERO_MODES)
def test_fast_path_is_bit_identical_to_the_specification(fmt, zero_mode):
    rng = np.random.default_rng(zlib.crc32(f"{fmt}{zero_mode}".encode()))
    for n, k in ((1, 32), (3, 64), (130, 256)):
        src = SOURCES[fmt](_adversarial(rng, n, k))
        fast = w2.quantize(src, zero_mode)
        spec = w2.quantize_f64(src.dequant(), zero_mode)
        assert (fast.codes == spec.codes).all() and (fast.scales == spec.scales).all()
        fast_r, nib = fp4.fp4r(src, zero_mode)
        _, grid, neg = w2.quantize_f64(src.dequant(), zero_mode, with_grid=True)
        assert (nib == ((neg.astype(np.uint8) << 3) | grid)).all()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(-30, 30))
def test_fast_bf16_equals_spec_property(seed, exp):
    rng = np.random.default_rng(seed)
    w = _adversarial(rng, 4, 64) * 2.0**exp
    src = formats.from_bf16(numerics.f64_to_bf16_bits(w))
    a, b = w2.quantize(src), w2.quantize_f64(src.dequant())
    assert (a.codes == b.codes).all() and (a.scales == b.scales).all()


def test_optimal_mode_never_worse_per_block():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 256)) * rng.uniform(0.1, 3, size=(64, 1))
    ref = w2.quantize_f64(w).dequant()
    opt = w2.quantize_f64(w, mode="optimal").dequant()
    err = lambda x: ((x - w) ** 2).reshape(64, 8, 32).sum(-1)  # noqa: E731
    assert (err(opt) <= err(ref) + 1e-15).all() and err(opt).sum() < err(ref).sum()


def test_fp4r_refinement_roundtrip_exhaustive():
    # every (sign, grid index) at every position in a 16-weight group, zeros included
    nib = np.array([np.roll(np.arange(16, dtype=np.uint8), s) for s in range(16)])  # [16, 16]
    nib = np.concatenate([nib, nib[:, ::-1]], axis=1)  # K = 32
    big = (nib & 7) >= 5
    neg = nib >= 8
    codes = w2.pack_codes(((~neg).astype(np.uint8) << 1) | (big ^ neg).astype(np.uint8))
    r = fp4.refinement_plane(nib)
    assert r.shape == (16, 10)
    assert (fp4.nibbles_from_refinement(codes, r) == nib).all()


def test_refinement_corruption_is_detected():
    nib = np.full((1, 32), 6, np.uint8)  # 4.0: class +4, digit 1
    base, _ = w2.quantize_f64(np.full((1, 32), 4.0), with_grid=True)[:2]
    r = fp4.refinement_plane(nib)
    bad = r.copy()
    bad[0, 0] = 0xFF
    bad[0, 1] |= 0x03  # first group value 1023 >= 625
    with pytest.raises(FormatError, match="625"):
        fp4.nibbles_from_refinement(base.codes, bad)
    big_digit = fp4.refinement_plane(np.full((1, 32), 4, np.uint8))  # digit 4 under a +4 code
    with pytest.raises(FormatError, match="digit > 2"):
        fp4.nibbles_from_refinement(base.codes, big_digit)


def test_fp4r_nibbles_dequantize_to_the_e2m1_snap():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((8, 64))
    base, nib = fp4.fp4r(w)
    s = np.exp2(base.scales.astype(float) - 127)
    u = w.reshape(8, 2, 32) / s[..., None]
    snapped = np.sign(u) * w2.E2M1_GRID[w2.snap_e2m1(np.abs(u))]
    assert np.allclose(fp4.dequant_fp4r(nib, base.scales), (snapped * s[..., None]).reshape(8, 64))


def test_mxfp4_direct_map_keeps_scales_and_classes():
    nib = np.tile(np.arange(16, dtype=np.uint8), (1, 2))
    sc = np.array([[100]], np.uint8)
    t = w2.from_fp4_nibbles(nib, sc, zero_mode="sign")
    assert (t.scales == sc).all()
    # magnitudes 0..2 -> +-1, 3,4,6 -> +-4; the sign bit picks the sign (zeros too in "sign")
    want = [2, 2, 2, 2, 2, 3, 3, 3, 1, 1, 1, 1, 1, 0, 0, 0] * 2
    assert w2.unpack_codes(t.codes)[0].tolist() == want
