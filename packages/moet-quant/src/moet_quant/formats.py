"""Source weight formats, decoded exactly.

Every supported source format writes one expert projection w[N, K] (K = contraction dim) as

    w[n, k] = (-1)**neg[n, k] * table[mag[n, k]] * scale[n, k // group]

with `table` an ascending float64 table of magnitudes. `Encoded` keeps that form, so the fast
quantizer can compare magnitude codes with per-block thresholds (integer work) while `dequant()`
gives the exact float64 values (every product here fits float64's 53-bit significand).
Scales are validated (finite, non-negative, shapes) before anything is quantized.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .errors import FormatError
from .numerics import (
    E2M1_MAGNITUDES,
    E4M3_MAGNITUDES,
    bf16_bits_to_f64,
    e4m3_to_f64,
    ue8m0_to_f64,
)

BF16_MAGNITUDES = bf16_bits_to_f64(np.arange(0x8000, dtype=np.uint16))  # inf at 0x7f80, NaN above
F16_MAGNITUDES = np.arange(0x8000, dtype=np.uint16).view(np.float16).astype(np.float64)
INT4_MAGNITUDES = np.arange(9, dtype=np.float64)  # |q| for q in [-8, 7]


def _split_sign_magnitude(sign_bit: int):
    def split(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return raw & (sign_bit - 1), raw >= sign_bit

    return split


def _byte_luts(decode) -> tuple[np.ndarray, np.ndarray]:
    """Per byte holding two 4-bit codes (low nibble = even k): uint16 LUTs whose two bytes are
    (mag, neg) of the low and the high nibble, so one gather decodes both in order."""
    lo = np.arange(256) & 0xF
    hi = np.arange(256) >> 4
    mag_lo, neg_lo = decode(lo)
    mag_hi, neg_hi = decode(hi)
    pack = lambda a, b: np.asarray(a, np.uint16) | (np.asarray(b, np.uint16) << 8)  # noqa: E731
    return pack(mag_lo, mag_hi), pack(neg_lo, neg_hi)


_E2M1_LUTS = _byte_luts(lambda n: (n & 7, n >= 8))
_INT4_LUTS = _byte_luts(lambda n: (np.abs(n - 8), n < 8))


def _split_packed(luts: tuple[np.ndarray, np.ndarray], k: int):
    mag_lut, neg_lut = luts

    def split(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b = raw.view(np.uint8).reshape(raw.shape[0], -1)
        # np.take: much faster than fancy indexing for small-int index arrays
        mag = np.take(mag_lut, b).view(np.uint8).reshape(b.shape[0], -1)[:, :k]
        neg = np.take(neg_lut, b).view(np.bool_).reshape(b.shape[0], -1)[:, :k]
        return mag, neg

    return split


@dataclass
class Encoded:
    """w = (-1)**neg * table[mag] * scale[:, k // group]  (scale None means 1).

    The source stays in its storage form (`raw`, rows = N); `rows(r0, r1)` splits a band of rows
    into (mag, neg), so the quantizer can work band by band in cache-sized pieces.
    """

    raw: np.ndarray  # storage, [N, ...]
    split: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # raw rows -> (mag, neg)
    k: int
    table: np.ndarray  # float64, ascending over its finite prefix
    n_finite: int  # table[:n_finite] are the finite magnitudes
    scale: np.ndarray | None  # float64 [N, ceil(K / group)]
    group: int
    name: str = "tensor"

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.k

    def rows(self, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
        return self.split(self.raw[r0:r1])

    @property
    def mag(self) -> np.ndarray:
        return self.rows(0, self.shape[0])[0]

    @property
    def neg(self) -> np.ndarray:
        return self.rows(0, self.shape[0])[1]

    def dequant(self) -> np.ndarray:
        mag, neg = self.rows(0, self.shape[0])
        check_finite_codes(self, mag)
        w = self.table[mag]
        if self.scale is not None:
            w = w * np.repeat(self.scale, self.group, axis=1)[:, : w.shape[1]]
        return np.where(neg, -w, w)


def check_finite_codes(enc: Encoded, mag: np.ndarray, row0: int = 0) -> None:
    bad = mag >= enc.n_finite
    if bad.any():
        n, k = np.argwhere(bad)[0]
        raise FormatError(
            f"tensor {enc.name!r}: non-finite weight (NaN/Inf) at [{row0 + n}, {k}]; "
            "the checkpoint is corrupt: re-export it"
        )


def _check_scale(scale: np.ndarray, expect: tuple[int, ...], name: str, what: str) -> np.ndarray:
    if tuple(scale.shape) != tuple(expect):
        raise FormatError(
            f"tensor {name!r}: {what} has shape {list(scale.shape)}, expected "
            f"{list(expect)} for this weight; the checkpoint is inconsistent"
        )
    s = np.asarray(scale, dtype=np.float64)
    if not np.isfinite(s).all():
        idx = tuple(int(i) for i in np.argwhere(~np.isfinite(s))[0])
        raise FormatError(
            f"tensor {name!r}: {what} holds a non-finite value at {list(idx)}; the "
            "checkpoint is corrupt: re-export it"
        )
    if (s < 0).any():
        raise FormatError(
            f"tensor {name!r}: {what} holds a negative scale; expected positive "
            "scales: re-export the checkpoint"
        )
    return s


def _need_2d(w: np.ndarray, name: str) -> None:
    if w.ndim != 2:
        raise FormatError(
            f"tensor {name!r}: expected a 2-D [N, K] weight, found shape {list(w.shape)}"
        )


# --- float sources -------------------------------------------------------------------------------


def from_bf16(bits: np.ndarray, name: str = "tensor") -> Encoded:
    _need_2d(bits, name)
    bits = np.asarray(bits, dtype=np.uint16)
    return Encoded(
        bits, _split_sign_magnitude(0x8000), bits.shape[1], BF16_MAGNITUDES, 0x7F80, None, 1, name
    )


def from_f16(x: np.ndarray, name: str = "tensor") -> Encoded:
    _need_2d(x, name)
    bits = np.ascontiguousarray(x).view(np.uint16)
    return Encoded(
        bits, _split_sign_magnitude(0x8000), bits.shape[1], F16_MAGNITUDES, 0x7C00, None, 1, name
    )


def f32_to_f64(x: np.ndarray, name: str = "tensor") -> np.ndarray:
    """fp32 has no small magnitude table: it takes the float64 path directly."""
    _need_2d(x, name)
    w = np.asarray(x, dtype=np.float64)
    if not np.isfinite(w).all():
        n, k = np.argwhere(~np.isfinite(w))[0]
        raise FormatError(
            f"tensor {name!r}: non-finite weight (NaN/Inf) at [{n}, {k}]; the "
            "checkpoint is corrupt: re-export it"
        )
    return w


# --- FP8 e4m3 block quant -----------------------------------------------------------------------


def from_fp8_block(
    w: np.ndarray, scale: np.ndarray, block: tuple[int, int] = (128, 128), name: str = "tensor"
) -> Encoded:
    """FP8 e4m3 with one fp32 scale per [bn, bk] block (partial edge blocks allowed).

    DeepSeek/GLM store `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] (a multiplier despite the name);
    modelopt `fp8_pb_wo` stores `weight_scale` [ceil(N/128), 1, ceil(K/128), 1]: pass either.
    """
    _need_2d(w, name)
    n, k = w.shape
    bn, bk = block
    expect2 = (-(-n // bn), -(-k // bk))
    if scale.ndim == 4:
        if tuple(scale.shape) != (expect2[0], 1, expect2[1], 1):
            raise FormatError(
                f"tensor {name!r}: weight_scale has shape {list(scale.shape)}, "
                f"expected {[expect2[0], 1, expect2[1], 1]} (fp8_pb_wo, block "
                f"{bn}x{bk}); the checkpoint is inconsistent"
            )
        scale = scale.reshape(expect2)
    s = _check_scale(scale, expect2, name, "FP8 block scale")
    rows = np.repeat(s, bn, axis=0)[:n]  # [N, ceil(K/bk)]
    w = np.asarray(w, dtype=np.uint8)
    return Encoded(w, _split_sign_magnitude(0x80), k, E4M3_MAGNITUDES, 0x7F, rows, bk, name)


def from_fp8_tensor(w: np.ndarray, scale: np.ndarray, name: str = "tensor") -> Encoded:
    """FP8 e4m3 with one per-tensor (or per-row [N] / [N, 1]) fp32 scale."""
    _need_2d(w, name)
    n, k = w.shape
    s = np.asarray(scale, dtype=np.float64)
    if s.size == 1:
        s = np.full((n, 1), float(s.reshape(-1)[0]))
    elif s.size == n:
        s = s.reshape(n, 1)
    s = _check_scale(s, (n, 1), name, "FP8 scale")
    w = np.asarray(w, dtype=np.uint8)
    return Encoded(w, _split_sign_magnitude(0x80), k, E4M3_MAGNITUDES, 0x7F, s, max(k, 1), name)


# --- FP4 ---------------------------------------------------------------------------------------


def from_nvfp4(
    packed: np.ndarray, scale_e4m3: np.ndarray, scale_2: np.ndarray | float, name: str = "tensor"
) -> Encoded:
    """modelopt NVFP4: packed e2m1 [N, K/2] (low nibble = even k), e4m3 scale per 16 along K,
    fp32 `weight_scale_2` either one scalar or one per row (fused projections)."""
    _need_2d(packed, name)
    n, k2 = packed.shape
    k = 2 * k2
    if scale_e4m3.shape != (n, k // 16):
        raise FormatError(
            f"tensor {name!r}: weight_scale has shape {list(scale_e4m3.shape)}, "
            f"expected {[n, k // 16]} (NVFP4, one e4m3 scale per 16); the checkpoint "
            "is inconsistent"
        )
    s1 = e4m3_to_f64(scale_e4m3)
    s2 = np.asarray(scale_2, dtype=np.float64).reshape(-1)
    if s2.size not in (1, n):
        raise FormatError(
            f"tensor {name!r}: weight_scale_2 has {s2.size} values, expected 1 or {n} (one per row)"
        )
    s = _check_scale(
        s1 * s2.reshape(-1, 1), (n, k // 16), name, "NVFP4 scale (weight_scale x weight_scale_2)"
    )
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    return Encoded(packed, _split_packed(_E2M1_LUTS, k), k, E2M1_MAGNITUDES, 8, s, 16, name)


def check_mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str = "tensor"):
    """MXFP4 (OCP MX): e2m1 nibbles [N, K/2] (or gpt-oss [N, K/32, 16]), UE8M0 scales [N, K/32].
    Returns the validated (packed nibbles uint8 [N, K/2], scale bytes uint8 [N, K/32])."""
    if blocks.ndim == 3:
        blocks = blocks.reshape(blocks.shape[0], -1)
    _need_2d(blocks, name)
    n, k2 = blocks.shape
    k = 2 * k2
    if scales.shape != (n, k // 32):
        raise FormatError(
            f"tensor {name!r}: MXFP4 scales have shape {list(scales.shape)}, expected "
            f"{[n, k // 32]} (one UE8M0 byte per 32)"
        )
    if (scales == 255).any():
        raise FormatError(f"tensor {name!r}: MXFP4 scale byte 255 (NaN); the checkpoint is corrupt")
    return np.ascontiguousarray(blocks, dtype=np.uint8), np.ascontiguousarray(scales)


def from_mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str = "tensor") -> Encoded:
    packed, sc = check_mxfp4(blocks, scales, name)
    k = 2 * packed.shape[1]
    split = _split_packed(_E2M1_LUTS, k)
    return Encoded(packed, split, k, E2M1_MAGNITUDES, 8, ue8m0_to_f64(sc), 32, name)


# --- compressed-tensors int4 pack-quantized -----------------------------------------------------


def from_int4_packed(
    packed: np.ndarray,
    scale: np.ndarray,
    shape: tuple[int, int] | None = None,
    group: int = 32,
    name: str = "tensor",
) -> Encoded:
    """compressed-tensors `pack-quantized`, 4-bit symmetric: int32 [N, K/8] holding eight
    offset-binary nibbles (q + 8) from the least significant bits up; scale [N, K/group]."""
    _need_2d(packed, name)
    n, k8 = packed.shape
    k = 8 * k8
    if shape is not None:
        if int(shape[0]) != n or int(shape[1]) > k:
            raise FormatError(
                f"tensor {name!r}: weight_shape {list(shape)} does not fit packed [{n}, {k8}] int32"
            )
        k = int(shape[1])
    s = _check_scale(
        np.asarray(scale, dtype=np.float64), (n, -(-k // group)), name, "int4 group scale"
    )
    packed = np.ascontiguousarray(packed).view("<u4")  # bytes hold nibbles low-first: k order
    return Encoded(packed, _split_packed(_INT4_LUTS, k), k, INT4_MAGNITUDES, 9, s, group, name)


def scale_to_f64(arr: np.ndarray, dtype: str) -> np.ndarray:
    """Scale tensors come in bf16 (raw bits), fp16, fp32 or e4m3; decode exactly."""
    if dtype == "BF16":
        return bf16_bits_to_f64(arr)
    if dtype == "F8_E4M3":
        return e4m3_to_f64(arr)
    return np.asarray(arr, dtype=np.float64)
