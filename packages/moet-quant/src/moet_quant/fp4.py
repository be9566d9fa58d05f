"""FP4 tier data: `fp4r` (re-quantized nibbles + their base-5 refinement plane) and `fp4x`.

fp4r: the e2m1 nibbles of the reference quantizer, sharing the W2 block scales. A nibble is
sign << 3 | grid index; its sign is the W2 code's sign (after zero balancing), so the W2 code
fixes the sign and the magnitude class ({0, .5, 1, 1.5, 2} for +-1, {3, 4, 6} for +-4) and the
refinement plane only picks the magnitude inside the class: one base-5 digit per weight, four
digits per 10-bit group (d0 + 5 d1 + 25 d2 + 125 d3 < 625), four groups (16 weights) per 5 bytes,
little-endian: 2.5 bits/weight. `nibbles_from_refinement` is its exact inverse.

fp4x: an NVFP4 or MXFP4 checkpoint's own FP4 data and scales, copied verbatim (validated).
"""

from __future__ import annotations

import numpy as np

from . import w2
from .errors import FormatError
from .numerics import pack_nibbles


def fp4r(src, zero_mode: str = "auto", name: str | None = None):
    """-> (W2Tensor, nibbles uint8 [N, K] in 0..15) for one expert projection."""
    base, grid, neg = w2.quantize(src, zero_mode, "reference", name=name, with_grid=True)
    return base, (neg.astype(np.uint8) << 3) | grid


def refinement_plane(nibbles: np.ndarray) -> np.ndarray:
    """nibbles [N, K] -> refinement bytes [N, 5K/16]."""
    n, k = nibbles.shape
    if k % 16:
        raise FormatError(f"refinement plane needs K a multiple of 16, found K={k}")
    idx = (nibbles & 7).astype(np.uint16)
    digit = np.where(idx >= w2.BIG_FROM, idx - w2.BIG_FROM, idx).reshape(n, k // 4, 4)
    v = digit[..., 0] + 5 * digit[..., 1] + 25 * digit[..., 2] + 125 * digit[..., 3]
    v = v.reshape(n, k // 16, 4).astype(np.uint64)
    word = v[..., 0] | (v[..., 1] << 10) | (v[..., 2] << 20) | (v[..., 3] << 30)  # 40 bits
    out = np.empty((n, k // 16, 5), dtype=np.uint8)
    for b in range(5):
        out[..., b] = (word >> (8 * b)) & 0xFF
    return out.reshape(n, k // 16 * 5)


def nibbles_from_refinement(codes: np.ndarray, refine: np.ndarray) -> np.ndarray:
    """Exact inverse: W2 codes [N, K/4] + refinement [N, 5K/16] -> nibbles [N, K]."""
    c = w2.unpack_codes(codes)
    n, k = c.shape
    if refine.shape != (n, k // 16 * 5):
        raise FormatError(
            f"refinement plane has shape {list(refine.shape)}, expected "
            f"{[n, k // 16 * 5]} for codes of shape {list(codes.shape)}"
        )
    r = refine.reshape(n, k // 16, 5).astype(np.uint64)
    word = r[..., 0] | (r[..., 1] << 8) | (r[..., 2] << 16) | (r[..., 3] << 24) | (r[..., 4] << 32)
    v = np.stack([(word >> (10 * i)) & 0x3FF for i in range(4)], axis=-1).astype(np.int32)
    if (v >= 625).any():
        raise FormatError("refinement plane holds a group value >= 625 (corrupt data)")
    digit = np.stack([(v // 5**i) % 5 for i in range(4)], axis=-1).reshape(n, k)
    big = (c == 0) | (c == 3)
    if (big & (digit > 2)).any():
        raise FormatError("refinement plane holds a digit > 2 for a +-4 code (corrupt data)")
    idx = digit + np.where(big, w2.BIG_FROM, 0)
    neg = c < 2
    return ((neg.astype(np.uint8) << 3) | idx.astype(np.uint8)).astype(np.uint8)


def dequant_fp4r(nibbles: np.ndarray, scales: np.ndarray) -> np.ndarray:
    from .numerics import E2M1_VALUES

    n, k = nibbles.shape
    s = np.exp2(scales.astype(np.float64) - 127.0)
    return (E2M1_VALUES[nibbles].reshape(n, k // 32, 32) * s[..., None]).reshape(n, k)


__all__ = ["fp4r", "refinement_plane", "nibbles_from_refinement", "dequant_fp4r", "pack_nibbles"]
