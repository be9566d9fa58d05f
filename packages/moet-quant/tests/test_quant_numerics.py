"""Exact number formats against torch's own float8/bfloat16 conversions (independent code)."""

import numpy as np
import torch

from moet_quant import numerics


def test_e4m3_table_matches_torch_exhaustively():
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(torch.float8_e4m3fn).to(torch.float64).numpy()
    ours = numerics.e4m3_to_f64(np.arange(256, dtype=np.uint8))
    nan = np.isnan(ref)
    assert (np.isnan(ours) == nan).all() and nan.sum() == 2  # 0x7f and 0xff
    assert (ours[~nan] == ref[~nan]).all()
    assert numerics.E4M3_MAGNITUDES[0x7E] == 448.0 and numerics.E4M3_MAGNITUDES[1] == 2.0**-9


def test_bf16_decode_matches_torch_exhaustively():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    ref = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float64).numpy()
    ours = numerics.bf16_bits_to_f64(bits)
    nan = np.isnan(ref)
    assert (np.isnan(ours) == nan).all()
    assert (ours[~nan] == ref[~nan]).all()


def test_bf16_encode_rounds_like_torch():
    x = np.random.default_rng(0).standard_normal(10000) * 3
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert (numerics.f64_to_bf16_bits(x) == ref).all()


def test_e2m1_and_ue8m0_hand_values():
    assert list(numerics.E2M1_VALUES[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert list(numerics.E2M1_VALUES[8:]) == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert numerics.ue8m0_to_f64(np.array([127, 128, 0, 254])).tolist() == [
        1,
        2,
        2.0**-127,
        2.0**127,
    ]
    assert np.isnan(numerics.ue8m0_to_f64(np.array([255])))[0]


def test_nibble_order_low_nibble_is_even_k():
    packed = np.array([[0x21, 0x43]], dtype=np.uint8)
    assert numerics.unpack_nibbles(packed).tolist() == [[1, 2, 3, 4]]
    assert (numerics.pack_nibbles(numerics.unpack_nibbles(packed)) == packed).all()
