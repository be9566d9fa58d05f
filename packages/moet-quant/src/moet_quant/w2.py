"""The W2 quantizer: 2-bit codes {-4, -1, +1, +4} x a UE8M0 scale per 32 weights along K.

Two implementations of one specification (design.md, Formats):

* `quantize_f64` follows the specification literally on float64 values: per block
  e = clip(rint(log2(amax / 6)), -127, 127), u = w / 2**e, |u| snapped to the e2m1 grid (midpoint
  ties to the lower magnitude), {0, .5, 1, 1.5, 2} -> 1 and {3, 4, 6} -> 4. It is the oracle.
* `quantize` works on `formats.Encoded` sources without decoding them: the only per-weight
  question is whether |w| > 2.5 * 2**e, and because a source's magnitude codes are monotonic that
  becomes an integer comparison `mag >= T` against one threshold code per block (found exactly on
  the small magnitude table). The tests hold the two bit-identical.

Zero-sign balancing: exact zeros have no level, their sign bit picks +-1. In `auto` mode, when the
minority sign holds under 5% of a tensor's exact zeros, all its zeros take the sign of k's parity
(odd k negative); `alt` always does that, `sign` never does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import FormatError
from .formats import Encoded, check_finite_codes

FORMAT = "w2-ue8m0b32-v1"
BLOCK = 32
LEVELS = np.array([-4.0, -1.0, 1.0, 4.0])  # by code 0..3
ZERO_MODES = ("auto", "sign", "alt")
MODES = ("reference", "optimal")
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MIDPOINTS = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2  # 0.25 .. 5
BIG_FROM = 5  # grid index of 3.0: magnitudes from here on take level 4


@dataclass
class W2Tensor:
    codes: np.ndarray  # uint8 [N, K/4], 4 codes per byte, little-endian along K
    scales: np.ndarray  # uint8 [N, K/32], UE8M0

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 4

    def dequant(self) -> np.ndarray:
        return dequantize(self.codes, self.scales)


def _check_geometry(shape: tuple[int, ...], name: str) -> None:
    if len(shape) != 2 or shape[1] % BLOCK:
        raise FormatError(
            f"tensor {name!r}: shape {list(shape)} cannot take W2: expected [N, K] "
            f"with K a multiple of {BLOCK} (the scale block)"
        )


def _check_modes(zero_mode: str, mode: str) -> None:
    if zero_mode not in ZERO_MODES:
        raise FormatError(f"zero_mode {zero_mode!r} is unknown; expected one of {ZERO_MODES}")
    if mode not in MODES:
        raise FormatError(f"mode {mode!r} is unknown; expected one of {MODES}")


def block_exponent(amax: np.ndarray) -> np.ndarray:
    """e = clip(rint(log2(amax / 6)), -127, 127); all-zero blocks get -127. int16."""
    with np.errstate(divide="ignore"):
        e = np.rint(np.log2(amax / 6.0))
    e = np.where(amax > 0, e, -127.0)
    return np.clip(e, -127, 127).astype(np.int16)


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [N, K] in 0..3 -> [N, K/4], code k at bits 2*(k % 4)."""
    n, k = codes.shape
    v = np.ascontiguousarray(codes).view("<u4").reshape(n, k // 4)
    # the bytes of v hold codes at bits 0, 8, 16, 24: move them to bits 0, 2, 4, 6
    return ((v & 0x3) | ((v >> 6) & 0xC) | ((v >> 12) & 0x30) | ((v >> 18) & 0xC0)).astype(np.uint8)


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    n, k4 = packed.shape
    out = np.empty((n, k4, 4), dtype=np.uint8)
    for i in range(4):
        out[:, :, i] = (packed >> (2 * i)) & 3
    return out.reshape(n, 4 * k4)


def dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """W2 codes + UE8M0 scales -> float64 [N, K] (exact)."""
    c = unpack_codes(codes)
    n, k = c.shape
    s = np.exp2(scales.astype(np.float64) - 127.0)
    return (LEVELS[c].reshape(n, k // BLOCK, BLOCK) * s[:, :, None]).reshape(n, k)


def balances_zeros(zero_mode: str, n_zero: int, n_neg_zero: int) -> bool:
    """Whether a tensor's exact zeros take k-parity signs: always in `alt`, never in `sign`, and
    in `auto` when the minority sign holds under 5% of the zeros."""
    if zero_mode != "auto":
        return zero_mode == "alt"
    return n_zero > 0 and 20 * min(n_neg_zero, n_zero - n_neg_zero) < n_zero


def _balance_zeros(neg: np.ndarray, zero: np.ndarray, zero_mode: str) -> np.ndarray:
    """Apply zero-sign balancing to the sign plane (see module doc). Returns the new sign plane."""
    if zero_mode == "sign":
        return neg
    n_zero = int(np.count_nonzero(zero))
    if not balances_zeros(zero_mode, n_zero, int(np.count_nonzero(neg & zero))):
        return neg
    odd_k = (np.arange(neg.shape[1]) & 1).astype(bool)
    return np.where(zero, odd_k[None, :], neg)


def _codes_from(neg: np.ndarray, big: np.ndarray) -> np.ndarray:
    """(sign, magnitude class) -> code: -4 -> 0, -1 -> 1, +1 -> 2, +4 -> 3."""
    neg = neg.view(np.uint8) if neg.dtype == np.bool_ else neg.astype(np.uint8)
    big = big.view(np.uint8) if big.dtype == np.bool_ else big.astype(np.uint8)
    return ((neg ^ 1) << 1) | (big ^ neg)


# --- the literal float64 specification (oracle, fp32 sources, optimal mode) ---------------------


def snap_e2m1(absu: np.ndarray) -> np.ndarray:
    """|u| -> e2m1 grid index 0..7, midpoint ties to the lower magnitude, saturating at 6."""
    return np.searchsorted(E2M1_MIDPOINTS, absu, side="left").astype(np.uint8)


def _block_errors(w: np.ndarray, e: np.ndarray) -> np.ndarray:
    u = w / np.exp2(e.astype(np.float64))[..., None]
    big = snap_e2m1(np.abs(u)) >= BIG_FROM
    q = np.where(big, 4.0, 1.0) * np.exp2(e.astype(np.float64))[..., None]
    return ((np.abs(w) - q) ** 2).sum(-1)  # a zero's error does not depend on its sign


def quantize_f64(
    w: np.ndarray,
    zero_mode: str = "auto",
    mode: str = "reference",
    name: str = "tensor",
    with_grid: bool = False,
):
    """Quantize float64 w [N, K]. Returns W2Tensor, or (W2Tensor, grid idx, sign) with_grid."""
    _check_modes(zero_mode, mode)
    _check_geometry(w.shape, name)
    w = np.asarray(w, dtype=np.float64)
    if not np.isfinite(w).all():
        n, k = np.argwhere(~np.isfinite(w))[0]
        raise FormatError(
            f"tensor {name!r}: non-finite weight (NaN/Inf) at [{n}, {k}]; the "
            "checkpoint is corrupt: re-export it"
        )
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    e = block_exponent(np.abs(blocks).max(-1))
    if mode == "optimal":
        cands = [e, np.clip(e - 1, -127, 127), np.clip(e + 1, -127, 127)]
        errs = np.stack([_block_errors(blocks, c) for c in cands])
        e = np.choose(np.argmin(errs, axis=0), cands).astype(np.int16)  # ties keep the reference e
    u = blocks / np.exp2(e.astype(np.float64))[..., None]
    grid = snap_e2m1(np.abs(u)).reshape(n, k)
    neg = _balance_zeros(np.signbit(w), w == 0, zero_mode)
    codes = _codes_from(neg, grid >= BIG_FROM)
    out = W2Tensor(pack_codes(codes), (e + 127).astype(np.uint8))
    return (out, grid, neg) if with_grid else out


# --- the fast path on encoded sources -----------------------------------------------------------


def _max_last(a: np.ndarray) -> np.ndarray:
    """max over a short last axis: numpy reduces a contiguous leading axis about twice as fast
    as many short trailing ones, even counting the transposing copy."""
    return np.maximum.reduce(np.ascontiguousarray(np.moveaxis(a, -1, 0)), axis=0)


def _unit(enc: Encoded) -> int:
    """Width of the unit over which the source scale is constant and which tiles a 32-block."""
    g = enc.group
    if enc.scale is None or g % BLOCK == 0:
        return BLOCK
    if BLOCK % g == 0:
        return g
    return 0  # no common tiling: take the float64 path


def _threshold_codes(
    table: np.ndarray, scale: np.ndarray | None, e: np.ndarray, mult: float
) -> np.ndarray:
    """T = #{m : table[m] * scale <= mult * 2**e}, exactly, so |w| > mult * 2**e <=> mag >= T.

    Without a scale T depends on e alone (see `_exponent_lut`). With one, thr / scale is rounded,
    so the search result is corrected by one entry either way using exact products.
    """
    thr = mult * np.exp2(e.astype(np.float64))
    n_tab = table.size
    safe = np.where(scale > 0, scale, 1.0)
    t = np.searchsorted(table, thr / safe, side="right")
    lo = np.maximum(t - 1, 0)
    t -= (t > 0) & (table[lo] * scale > thr)
    hi = np.minimum(t, n_tab - 1)
    t += (t < n_tab) & (table[hi] * scale <= thr)
    return np.where(scale > 0, t, n_tab)  # a zero scale makes every weight zero: nothing is big


def _exponent_lut(table: np.ndarray, mult: float) -> np.ndarray:
    """For unscaled sources: T for every block exponent -127..127, indexed by e + 127."""
    return np.searchsorted(table, mult * np.exp2(np.arange(-127, 128.0)), side="right")


def _unit_scales(enc: Encoded, unit: int) -> np.ndarray | None:
    if enc.scale is None:
        return None
    n, k = enc.shape
    if enc.group <= unit:
        return enc.scale[:, : k // unit]
    cols = (np.arange(k // unit) * unit) // enc.group
    return enc.scale[:, cols]


BAND_ELEMENTS = 1 << 17  # weights per band: the band's temporaries stay in the L2 cache


def quantize(
    src: Encoded | np.ndarray,
    zero_mode: str = "auto",
    mode: str = "reference",
    name: str | None = None,
    with_grid: bool = False,
):
    """Quantize one expert projection (an Encoded source or float64 values) to W2.

    Returns a W2Tensor, or with_grid (W2Tensor, e2m1 grid index [N, K] uint8, sign plane [N, K])
    where the sign plane is after zero balancing: the fp4r tier's nibbles.

    Works in bands of rows small enough for the L2 cache. In `auto` zero mode the bands are first
    quantized with sign-bit zeros while the zeros are counted, and each band with zeros keeps the
    packed XOR that balancing would apply; when the count says to balance, it is applied.
    """
    if isinstance(src, np.ndarray):
        return quantize_f64(src, zero_mode, mode, name or "tensor", with_grid)
    name = name or src.name
    _check_modes(zero_mode, mode)
    _check_geometry(src.shape, name)
    unit = _unit(src)
    if mode == "optimal" or unit == 0:
        return quantize_f64(src.dequant(), zero_mode, mode, name, with_grid)
    n, k = src.shape
    per_block = BLOCK // unit
    table = src.table[: src.n_finite]
    unit_scales = _unit_scales(src, unit)
    mults = [float(m) for m in E2M1_MIDPOINTS] if with_grid else [2.5]
    luts = (
        {m: _exponent_lut(table, m).astype(src.raw.dtype) for m in mults}
        if unit_scales is None
        else {}
    )
    odd_k = (np.arange(k) & 1).astype(bool)
    codes = np.empty((n, k // 4), dtype=np.uint8)
    scales = np.empty((n, k // BLOCK), dtype=np.uint8)
    grid_all = np.empty((n, k), dtype=np.uint8) if with_grid else None
    neg_all = np.empty((n, k), dtype=bool) if with_grid else None
    flips: dict[int, np.ndarray] = {}  # band start -> packed XOR that applies zero balancing

    def band(r0: int, r1: int, balance: bool) -> tuple[int, int]:
        """Quantize rows [r0, r1); -> (exact zeros, negative zeros) seen there."""
        mag, neg = src.rows(r0, r1)
        rows = r1 - r0
        umag = mag.reshape(rows, k // unit, unit)
        umax = _max_last(umag)
        if int(umax.max(initial=0)) >= src.n_finite:
            check_finite_codes(src, mag, r0)
        scale = None if unit_scales is None else unit_scales[r0:r1]
        uamax = np.take(table, umax)
        if scale is not None:
            uamax *= scale
        if per_block == 2:  # (numpy reductions over very short axes are slow)
            uamax = np.maximum(uamax[:, 0::2], uamax[:, 1::2])
        elif per_block > 1:
            uamax = uamax.reshape(rows, k // BLOCK, per_block).max(-1)
        e = block_exponent(uamax)
        e_units = np.repeat(e, per_block, axis=1) if per_block > 1 else e

        def above(mult: float) -> np.ndarray:  # |w| > mult * 2**e, per weight
            if scale is None:
                t = np.take(luts[mult], e_units + 127)
            else:
                t = _threshold_codes(table, scale, e_units, mult).astype(mag.dtype)
            return (umag >= t[..., None]).reshape(rows, k)

        zero = mag == 0
        counts = int(np.count_nonzero(zero)), int(np.count_nonzero(zero & neg))
        if balance and counts[0]:
            neg = np.where(zero, odd_k, neg)
        elif counts[0] and zero_mode == "auto" and not with_grid:
            # what balancing would change: a zero's code 2 - neg becomes 2 - odd_k (1 <-> 2 is ^3)
            flips[r0] = pack_codes((zero & (neg ^ odd_k)).view(np.uint8) * np.uint8(3))
        if with_grid:  # grid index = number of e2m1 midpoints strictly below |u|
            grid = np.zeros((rows, k), dtype=np.uint8)
            for mid in mults:
                grid += above(mid)
            big = grid >= BIG_FROM
            grid_all[r0:r1], neg_all[r0:r1] = grid, neg
        else:
            big = above(2.5)
        codes[r0:r1] = pack_codes(_codes_from(neg, big))
        scales[r0:r1] = e + 127
        return counts

    step = max(1, BAND_ELEMENTS // k)
    bands = [(r0, min(n, r0 + step)) for r0 in range(0, n, step)]
    balance = zero_mode == "alt"
    seen = [band(r0, r1, balance) for r0, r1 in bands]
    if zero_mode == "auto":
        n_zero, n_neg = (sum(c) for c in zip(*seen))
        if balances_zeros(zero_mode, n_zero, n_neg):
            for (r0, r1), (z, _) in zip(bands, seen):
                if z and with_grid:
                    band(r0, r1, True)
                elif z:
                    codes[r0:r1] ^= flips[r0]
    out = W2Tensor(codes, scales)
    return (out, grid_all, neg_all) if with_grid else out


def from_fp4_nibbles(
    nibbles: np.ndarray, scales: np.ndarray, zero_mode: str = "auto", name: str = "tensor"
) -> W2Tensor:
    """FP4 sources with UE8M0 block-32 scales (MXFP4): map nibble -> code, keep scales verbatim."""
    _check_modes(zero_mode, "reference")
    _check_geometry(nibbles.shape, name)
    idx = nibbles & 7
    neg = _balance_zeros(nibbles >= 8, idx == 0, zero_mode)
    return W2Tensor(pack_codes(_codes_from(neg, idx >= BIG_FROM)), np.array(scales, dtype=np.uint8))
