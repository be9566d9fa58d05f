"""The FP4 kernel-native row layout (`NativeRowLayout(hidden, inter, "fp4r" | "fp4x-mxfp4")`),
checked against encoders written out from its spec (layout.py docstring), loop by loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernels_native import native_section, spec_fragment, spec_scale_section, w13_native_rows

from moet_kernels.layout import (
    FAST_SPREAD,
    FP4_FAST_SPREAD,
    FP4R,
    FP4R_REFINE,
    MXFP4,
    NATIVE_FP4_LAYOUT_ID,
    NATIVE_LAYOUT_ID,
    NATIVE_TIERS,
    SCALE_CHUNK_BYTES,
    W2,
    NativeRowLayout,
    RowLayout,
    native_matrix,
    native_scale_words,
    slow_tile_fraction,
)

FP4_TIERS = ("fp4r", "fp4x-mxfp4")


def fp4_sections(rng, n_experts, hidden, inter, scale_lo=0, scale_hi=255, tier="fp4r"):
    """Random logical FP4 sections: codes bytes 0..255 (every nibble), scales in [lo, hi)."""
    lay = RowLayout(hidden, inter, tier)
    return {
        name: rng.integers(
            *((scale_lo, scale_hi) if "scales" in name else (0, 256)),
            size=(n_experts, *shape),
            dtype=np.uint8,
        )
        for name, (_, shape) in lay.sections.items()
    }


# --- the spec, loop by loop ------------------------------------------------------------------


def spec_code_section(codes: np.ndarray, rows_p: int, k_p: int) -> np.ndarray:
    """Logical e2m1 nibbles uint8 [N, K/2] (low nibble = even k), rows in native order -> the
    native FP4 code section: per (group, chunk), 4 row tiles x 32 lanes x 8 little-endian words;
    register j's code of byte i at bit 16*(j//2) + 4i of word 2tt + j%2, for row
    16rt + g + 8*(j%2) and k = 32t + 8tt + 4*(j//2) + i."""
    n, kh = codes.shape
    nib = np.zeros((rows_p, k_p), dtype=np.int64)  # padded codes: 0
    for r in range(n):
        for k in range(2 * kh):
            nib[r, k] = (int(codes[r, k // 2]) >> (4 * (k % 2))) & 15
    out = bytearray()
    for rg in range(rows_p // 64):
        for cc in range(k_p // 128):
            for rt in range(4):
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    words = [0] * 8
                    for tt in range(4):
                        for j in range(4):
                            row = 64 * rg + 16 * rt + g + 8 * (j % 2)
                            for i in range(4):
                                k = 128 * cc + 32 * t + 8 * tt + 4 * (j // 2) + i
                                words[2 * tt + j % 2] |= int(nib[row, k]) << (16 * (j // 2) + 4 * i)
                    for w in words:
                        out += w.to_bytes(4, "little")
    return np.frombuffer(bytes(out), dtype=np.uint8)


def spec_native(lay: NativeRowLayout, sec: dict, e: int, spread: int = 3) -> dict:
    w13 = {k: w13_native_rows(sec[f"w13_{k}"][e], lay.inter) for k in ("codes", "scales")}
    return {
        "w13_codes": spec_code_section(w13["codes"], lay.w13_rows, lay.hidden_p),
        "w13_scales": spec_scale_section(w13["scales"], lay.w13_rows, lay.hidden_p, spread),
        "w2_codes": spec_code_section(sec["w2_codes"][e], lay.w2_rows, lay.inter_p),
        "w2_scales": spec_scale_section(sec["w2_scales"][e], lay.w2_rows, lay.inter_p, spread),
    }


# --- tests ---------------------------------------------------------------------------------------


def test_fp4_layout_attributes_sizes_and_spec() -> None:
    hidden, inter = 160, 96  # w13: 192 rows x K 160 -> 256; w2: 160 rows -> 192 x K 96 -> 128
    lay = NativeRowLayout(hidden, inter, "fp4r")
    assert lay.tier is FP4R and lay.layout_id == NATIVE_FP4_LAYOUT_ID
    assert NATIVE_FP4_LAYOUT_ID == "mma-s8-m16k32-g64c128-e2m1-v1"
    assert lay.spec.startswith(NATIVE_FP4_LAYOUT_ID + "-a256[")
    assert lay.sizes == {
        "w13_codes": 192 * 256 // 2,
        "w13_scales": 3 * 2 * SCALE_CHUNK_BYTES,
        "w2_codes": 192 * 128 // 2,
        "w2_scales": 3 * 1 * SCALE_CHUNK_BYTES,
    }
    assert all(o % 256 == 0 for o in lay.offsets.values())
    mx = NativeRowLayout(hidden, inter, "fp4x-mxfp4")
    assert mx.tier is MXFP4 and mx.layout_id == NATIVE_FP4_LAYOUT_ID and mx.spec == lay.spec
    assert NativeRowLayout(hidden, inter, FP4R).tier is FP4R
    w2 = NativeRowLayout(hidden, inter)
    assert w2.tier is W2 and w2.layout_id == NATIVE_LAYOUT_ID == NativeRowLayout.layout_id
    assert w2.spec.startswith(NATIVE_LAYOUT_ID + "-a256[")
    assert w2.sizes["w13_codes"] == 192 * 256 // 4
    assert [t.name for t in NATIVE_TIERS] == ["w2", "fp4r", "fp4x-mxfp4", "fp4x-nvfp4"]
    assert (FAST_SPREAD, FP4_FAST_SPREAD) == (4, 3)


@pytest.mark.parametrize("hidden,inter", [(256, 64), (160, 96)])
def test_fp4_single_code_lands_at_the_documented_bit(hidden, inter) -> None:
    """One nonzero nibble at a random (row, k), w2 and w13 (gate/up interleaved by 32): the
    native section holds exactly that nibble, at the byte and bit the spec says."""
    lay = NativeRowLayout(hidden, inter, "fp4r")
    rng = np.random.default_rng(hidden)
    zero = {k: np.zeros_like(v) for k, v in fp4_sections(rng, 1, hidden, inter).items()}
    for it in range(120):
        proj = "w2" if it % 2 else "w13"
        sec = {k: v.copy() for k, v in zero.items()}
        n_rows, n_k = (hidden, inter) if proj == "w2" else (2 * inter, hidden)
        row, k = int(rng.integers(0, n_rows)), int(rng.integers(0, n_k))
        code = int(rng.integers(1, 16))
        sec[f"{proj}_codes"][0, row, k // 2] = code << (4 * (k % 2))
        packed = lay.pack(**sec)[0]
        native = native_section(lay, packed, f"{proj}_codes")
        back = lay.views(packed)
        assert all(np.array_equal(back[n], sec[n][0]) for n in sec)
        at = spec_fragment(lay, proj, row, k)
        word_at = (at.tile * 32 + at.lane) * 32 + 4 * (2 * at.tt + at.jl)
        word = int.from_bytes(native[word_at : word_at + 4].tobytes(), "little")
        assert word == code << (16 * at.jh + 4 * at.i), (proj, row, k)
        assert np.count_nonzero(native) == 1


@pytest.mark.parametrize(
    "scale_lo,scale_hi,all_fast",
    [(0, 255, False), (100, 104, True), (1, 5, True), (251, 255, True)],
)
@pytest.mark.parametrize("hidden,inter", [(64, 32), (96, 32), (128, 64), (160, 96), (256, 128)])
def test_fp4_round_trip_numpy_and_torch(hidden, inter, scale_lo, scale_hi, all_fast) -> None:
    """Full-range nibbles with full-range scales (0..254: almost every tile slow) or narrow ones
    (spread <= 3, min >= 1: every tile fast, padding included): byte for byte as the spec says,
    and back exactly, numpy and torch; fp4x-mxfp4 gives the same bytes."""
    rng = np.random.default_rng(hidden * 3 + inter + scale_lo)
    sec = fp4_sections(rng, 2, hidden, inter, scale_lo, scale_hi)
    lay = NativeRowLayout(hidden, inter, "fp4r")
    rows = lay.pack(**sec)
    assert rows.dtype == np.uint8 and rows.shape == (2, lay.row_bytes)
    for e in range(2):
        want = spec_native(lay, sec, e)
        for name, w in want.items():
            assert np.array_equal(native_section(lay, rows[e], name), w), name
        fractions = lay.slow_tile_fractions(rows[e])
        flags = {p: want[f"{p}_scales"].reshape(-1, 264)[:, 256:260] for p in ("w13", "w2")}
        assert fractions == {p: float(f.mean()) for p, f in flags.items()}
        if all_fast:
            assert fractions == {"w13": 0.0, "w2": 0.0}
        elif hidden % 128 == 0 and inter % 128 == 0:  # full range, no padded blocks
            assert fractions["w13"] > 0.9 and fractions["w2"] > 0.9
    rows_t = lay.pack(**{k: torch.from_numpy(v) for k, v in sec.items()})
    assert isinstance(rows_t, torch.Tensor) and np.array_equal(rows_t.numpy(), rows)
    mx = NativeRowLayout(hidden, inter, "fp4x-mxfp4")
    assert np.array_equal(mx.pack(**sec), rows)
    for e in range(2):
        back = lay.views(rows[e])
        back_t = lay.views(torch.from_numpy(rows[e]))
        back_mx = mx.views(rows[e])
        for name, a in sec.items():
            assert back[name].dtype == np.uint8 and np.array_equal(back[name], a[e]), name
            assert torch.equal(back_t[name], torch.from_numpy(a[e])), name
            assert np.array_equal(back_mx[name], a[e]), name


def test_fp4_every_nibble_and_every_scale_byte_round_trip() -> None:
    """Codes bytes 0..255 (so every nibble 0..15 at even and odd k) and scale bytes 0..254."""
    hidden, inter = 256, 128
    lay = NativeRowLayout(hidden, inter, "fp4x-mxfp4")
    sec = fp4_sections(np.random.default_rng(2), 1, hidden, inter, tier="fp4x-mxfp4")
    for name, a in sec.items():
        values = np.arange(255 if "scales" in name else 256, dtype=np.uint8)
        a[...] = np.resize(values, a.shape)
        assert set(np.unique(a)) == set(values.tolist()), name
    rows = lay.pack(**sec)
    back = lay.views(rows[0])
    assert all(np.array_equal(back[k], sec[k][0]) for k in sec)
    want = spec_native(lay, sec, 0)
    assert all(np.array_equal(native_section(lay, rows[0], k), w) for k, w in want.items())


def scale_word_at(section: np.ndarray, row: int, chunk: int, n_chunks: int) -> int:
    rg, rt, r16 = row // 64, (row % 64) // 16, row % 16
    at = (rg * n_chunks + chunk) * 264 + rt * 64 + (r16 % 8) * 8 + 4 * (r16 // 8)
    return int.from_bytes(section[at : at + 4].tobytes(), "little")


def test_fp4_spread_limit_is_3_where_w2_allows_4() -> None:
    """w2 of hidden 64, inter 128: one group of 4 row tiles, one chunk of 4 real blocks. A
    row-chunk of spread 4 is fast for W2 and slow for FP4; spread 3 is fast for both."""
    hidden, inter = 64, 128
    tiers = {t: NativeRowLayout(hidden, inter, t) for t in ("w2", "fp4r", "fp4x-mxfp4")}
    words, flags = {}, {}
    for name, lay in tiers.items():
        sec = {  # W2 rows take their own code shapes; the scales are alike
            k: np.zeros((1, *shape), np.uint8)
            for k, (_, shape) in RowLayout(hidden, inter, lay.tier).sections.items()
        }
        sec["w13_scales"][:] = 120
        s = sec["w2_scales"][0]
        s[:] = 120
        s[3] = (100, 104, 101, 102)  # tile 0: spread exactly 4 -> fast for W2, slow for FP4
        s[20] = (100, 103, 100, 101)  # tile 1: spread 3 -> fast for both
        s[40] = (0, 1, 1, 1)  # tile 2: a zero scale -> slow for both
        s[63] = (1, 4, 3, 2)  # tile 3: b_min 1, spread 3 -> fast for both
        native = lay.pack(**sec)[0]
        sc = native_section(lay, native, "w2_scales")
        flags[name] = list(sc[256:264])
        words[name] = [scale_word_at(sc, r, 0, 1) for r in range(64)]
        assert lay.slow_tile_fractions(native)["w13"] == 0.0
        assert slow_tile_fraction(sc) == lay.slow_tile_fractions(native)["w2"]
        assert np.array_equal(lay.views(native)["w2_scales"], s)
    assert flags["w2"] == [0, 0, 1, 0, 0, 0, 0, 0]
    assert flags["fp4r"] == flags["fp4x-mxfp4"] == [1, 0, 1, 0, 0, 0, 0, 0]
    assert words["fp4r"] == words["fp4x-mxfp4"]
    w2, fp4 = words["w2"], words["fp4r"]
    assert w2[3] == 100 << 23 | 1 | 16 << 5 | 2 << 10 | 4 << 15
    assert fp4[3] == 100 | 104 << 8 | 101 << 16 | 102 << 24
    assert fp4[0] == 120 | 120 << 8 | 120 << 16 | 120 << 24  # the whole tile goes slow
    assert w2[0] == 120 << 23 | 1 | 1 << 5 | 1 << 10 | 1 << 15
    for w in (w2, fp4):
        assert w[20] == 100 << 23 | 1 | 8 << 5 | 1 << 10 | 2 << 15
        assert w[63] == 1 << 23 | 1 | 8 << 5 | 4 << 10 | 2 << 15
        assert w[40] == 0 | 1 << 8 | 1 << 16 | 1 << 24
    # the limit is a parameter of the packing functions, not a switch
    b = torch.tensor([100, 104, 101, 102], dtype=torch.uint8).expand(1, 16, 1, 4)
    _, slow4 = native_scale_words(b, spread=4)
    _, slow3 = native_scale_words(b, spread=3)
    assert not slow4.any() and slow3.all()
    codes = torch.zeros(1, 64, 64, dtype=torch.uint8)
    scales = b.reshape(1, 16, 4).repeat(1, 4, 1)
    assert native_matrix(codes, scales, 64, 128, code_format="e2m1", spread=3)[1][0, 256] == 1
    assert native_matrix(codes, scales, 64, 128, code_format="e2m1", spread=4)[1][0, 256] == 0
    assert native_matrix(codes, scales, 64, 128, code_format="e2m1")[1][0, 256] == 0  # W2's 4
    with pytest.raises(ValueError, match="spread"):
        native_scale_words(b, spread=5)
    with pytest.raises(ValueError, match="code format"):
        native_matrix(codes, scales, 64, 128, code_format="nvfp4")


@pytest.mark.parametrize("scale", [1, 10, 127, 200, 254])
def test_fp4_padding_never_makes_a_tile_slow(scale) -> None:
    """hidden 160, inter 96 with uniform scales, then narrow (spread <= 3) ones: no slow tile,
    every byte as the spec says, padded codes 0."""
    hidden, inter = 160, 96
    lay = NativeRowLayout(hidden, inter, "fp4r")
    rng = np.random.default_rng(scale)
    sec = fp4_sections(rng, 1, hidden, inter)
    for name in ("w13_scales", "w2_scales"):
        sec[name][:] = scale
    rows = lay.pack(**sec)
    assert lay.slow_tile_fractions(rows[0]) == {"w13": 0.0, "w2": 0.0}
    want = spec_native(lay, sec, 0)
    assert all(np.array_equal(native_section(lay, rows[0], k), w) for k, w in want.items())
    for name in ("w13_scales", "w2_scales"):
        sec[name] = rng.integers(scale - min(scale, 3) + 1, scale + 1, sec[name].shape, np.uint8)
    rows = lay.pack(**sec)
    assert lay.slow_tile_fractions(rows[0]) == {"w13": 0.0, "w2": 0.0}
    assert all(np.array_equal(lay.views(rows[0])[k], sec[k][0]) for k in sec)


@pytest.mark.parametrize("tier", ["fp4r-refine", "bogus", FP4R_REFINE, None])
def test_fp4_unsupported_tiers_are_refused(tier) -> None:
    supported = r"supports the tiers 'w2', 'fp4r', 'fp4x-mxfp4', 'fp4x-nvfp4'$"
    with pytest.raises(ValueError, match=supported):
        NativeRowLayout(64, 32, tier)


@pytest.mark.parametrize("tier", FP4_TIERS)
def test_fp4_pack_refusals(tier) -> None:
    hidden, inter = 96, 32
    lay = NativeRowLayout(hidden, inter, tier)
    sec = fp4_sections(np.random.default_rng(1), 1, hidden, inter, 1, 254, tier=tier)
    lay.pack(**sec)
    for name in ("w13_scales", "w2_scales"):
        bad = {k: v.copy() for k, v in sec.items()}
        bad[name][0, 5, 0] = 255
        with pytest.raises(ValueError, match="255"):
            lay.pack(**bad)
        with pytest.raises(ValueError, match="255"):
            lay.pack(**{k: torch.from_numpy(v) for k, v in bad.items()})
    w2_shaped = dict(sec, w13_codes=np.zeros((1, 64, 24), np.uint8))  # W2's [N, K/4]
    with pytest.raises(ValueError, match=r"w13_codes: expected uint8 \[1, 64, 48\]"):
        lay.pack(**w2_shaped)
    with pytest.raises(ValueError, match="rows take the sections"):
        lay.pack(**dict(sec, w13_scale_2=np.zeros((1, 64), np.float32)))
    with pytest.raises(ValueError, match="rows take the sections"):
        lay.pack(**{k: v for k, v in sec.items() if k != "w2_scales"})
    with pytest.raises(ValueError, match="multiples of 32"):
        NativeRowLayout(100, 32, tier)


def test_w2_tier_argument_is_the_default_byte_for_byte() -> None:
    rng = np.random.default_rng(4)
    lay = RowLayout(160, 96)
    sec = {
        n: rng.integers(*((1, 6) if "scales" in n else (0, 256)), (2, *s), dtype=np.uint8)
        for n, (_, s) in lay.sections.items()
    }
    default, named = NativeRowLayout(160, 96), NativeRowLayout(160, 96, "w2")
    assert np.array_equal(default.pack(**sec), named.pack(**sec))
    assert default.spec == named.spec and named.tier is W2
    # spread 4 stays fast for W2 (scales 1..5)
    assert default.slow_tile_fractions(default.pack(**sec)[0]) == {"w13": 0.0, "w2": 0.0}
