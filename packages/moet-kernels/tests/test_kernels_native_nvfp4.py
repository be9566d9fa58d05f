"""The NVFP4 kernel-native row layout (`NativeRowLayout(hidden, inter, "fp4x-nvfp4")`,
`NATIVE_NVFP4_LAYOUT_ID`), checked against an encoder written out from its spec (layout.py
docstring) loop by loop, and the op over NVFP4 pools on the CPU against a float64 loop with its
own e2m1 / e4m3 decoders."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from moet_kernels.layout import (
    NATIVE_NVFP4_LAYOUT_ID,
    NATIVE_TIERS,
    NVFP4,
    NativeRowLayout,
    RowLayout,
)
from moet_kernels.ops import w2_moe_slots
from moet_kernels.reference import w2_dequant

TIER = "fp4x-nvfp4"
SECTION_ORDER = ("w13_codes", "w13_scales", "w2_codes", "w2_scales")
VALID_E4M3 = np.array([*range(0x7F), 0x80], dtype=np.uint8)  # finite, non-negative (0x80 = -0)


def nvfp4_sections(rng, n_experts, hidden, inter, scale_bytes=VALID_E4M3, s2_range=(0.01, 4.0)):
    """Random logical NVFP4 sections: codes bytes 0..255 (every nibble), e4m3 scale bytes drawn
    from `scale_bytes`, positive float32 scale_2 in `s2_range`."""
    out = {}
    for name, (_, shape) in RowLayout(hidden, inter, TIER).sections.items():
        size = (n_experts, *shape)
        if name.endswith("_scale_2"):
            out[name] = rng.uniform(*s2_range, size).astype(np.float32)
        elif name.endswith("_scales"):
            out[name] = rng.choice(np.asarray(scale_bytes, dtype=np.uint8), size)
        else:
            out[name] = rng.integers(0, 256, size, dtype=np.uint8)
    return out


# --- the spec, loop by loop ------------------------------------------------------------------


def ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def native_row_source(proj: str, native_row: int, hidden: int, inter: int) -> int | None:
    """The logical row a native row holds (None: a padded row). w13: native row 64u + q is gate
    row 32u + q for q < 32, else up row inter + 32u + q - 32; w2: the same row, rows >= hidden
    padded."""
    if proj == "w2":
        return native_row if native_row < hidden else None
    u, q = divmod(native_row, 64)
    return 32 * u + q if q < 32 else inter + 32 * u + q - 32


def spec_sections(lay_dims: tuple[int, int], sec: dict, e: int) -> dict[str, bytes]:
    """One expert's four native sections, built from the spec with plain loops."""
    hidden, inter = lay_dims
    out = {}
    for proj, n_rows, k in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
        rows_p, k_p = ceil_to(n_rows, 64), ceil_to(k, 128)
        codes, scales = sec[f"{proj}_codes"][e], sec[f"{proj}_scales"][e]
        scale_2 = sec[f"{proj}_scale_2"][e]
        nib = [[0] * k_p for _ in range(rows_p)]  # padding: code 0
        blk = [[0] * (k_p // 16) for _ in range(rows_p)]  # padding: scale byte 0
        s2 = [0.0] * rows_p  # padding: scale_2 0.0
        for r in range(rows_p):
            src = native_row_source(proj, r, hidden, inter)
            if src is None or src >= n_rows:
                continue
            for kk in range(k):
                nib[r][kk] = (int(codes[src, kk // 2]) >> (4 * (kk % 2))) & 0xF
            for b in range(k // 16):
                blk[r][b] = int(scales[src, b])
            s2[r] = float(scale_2[src])
        code_bytes, scale_bytes = bytearray(), bytearray()
        for rg in range(rows_p // 64):
            for cc in range(k_p // 128):
                for rt in range(4):
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        r0 = 64 * rg + 16 * rt + g
                        for kt in range(8):
                            word = 0
                            for i in range(4):
                                kk = 128 * cc + 16 * kt + 4 * t + i
                                word |= nib[r0][kk] << (4 * i)
                                word |= nib[r0 + 8][kk] << (4 * (4 + i))
                            code_bytes += word.to_bytes(4, "little")
            for q in range(64):  # the group's head: 64 little-endian float32 scale_2
                scale_bytes += struct.pack("<f", s2[64 * rg + q])
            for cc in range(k_p // 128):
                chunk = bytearray(512)
                for rt in range(4):
                    for g in range(8):
                        for kt in range(8):
                            for j in range(2):
                                row = 64 * rg + 16 * rt + g + 8 * j
                                chunk[rt * 128 + g * 16 + 2 * kt + j] = blk[row][8 * cc + kt]
                scale_bytes += chunk
        out[f"{proj}_codes"], out[f"{proj}_scales"] = bytes(code_bytes), bytes(scale_bytes)
    return out


def spec_row(hidden: int, inter: int, sec: dict, e: int) -> np.ndarray:
    """The whole native row: the sections in order, each on a 256-byte boundary, zeros between."""
    parts = spec_sections((hidden, inter), sec, e)
    row = bytearray()
    for name in SECTION_ORDER:
        row += parts[name]
        row += bytes(ceil_to(len(row), 256) - len(row))
    return np.frombuffer(bytes(row), dtype=np.uint8)


# --- an independent float64 decoder ----------------------------------------------------------


def e2m1_value(nibble: int) -> float:
    mag = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)[nibble & 7]
    return -mag if nibble & 8 else mag


def e4m3_value(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 7
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


E2M1_TABLE = np.array([e2m1_value(n) for n in range(16)])
E4M3_TABLE = np.array([e4m3_value(b) for b in range(256)])


def nvfp4_weights(codes, scales, scale_2) -> np.ndarray:
    """float64 [N, K]: e2m1 x e4m3 (per 16 along K) x scale_2 (per row)."""
    codes = np.asarray(codes)
    nib = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(codes.shape[0], -1)
    s = E4M3_TABLE[np.asarray(scales)].repeat(16, axis=-1)
    return E2M1_TABLE[nib] * s * np.asarray(scale_2, dtype=np.float64)[:, None]


def float64_moe(x, ids, w, weights_of, hidden, inter) -> np.ndarray:
    """The MoE in float64 from each expert's (w13 [2I, H], w2 [H, I]), None for a miss."""
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros((x.shape[0], hidden))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            ws = weights_of(int(ids[t, j]))
            if ws is None:
                continue
            gu = ws[0] @ x[t]
            gate, up = gu[:inter], gu[inter:]
            out[t] += float(w[t, j]) * (ws[1] @ (gate / (1 + np.exp(-gate)) * up))
    return out


def pool_of(rng, rows: np.ndarray, resident, n_experts: int):
    """A torch pool holding the `resident` experts in shuffled slots, garbage in the others (any
    bytes, NaN scales included: never read); its int32 slot table (-1: not resident)."""
    n_slots = n_experts + 2
    pool = torch.from_numpy(rng.integers(0, 256, (n_slots, rows.shape[1]), dtype=np.uint8))
    table = torch.full((n_experts,), -1, dtype=torch.int32)
    for e, slot in zip(resident, rng.permutation(n_slots)[: len(resident)], strict=False):
        pool[slot] = torch.from_numpy(rows[e])
        table[e] = int(slot)
    return pool, table


# --- tests -----------------------------------------------------------------------------------


def test_nvfp4_layout_attributes_sizes_and_spec() -> None:
    hidden, inter = 160, 64  # w13: 128 rows x K 160 -> 256; w2: 160 rows -> 192 x K 64 -> 128
    lay = NativeRowLayout(hidden, inter, TIER)
    assert NATIVE_NVFP4_LAYOUT_ID == "mma-s8-m16k16-g64c128-e2m1-e4m3b16-v1"
    assert lay.tier is NVFP4 and lay.layout_id == NATIVE_NVFP4_LAYOUT_ID
    assert NativeRowLayout(hidden, inter, NVFP4).tier is NVFP4
    assert NVFP4 in NATIVE_TIERS
    assert lay.fast_spread is None and lay.code_format == "e2m1"
    assert lay.sizes == {
        "w13_codes": 128 * 256 // 2,
        "w13_scales": 2 * (256 + 2 * 512),
        "w2_codes": 192 * 128 // 2,
        "w2_scales": 3 * (256 + 1 * 512),
    }
    assert lay.offsets == {"w13_codes": 0, "w13_scales": 16384, "w2_codes": 18944,
                           "w2_scales": 31232}  # fmt: skip
    assert lay.row_bytes == 31232 + 2304
    assert lay.spec == (
        f"{NATIVE_NVFP4_LAYOUT_ID}-a256[w13_codes@0:16384,w13_scales@16384:2560,"
        "w2_codes@18944:12288,w2_scales@31232:2304]"
    )
    # the logical NVFP4 layout is a different (longer-named) id and not what the kernels read
    assert RowLayout(hidden, inter, TIER).layout_id != lay.layout_id


@pytest.mark.parametrize("hidden,inter", [(160, 64), (128, 32), (96, 96)])
def test_nvfp4_pack_matches_the_spec_byte_for_byte(hidden, inter) -> None:
    """Random codes (every byte), every valid e4m3 byte, random scale_2: the packed rows equal
    the spec loop's, padding (K to 128, w2 rows to 64) and the w13 gate/up interleave included."""
    rng = np.random.default_rng(hidden * 1000 + inter)
    lay = NativeRowLayout(hidden, inter, TIER)
    sec = nvfp4_sections(rng, 2, hidden, inter)
    rows = lay.pack(**sec)
    assert isinstance(rows, np.ndarray) and rows.dtype == np.uint8
    assert rows.shape == (2, lay.row_bytes)
    for e in range(2):
        want = spec_row(hidden, inter, sec, e)
        assert want.shape == (lay.row_bytes,)
        for name in SECTION_ORDER:  # section by section first, for a readable failure
            lo, n = lay.offsets[name], lay.sizes[name]
            got = rows[e, lo : lo + n]
            bad = np.flatnonzero(got != want[lo : lo + n])
            assert bad.size == 0, f"{name}: {bad.size} bytes differ, first at {bad[:5]}"
        assert np.array_equal(rows[e], want)


def test_nvfp4_pack_torch_matches_numpy() -> None:
    rng = np.random.default_rng(3)
    hidden, inter = 160, 64
    lay = NativeRowLayout(hidden, inter, TIER)
    sec = nvfp4_sections(rng, 3, hidden, inter)
    rows = lay.pack(**sec)
    trows = lay.pack(**{k: torch.from_numpy(v) for k, v in sec.items()})
    assert isinstance(trows, torch.Tensor) and trows.dtype == torch.uint8
    assert np.array_equal(trows.numpy(), rows)
    mixed = lay.pack(**{k: torch.from_numpy(v) if "codes" in k else v for k, v in sec.items()})
    assert isinstance(mixed, np.ndarray) and np.array_equal(mixed, rows)


@pytest.mark.parametrize(
    "hidden,inter,n_experts", [(64, 32, 3), (160, 64, 2), (96, 96, 2), (4096, 1536, 1)]
)
@pytest.mark.parametrize("as_torch", [False, True])
def test_nvfp4_views_invert_pack_exactly(hidden, inter, n_experts, as_torch) -> None:
    rng = np.random.default_rng(hidden + inter)
    lay = NativeRowLayout(hidden, inter, TIER)
    sec = nvfp4_sections(rng, n_experts, hidden, inter)
    # scale_2 bit patterns a float path could disturb: 0, -0, a float32 subnormal, the max
    for name in ("w13_scale_2", "w2_scale_2"):
        sec[name][0, :4] = np.array([0.0, -0.0, 1e-45, 3.4028235e38], dtype=np.float32)
    inputs = {k: torch.from_numpy(v) for k, v in sec.items()} if as_torch else sec
    rows = lay.pack(**inputs)
    assert isinstance(rows, torch.Tensor) == as_torch
    assert lay.slow_tile_fractions(rows[0]) == {"w13": 0.0, "w2": 0.0}
    for e in range(n_experts):
        views = lay.views(rows[e])
        assert set(views) == set(sec)
        for name, want in sec.items():
            got = views[name]
            assert isinstance(got, torch.Tensor) == as_torch, name
            got = got.numpy() if as_torch else got
            assert got.dtype == want.dtype and got.shape == want.shape[1:], name
            assert np.array_equal(got.view(np.uint8), want[e].view(np.uint8)), name  # bitwise


def test_nvfp4_padding_is_zero() -> None:
    """Every byte the logical sections do not fill is 0: with all-0xFF codes, the largest
    finite scale (0x7e) and scale_2 1.0 everywhere, the row is the spec's (zeros where it pads)."""
    hidden, inter = 160, 64
    lay = NativeRowLayout(hidden, inter, TIER)
    sec = {
        name: np.full((1, *shape), 1.0 if name.endswith("scale_2") else 0xFF, dtype)
        for name, (_, shape), dtype in (
            (n, s, np.float32 if n.endswith("scale_2") else np.uint8)
            for n, s in RowLayout(hidden, inter, TIER).sections.items()
        )
    }
    for name in ("w13_scales", "w2_scales"):
        sec[name][:] = 0x7E
    row = lay.pack(**sec)[0]
    assert np.array_equal(row, spec_row(hidden, inter, sec, 0))
    w2 = row[lay.offsets["w2_scales"] : lay.offsets["w2_scales"] + lay.sizes["w2_scales"]]
    head2 = w2[2 * 768 : 2 * 768 + 256].view("<f4")  # group 2 holds rows 128..191: 160.. padded
    assert np.array_equal(head2, [1.0] * 32 + [0.0] * 32)
    assert int(row.astype(np.int64).sum()) == int(spec_row(hidden, inter, sec, 0).sum())


@pytest.mark.parametrize("as_torch", [False, True])
@pytest.mark.parametrize(
    "name,index,value",
    [
        ("w13_scales", (0, 3, 1), 0x7F),  # +NaN
        ("w13_scales", (0, 70, 9), 0xFF),  # -NaN
        ("w2_scales", (0, 5, 0), 0x81),  # negative
        ("w2_scales", (0, 159, 3), 0xFF),
        ("w2_scales", (0, 0, 0), 0xC0),
        ("w13_scale_2", (0, 7), np.nan),
        ("w13_scale_2", (0, 127), np.inf),
        ("w2_scale_2", (0, 1), -np.inf),
        ("w2_scale_2", (0, 159), -1.0),
        ("w2_scale_2", (0, 2), -1e-45),
    ],
)
def test_nvfp4_pack_refuses_nan_or_negative_scales(name, index, value, as_torch) -> None:
    hidden, inter = 160, 64
    lay = NativeRowLayout(hidden, inter, TIER)
    sec = nvfp4_sections(np.random.default_rng(9), 1, hidden, inter)
    lay.pack(**sec)  # valid as drawn
    sec[name][index] = value
    inputs = {k: torch.from_numpy(v) for k, v in sec.items()} if as_torch else sec
    with pytest.raises(ValueError, match=rf"^{name}: .*(NaN|negative)"):
        lay.pack(**inputs)


def test_nvfp4_pack_accepts_the_edge_values() -> None:
    """-0 (0x80), the largest finite e4m3 (0x7e), subnormal e4m3 (0x01), scale 0, scale_2 0 and
    -0.0 are all valid: they pack, and come back."""
    hidden, inter = 64, 32
    lay = NativeRowLayout(hidden, inter, TIER)
    sec = nvfp4_sections(np.random.default_rng(2), 1, hidden, inter)
    for name in ("w13_scales", "w2_scales"):
        sec[name][0, :4, 0] = [0x80, 0x7E, 0x01, 0x00]
    for name in ("w13_scale_2", "w2_scale_2"):
        sec[name][0, :2] = [0.0, -0.0]
    views = lay.views(lay.pack(**sec)[0])
    assert all(np.array_equal(views[k].view(np.uint8), sec[k][0].view(np.uint8)) for k in sec)


@pytest.mark.parametrize(
    "name,bad,expect",
    [
        ("w13_scale_2", lambda a: a.astype(np.float64), r"expected float32 \[1, 128\], found float64"),
        ("w2_scale_2", lambda a: a.astype(np.float16), r"expected float32 \[1, 160\], found float16"),
        ("w13_codes", lambda a: a.astype(np.int16), r"expected uint8 \[1, 128, 80\], found int16"),
        ("w2_scales", lambda a: a.astype(np.int8), r"expected uint8 \[1, 160, 4\], found int8"),
        ("w13_scales", lambda a: a[:, :, :5], r"expected uint8 \[1, 128, 10\], found uint8 \[1, 128, 5\]"),
        ("w2_codes", lambda a: a[:, :128], r"expected uint8 \[1, 160, 32\], found uint8 \[1, 128, 32\]"),
        ("w2_scale_2", lambda a: a[:, :, None], r"expected float32 \[1, 160\], found float32 \[1, 160, 1\]"),
        ("w13_scale_2", lambda a: np.concatenate([a, a]), r"expected float32 \[1, 128\], found float32 \[2, 128\]"),
    ],
)  # fmt: skip
def test_nvfp4_pack_refuses_wrong_dtypes_and_shapes(name, bad, expect) -> None:
    hidden, inter = 160, 64
    lay = NativeRowLayout(hidden, inter, TIER)
    sec = nvfp4_sections(np.random.default_rng(4), 1, hidden, inter)
    sec[name] = bad(sec[name])
    with pytest.raises(ValueError, match=rf"^{name}: {expect}"):
        lay.pack(**sec)


@pytest.mark.parametrize("name", SECTION_ORDER + ("w13_scale_2", "w2_scale_2"))
def test_nvfp4_pack_refuses_a_missing_section(name) -> None:
    lay = NativeRowLayout(64, 32, TIER)
    sec = nvfp4_sections(np.random.default_rng(5), 1, 64, 32)
    del sec[name]
    with pytest.raises(ValueError, match=r"fp4x-nvfp4 rows take the sections") as info:
        lay.pack(**sec)
    want, got = str(info.value).split(", got ")
    assert f"'{name}'" in want and f"'{name}'" not in got


def test_nvfp4_pack_refuses_another_tiers_sections() -> None:
    lay = NativeRowLayout(64, 32, TIER)
    sec = nvfp4_sections(np.random.default_rng(6), 1, 64, 32)
    with pytest.raises(ValueError, match=r"take the sections .*got .*'w13_refine'"):
        lay.pack(**sec, w13_refine=np.zeros((1, 64, 20), np.uint8))
    mx = RowLayout(64, 32, "fp4x-mxfp4").sections  # MXFP4 sections (no scale_2, scales per 32)
    mx_sec = {n: np.zeros((1, *s), np.uint8) for n, (_, s) in mx.items()}
    with pytest.raises(ValueError, match="take the sections"):
        lay.pack(**mx_sec)


# --- the op on the CPU -----------------------------------------------------------------------

OP_E, OP_TOP_K, OP_TOKENS = 8, 3, 9

SCALE_SETS = {
    "normal": np.arange(0x30, 0x41),  # 0.5 .. 2.25
    "subnormal": np.array([0x00, 0x01, 0x03, 0x05, 0x07, 0x08, 0x80]),  # with 2**-6 and 0, -0
    "wide": VALID_E4M3,  # every finite value, 2**-9 .. 448
}


def op_args(rng, hidden, inter, n_tokens=OP_TOKENS):
    x = torch.from_numpy(rng.standard_normal((n_tokens, hidden)).astype(np.float32))
    ids = torch.from_numpy(np.stack([rng.permutation(OP_E)[:OP_TOP_K] for _ in range(n_tokens)]))
    w = torch.from_numpy(rng.random((n_tokens, OP_TOP_K)).astype(np.float32))
    return x, ids, w


def check_counters(ids, n_real, resident, miss, routed) -> None:
    real = ids[:n_real].numpy()
    assert int(miss[0]) == int(sum(e not in resident for e in real.flatten()))
    assert routed.tolist() == [int(e in set(real.flatten().tolist())) for e in range(OP_E)]


def assert_close(got: torch.Tensor, want: np.ndarray) -> None:
    got = got.double().numpy()
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-4, err
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("scales", list(SCALE_SETS))
@pytest.mark.parametrize("hidden,inter", [(160, 64), (128, 32)])
def test_op_over_an_nvfp4_pool_is_the_float64_loop(hidden, inter, scales) -> None:
    rng = np.random.default_rng(17)
    s2_range = (2.0**6, 2.0**8) if scales == "subnormal" else (2.0**-4, 2.0**-1)
    if scales == "wide":
        s2_range = (2.0**-8, 2.0**-6)
    sec = nvfp4_sections(rng, OP_E, hidden, inter, SCALE_SETS[scales], s2_range)
    lay = NativeRowLayout(hidden, inter, TIER)
    resident = [0, 2, 3, 5, 6]  # 1, 4, 7 are misses
    pool, table = pool_of(rng, lay.pack(**sec), resident, OP_E)
    x, ids, w = op_args(rng, hidden, inter)
    n_real = OP_TOKENS - 2
    miss, routed = torch.zeros(1, dtype=torch.int32), torch.zeros(OP_E, dtype=torch.uint8)
    got = w2_moe_slots(x, ids, w, pool, table, hidden, inter,
                       torch.tensor([n_real], dtype=torch.int32), miss, routed, tier=TIER)  # fmt: skip
    assert got.dtype == torch.float32 and got.shape == (OP_TOKENS, hidden)

    def weights_of(e):
        if e not in resident:
            return None
        return tuple(
            nvfp4_weights(sec[f"{p}_codes"][e], sec[f"{p}_scales"][e], sec[f"{p}_scale_2"][e])
            for p in ("w13", "w2")
        )

    want = float64_moe(x.numpy(), ids, w, weights_of, hidden, inter)
    assert_close(got, want)
    check_counters(ids, n_real, resident, miss, routed)
    # gate and up keep their own scale_2: swapping them changes the answer
    swapped = {k: v.copy() for k, v in sec.items()}
    swapped["w13_scale_2"] = np.concatenate(
        [sec["w13_scale_2"][:, inter:], sec["w13_scale_2"][:, :inter]], axis=1
    )
    pool2, rows2 = pool.clone(), lay.pack(**swapped)
    for e in resident:
        pool2[int(table[e])] = torch.from_numpy(rows2[e])
    other = w2_moe_slots(x, ids, w, pool2, table, hidden, inter,
                         torch.tensor([n_real], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                         torch.zeros(OP_E, dtype=torch.uint8), tier=TIER)  # fmt: skip
    assert np.abs(other.double().numpy() - want).max() > 1e-3 * np.abs(want).max()


def w2_sections(rng, hidden, inter):
    """Random logical W2 sections: codes every byte, UE8M0 scales 118..125."""
    return {
        name: rng.integers(*((118, 126) if "scales" in name else (0, 256)), (OP_E, *shape),
                           dtype=np.uint8)
        for name, (_, shape) in RowLayout(hidden, inter).sections.items()
    }  # fmt: skip


@pytest.mark.parametrize("hidden,inter", [(160, 64), (128, 32)])
def test_op_prefers_its_nvfp4_pool_over_the_w2_pool(hidden, inter) -> None:
    """fp4_pool (NVFP4) > pool (W2) > miss, per expert."""
    rng = np.random.default_rng(23)
    s4 = nvfp4_sections(rng, OP_E, hidden, inter, SCALE_SETS["normal"], (2.0**-4, 2.0**-1))
    s2 = w2_sections(rng, hidden, inter)
    lay4, lay2 = NativeRowLayout(hidden, inter, TIER), NativeRowLayout(hidden, inter)
    in_fp4, in_w2 = [1, 2, 5], [0, 2, 3, 5, 6]  # 2, 5 in both: NVFP4 wins; 4, 7 missing
    pool4, table4 = pool_of(rng, lay4.pack(**s4), in_fp4, OP_E)
    pool2, table2 = pool_of(rng, lay2.pack(**s2), in_w2, OP_E)
    x, ids, w = op_args(rng, hidden, inter)
    ids[0] = torch.tensor([2, 4, 6])  # one of each kind in the first real token
    n_real = OP_TOKENS - 1
    miss, routed = torch.zeros(1, dtype=torch.int32), torch.zeros(OP_E, dtype=torch.uint8)
    got = w2_moe_slots(x, ids, w, pool2, table2, hidden, inter,
                       torch.tensor([n_real], dtype=torch.int32), miss, routed, "w2",
                       fp4_pool=pool4, fp4_slot_table=table4, fp4_tier=TIER)  # fmt: skip

    def w2_row(e):  # expert e's W2 weights, float64
        return tuple(
            w2_dequant(torch.from_numpy(s2[f"{p}_codes"][e]), torch.from_numpy(s2[f"{p}_scales"][e]))
            .double()
            .numpy()
            for p in ("w13", "w2")
        )  # fmt: skip

    def weights_of(e):
        if e in in_fp4:
            return tuple(
                nvfp4_weights(s4[f"{p}_codes"][e], s4[f"{p}_scales"][e], s4[f"{p}_scale_2"][e])
                for p in ("w13", "w2")
            )
        return w2_row(e) if e in in_w2 else None

    want = float64_moe(x.numpy(), ids, w, weights_of, hidden, inter)
    assert_close(got, want)
    check_counters(ids, n_real, in_fp4 + in_w2, miss, routed)

    def w2_weights(e):  # the W2 row for the experts in both tiers: not what the op must do
        return w2_row(e) if e in in_w2 else weights_of(e)

    not_preferred = float64_moe(x.numpy(), ids, w, w2_weights, hidden, inter)
    assert np.abs(not_preferred - want).max() > 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("as_torch", [False, True])
def test_nvfp4_views_of_a_row_at_any_byte_offset(as_torch) -> None:
    """A pool may be wider than a row (`_check_args`: >= row_bytes), so a slot can start at any
    byte: views still reads every section, scale_2 included."""
    hidden, inter = 64, 32  # one 64-row group per matrix
    lay = NativeRowLayout(hidden, inter, TIER)
    sec = nvfp4_sections(np.random.default_rng(8), 1, hidden, inter)
    pool = np.zeros((2, lay.row_bytes + 1), np.uint8)
    pool[1, : lay.row_bytes] = lay.pack(**sec)[0]
    row = torch.from_numpy(pool)[1] if as_torch else pool[1]
    views = lay.views(row)
    for name, want in sec.items():
        got = views[name].numpy() if as_torch else views[name]
        assert np.array_equal(got.view(np.uint8), want[0].view(np.uint8)), name
