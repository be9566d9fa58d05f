"""Exact number formats: every decode here is exact in float64.

bf16/fp16/fp32 embed in float64 exactly; e4m3 (FP8), e2m1 (FP4) and UE8M0 are small tables.
The tables are indexed by the *magnitude* bits of a code, so they are sorted ascending: the fast
quantizer compares magnitude bits against per-block thresholds instead of decoding to floats.
"""

from __future__ import annotations

import numpy as np

# e2m1 (FP4) magnitudes by 3-bit code; bit 3 of a nibble is the sign.
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)
E2M1_VALUES = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])  # by 4-bit nibble


def _e4m3fn_magnitudes() -> np.ndarray:
    """float8_e4m3fn magnitudes by 7-bit code (bias 7, no infinities, 0x7f is NaN)."""
    codes = np.arange(128)
    exp, mant = codes >> 3, codes & 7
    normal = (1.0 + mant / 8.0) * np.exp2(exp.astype(np.float64) - 7.0)
    sub = (mant / 8.0) * 2.0**-6
    out = np.where(exp == 0, sub, normal)
    out[0x7F] = np.nan
    return out


E4M3_MAGNITUDES = _e4m3fn_magnitudes()  # [128], index 0x7f is NaN
E4M3_VALUES = np.concatenate([E4M3_MAGNITUDES, -E4M3_MAGNITUDES])  # by byte
E4M3_MAX_FINITE_MAG = 0x7E


def bf16_bits_to_f64(bits: np.ndarray) -> np.ndarray:
    """bf16 (as uint16 bits) to float64, exactly."""
    with np.errstate(invalid="ignore"):  # NaN bit patterns stay NaN
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def f64_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float64 to bf16 bits with round-to-nearest-even (for tests and writers of bf16 data)."""
    f = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounding = ((f >> 16) & 1) + 0x7FFF
    return ((f + rounding) >> 16).astype(np.uint16)


def ue8m0_to_f64(b: np.ndarray) -> np.ndarray:
    """UE8M0 scale bytes to float64: 2**(b - 127); 255 is NaN."""
    b = np.asarray(b)
    out = np.exp2(b.astype(np.float64) - 127.0)
    return np.where(b == 255, np.nan, out)


def e4m3_to_f64(b: np.ndarray) -> np.ndarray:
    return E4M3_VALUES[np.asarray(b, dtype=np.uint8)]


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., K/2] -> uint8 [..., K]; the low nibble holds the even k (modelopt, OCP MX)."""
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def pack_nibbles(nib: np.ndarray) -> np.ndarray:
    """Inverse of unpack_nibbles."""
    nib = np.asarray(nib, dtype=np.uint8)
    return (nib[..., 0::2] & 0x0F) | (nib[..., 1::2] << 4)
