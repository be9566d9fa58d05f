"""The torch references against independent float64 implementations written from the byte spec."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moet_kernels.reference import dense_moe_reference, w2_dequant, w2_moe_reference

# design.md, Formats (W2): code c -> level; w = level(c) * 2**(b - 127).
SPEC_LEVELS = {0: -4.0, 1: -1.0, 2: 1.0, 3: 4.0}


def spec_dequant(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 [N, K] from the byte-level spec, one weight at a time (slow, obviously right)."""
    n_rows, n_bytes = codes.shape
    out = np.empty((n_rows, n_bytes * 4), dtype=np.float64)
    for n in range(n_rows):
        for k in range(n_bytes * 4):
            byte = int(codes[n, k // 4])
            code = (byte >> (2 * (k % 4))) & 0b11  # little-endian 2-bit fields along K
            b = int(scales[n, k // 32])
            scale = float("nan") if b == 255 else 2.0 ** (b - 127)
            out[n, k] = SPEC_LEVELS[code] * scale
    return out


def run_dequant(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    out = w2_dequant(torch.from_numpy(codes), torch.from_numpy(scales))
    assert out.dtype == torch.float32
    assert tuple(out.shape) == (codes.shape[0], codes.shape[1] * 4)
    return out.numpy()


# Every byte value once per (8 rows x 32 bytes) matrix; K = 128, 4 scale blocks per row.
ALL_BYTES = np.arange(256, dtype=np.uint8).reshape(8, 32)


@pytest.mark.parametrize("b", [0, 1, 2, 100, 126, 127, 128, 150, 253, 254])
def test_dequant_exhaustive_bytes(b: int) -> None:
    scales = np.full((8, 4), b, dtype=np.uint8)
    want = spec_dequant(ALL_BYTES, scales)
    got = run_dequant(ALL_BYTES, scales)
    # Exact wherever float32 can hold the value; +-inf where |w| >= 2**128 (level 4, b >= 253).
    fits = np.abs(want) < 2.0**128
    np.testing.assert_array_equal(got.astype(np.float64)[fits], want[fits])
    assert np.array_equal(got[~fits], np.sign(want[~fits]) * np.inf)
    assert fits.all() == (b < 253)


def test_dequant_field_order() -> None:
    # Byte 0b11_10_01_00 holds codes 0, 1, 2, 3 at k = 0, 1, 2, 3.
    codes = np.full((1, 8), 0b11100100, dtype=np.uint8)
    got = run_dequant(codes, np.full((1, 1), 127, dtype=np.uint8))
    np.testing.assert_array_equal(got[0, :4], [-4.0, -1.0, 1.0, 4.0])


def test_dequant_mixed_blocks_and_batch() -> None:
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, size=(3, 5, 64), dtype=np.uint8)  # [E, N, K/4], K = 256
    scales = rng.integers(0, 255, size=(3, 5, 8), dtype=np.uint8)  # [E, N, K/32]
    got = w2_dequant(torch.from_numpy(codes), torch.from_numpy(scales)).numpy()
    for e in range(3):
        want = spec_dequant(codes[e], scales[e]).astype(np.float32)
        np.testing.assert_array_equal(got[e], want)


def test_dequant_nan_scale() -> None:
    got = run_dequant(ALL_BYTES, np.full((8, 4), 255, dtype=np.uint8))
    assert np.isnan(got).all()


def test_dequant_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        w2_dequant(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(TypeError):
        w2_dequant(torch.zeros(4, 8), torch.zeros(4, 1, dtype=torch.uint8))


def spec_moe(x, ids, weights, w13, w2) -> np.ndarray:
    """Direct float64 loop over tokens and top-k slots."""
    t_count, h = x.shape
    out = np.zeros((t_count, h), dtype=np.float64)
    for t in range(t_count):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            w13_e = spec_dequant(w13[0][e], w13[1][e])
            w2_e = spec_dequant(w2[0][e], w2[1][e])
            inter = w13_e.shape[0] // 2
            gate = w13_e[:inter] @ x[t]
            up = w13_e[inter:] @ x[t]
            act = gate / (1.0 + np.exp(-gate)) * up
            out[t] += weights[t, j] * (w2_e @ act)
    return out


def test_moe_reference_matches_float64_loop() -> None:
    rng = np.random.default_rng(7)
    t_count, h, inter, n_exp, top_k = 5, 64, 32, 4, 2
    x = rng.standard_normal((t_count, h)).astype(np.float32)
    ids = np.stack([rng.permutation(n_exp)[:top_k] for _ in range(t_count)]).astype(np.int64)
    weights = rng.random((t_count, top_k)).astype(np.float32)
    w13 = (
        rng.integers(0, 256, (n_exp, 2 * inter, h // 4), dtype=np.uint8),
        rng.integers(120, 125, (n_exp, 2 * inter, h // 32), dtype=np.uint8),
    )
    w2 = (
        rng.integers(0, 256, (n_exp, h, inter // 4), dtype=np.uint8),
        rng.integers(120, 125, (n_exp, h, inter // 32), dtype=np.uint8),
    )
    got = w2_moe_reference(
        torch.from_numpy(x),
        torch.from_numpy(ids),
        torch.from_numpy(weights),
        tuple(torch.from_numpy(a) for a in w13),
        tuple(torch.from_numpy(a) for a in w2),
    )
    assert got.dtype == torch.float32 and tuple(got.shape) == (t_count, h)
    want = spec_moe(x.astype(np.float64), ids, weights.astype(np.float64), w13, w2)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("mode", ["exact", "kernel"])
def test_dense_moe_reference_is_the_w2_reference_over_the_dequantized_weights(mode) -> None:
    """The harness's kernel mode (gate_eval) computes over a model's dequantized experts: bit for
    bit what the reference computes from the codes and scales, in either mode."""
    rng = np.random.default_rng(11)
    t_count, h, inter, n_exp, top_k = 6, 256, 128, 5, 3
    x = torch.from_numpy(rng.standard_normal((t_count, h)).astype(np.float32))
    ids = torch.from_numpy(
        np.stack([rng.permutation(n_exp)[:top_k] for _ in range(t_count)]).astype(np.int64)
    )
    weights = torch.from_numpy(rng.random((t_count, top_k)).astype(np.float32))

    def proj(n, k):
        return (torch.from_numpy(rng.integers(0, 256, (n_exp, n, k // 4), dtype=np.uint8)),
                torch.from_numpy(rng.integers(120, 125, (n_exp, n, k // 32), dtype=np.uint8)))  # fmt: skip

    w13, w2 = proj(2 * inter, h), proj(h, inter)
    want = w2_moe_reference(x, ids, weights, w13, w2, mode=mode)
    got = dense_moe_reference(x, ids, weights, w2_dequant(*w13), w2_dequant(*w2), mode=mode)
    assert torch.equal(got, want)
    if mode == "kernel":  # and the modes differ: the int8 activations
        assert not torch.equal(got, w2_moe_reference(x, ids, weights, w13, w2))


def test_moe_reference_modes_and_validation() -> None:
    x = torch.zeros(2, 32)
    ids = torch.zeros(2, 1, dtype=torch.int64)
    w = torch.ones(2, 1)
    w13 = (torch.zeros(1, 64, 8, dtype=torch.uint8), torch.full((1, 64, 1), 127, dtype=torch.uint8))
    w2 = (torch.zeros(1, 32, 8, dtype=torch.uint8), torch.full((1, 32, 1), 127, dtype=torch.uint8))
    assert w2_moe_reference(x, ids, w, w13, w2).abs().max() == 0
    assert w2_moe_reference(x, ids, w, w13, w2, mode="kernel").abs().max() == 0
    with pytest.raises(ValueError, match="mode must be one of"):
        w2_moe_reference(x, ids, w, w13, w2, mode="fast")
    with pytest.raises(ValueError, match="topk_ids"):
        w2_moe_reference(x, ids + 1, w, w13, w2)
