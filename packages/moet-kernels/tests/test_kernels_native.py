"""The kernel-native row layout, the kernel-mode reference and the op's CPU path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moet_kernels.layout import NATIVE_LAYOUT_ID, NativeRowLayout, RowLayout
from moet_kernels.ops import w2_moe_slots
from moet_kernels.reference import (
    LEVELS,
    quantize_activations,
    w2_dequant,
    w2_moe_reference,
    w2_moe_slots_reference,
)


def logical_sections(rng, n_experts, hidden, inter, scale_lo=0, scale_hi=255):
    lay = RowLayout(hidden, inter)
    return {
        name: rng.integers(
            *((scale_lo, scale_hi) if "scales" in name else (0, 256)),
            size=(n_experts, *shape),
            dtype=np.uint8,
        )
        for name, (_, shape) in lay.sections.items()
    }


@pytest.mark.parametrize("hidden,inter", [(64, 32), (96, 32), (128, 64), (160, 96), (384, 256)])
def test_native_round_trip_numpy_and_torch(hidden, inter) -> None:
    rng = np.random.default_rng(hidden + inter)
    sec = logical_sections(rng, 3, hidden, inter)
    lay = NativeRowLayout(hidden, inter)
    rows = lay.pack(**sec)
    assert rows.dtype == np.uint8 and rows.shape == (3, lay.row_bytes)
    rows_t = lay.pack(**{k: torch.from_numpy(v) for k, v in sec.items()})
    assert isinstance(rows_t, torch.Tensor) and np.array_equal(rows_t.numpy(), rows)
    for e in range(3):
        back = lay.views(rows[e])
        back_t = lay.views(torch.from_numpy(rows[e]))
        for name, a in sec.items():
            assert np.array_equal(back[name], a[e]), name
            assert torch.equal(back_t[name], torch.from_numpy(a[e])), name
    assert all(o % 256 == 0 for o in lay.offsets.values())
    assert lay.spec.startswith(NATIVE_LAYOUT_ID)


def test_native_bit_positions_follow_the_documented_formula() -> None:
    """One code at a time lands where the layout docstring says (computed independently)."""
    hidden, inter = 256, 32
    lay = NativeRowLayout(hidden, inter)
    rng = np.random.default_rng(0)
    for _ in range(40):
        sec = {k: np.zeros_like(v) for k, v in logical_sections(rng, 1, hidden, inter).items()}
        row, k = int(rng.integers(0, hidden)), int(rng.integers(0, inter))
        code = int(rng.integers(1, 4))
        sec["w2_codes"][0, row, k // 4] = code << (2 * (k % 4))  # down projection [H, I]
        native = lay.pack(**sec)[0]
        codes = native[lay.offsets["w2_codes"] : lay.offsets["w2_codes"] + lay.sizes["w2_codes"]]
        group, rt, r16 = row // 64, (row % 64) // 16, row % 16
        g, jl = r16 % 8, r16 // 8
        chunk, tt, kk = k // 128, (k % 128) // 32, k % 32
        jh, tig, i = kk // 16, (kk % 16) // 4, kk % 4
        lane = 4 * g + tig
        n_chunks = lay.inter_p // 128
        word_at = (((group * n_chunks + chunk) * 4 + rt) * 32 + lane) * 16 + 4 * tt
        word = int.from_bytes(codes[word_at : word_at + 4].tobytes(), "little")
        bit = 16 * jh + 4 * i + 2 * jl
        assert word == code << bit, (row, k)
        assert np.count_nonzero(codes) == 1


def test_native_padding_and_refusals() -> None:
    hidden, inter = 96, 32  # K = 96 pads to 128, 96 rows of w2 pad to 128
    lay = NativeRowLayout(hidden, inter)
    sec = {
        k: np.zeros_like(v)
        for k, v in logical_sections(np.random.default_rng(1), 1, 96, 32).items()
    }
    for name in ("w13_scales", "w2_scales"):
        sec[name][:] = 120
    native = torch.from_numpy(lay.pack(**sec)[0])
    s2 = native[lay.offsets["w2_scales"] : lay.offsets["w2_scales"] + lay.sizes["w2_scales"]]
    # 96 real rows x 1 real block of scale 120; padding (rows 96..127, blocks 1..3) is 127
    assert int((s2 == 120).sum()) == 96 and int((s2 == 127).sum()) == s2.numel() - 96
    sec["w2_scales"][0, 5, 0] = 255
    with pytest.raises(ValueError, match="255"):
        lay.pack(**sec)
    with pytest.raises(ValueError, match="multiples of 32"):
        NativeRowLayout(100, 32)
    bad = dict(sec, w13_codes=np.zeros((1, 64, 23), np.uint8))
    with pytest.raises(ValueError, match=r"w13_codes: expected uint8 \[1, 64, 24\]"):
        lay.pack(**bad)


def test_quantize_activations_rounding_zero_and_nan() -> None:
    x = torch.zeros(3, 64)
    x[0, :32] = torch.linspace(-1.0, 1.0, 32)
    x[0, 5] = 63.5 / 127  # x / s is 63.5 with s = 1/127 (amax 1): half-way, rounds to even
    x[1, 40] = float("nan")
    q, s = quantize_activations(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (3, 2)
    assert s[0, 0] == torch.tensor(1.0) / 127 and s[0, 1] == 0 and (q[0, 32:] == 0).all()
    want = torch.round(x[0, :32] / (torch.tensor(1.0) / 127))
    assert torch.equal(q[0, :32].float(), want) and q[0, 0] == -127 and q[0, 31] == 127
    assert q[0, 5] == 64
    assert torch.isnan(s[1, 1]) and (q[1, 32:] == 0).all() and s[1, 0] == 0
    assert (q[2] == 0).all() and (s[2] == 0).all()


def test_kernel_mode_matches_an_independent_float64_loop() -> None:
    rng = np.random.default_rng(3)
    hidden, inter, n_experts, top_k, tokens = 64, 32, 5, 2, 4
    sec = logical_sections(rng, n_experts, hidden, inter, 120, 126)
    sec["w2_scales"][0, 3, 0] = 0  # a zero scale byte reads as 0 in kernel mode
    t = {k: torch.from_numpy(v) for k, v in sec.items()}
    x = torch.from_numpy(rng.standard_normal((tokens, hidden)).astype(np.float32))
    ids = torch.tensor([[0, 1], [2, 0], [3, 4], [1, 3]])
    w = torch.from_numpy(rng.random((tokens, top_k)).astype(np.float32))
    got = w2_moe_reference(
        x, ids, w, (t["w13_codes"], t["w13_scales"]), (t["w2_codes"], t["w2_scales"]), "kernel"
    )
    levels = np.array(LEVELS)

    def deq(codes, scales):
        fields = np.stack([(codes >> (2 * j)) & 3 for j in range(4)], -1).reshape(
            codes.shape[0], -1
        )
        sc = np.where(scales == 0, 0.0, 2.0 ** (scales.astype(np.float64) - 127))
        return levels[fields] * np.repeat(sc, 32, axis=1)

    def quant(v):  # float32 rows -> float64 values of the int8 quantization
        out = np.zeros(v.shape)
        for b in range(0, v.shape[-1], 32):
            blk = v[..., b : b + 32].astype(np.float32)
            s = np.float32(np.abs(blk).max()) / np.float32(127)
            out[..., b : b + 32] = np.round(blk / s) * np.float64(s) if s > 0 else 0.0
        return out

    want = np.zeros((tokens, hidden), np.float32)
    for tok in range(tokens):
        for j in range(top_k):
            e = int(ids[tok, j])
            gu = quant(x[tok].numpy()) @ deq(sec["w13_codes"][e], sec["w13_scales"][e]).T
            gu = gu.astype(np.float32)
            act = gu[:inter] / (np.float32(1) + np.exp(-gu[:inter])) * gu[inter:]
            y = quant(act.astype(np.float32)) @ deq(sec["w2_codes"][e], sec["w2_scales"][e]).T
            want[tok] += np.float32(w[tok, j]) * y.astype(np.float32)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    exact = w2_moe_reference(
        x, ids, w, (t["w13_codes"], t["w13_scales"]), (t["w2_codes"], t["w2_scales"])
    )
    err = float((got - exact).norm() / exact.norm())
    assert 1e-4 < err < 5e-2  # int8 activations: close to exact, but not equal


def test_op_on_cpu_is_the_reference_over_native_rows() -> None:
    rng = np.random.default_rng(5)
    hidden, inter, n_experts, top_k, tokens = 96, 32, 6, 2, 5
    sec = logical_sections(rng, n_experts, hidden, inter, 119, 125)
    native = torch.from_numpy(NativeRowLayout(hidden, inter).pack(**sec))
    logical_lay = RowLayout(hidden, inter)
    logical = torch.from_numpy(logical_lay.pack(**sec))
    table = torch.arange(n_experts, dtype=torch.int32)
    table[2] = -1
    x = torch.from_numpy(rng.standard_normal((tokens, hidden)).astype(np.float32))
    ids = torch.from_numpy(np.stack([rng.permutation(n_experts)[:top_k] for _ in range(tokens)]))
    w = torch.rand(tokens, top_k)
    n_real = torch.tensor([tokens - 1], dtype=torch.int32)
    miss, routed = torch.zeros(1, dtype=torch.int32), torch.zeros(n_experts, dtype=torch.uint8)
    got = w2_moe_slots(x, ids, w, native, table, hidden, inter, n_real, miss, routed)
    miss2, routed2 = torch.zeros(1, dtype=torch.int32), torch.zeros(n_experts, dtype=torch.uint8)
    want = w2_moe_slots_reference(
        x, ids, w, logical, table, logical_lay, tokens - 1, miss2, routed2
    )
    assert torch.equal(got, want) and torch.equal(miss, miss2) and torch.equal(routed, routed2)
    assert int(miss) == int((ids[: tokens - 1] == 2).sum())
    with pytest.raises(ValueError, match="NativeRowLayout rows"):
        w2_moe_slots(x, ids, w, logical[:, :100], table, hidden, inter, n_real, miss, routed)


def test_custom_op_registration_and_fake() -> None:
    rng = np.random.default_rng(6)
    hidden, inter, n_experts = 64, 32, 4
    sec = logical_sections(rng, n_experts, hidden, inter, 120, 125)
    pool = torch.from_numpy(NativeRowLayout(hidden, inter).pack(**sec))
    args = (
        torch.randn(3, hidden),
        torch.tensor([[0, 1], [1, 2], [3, 0]]),
        torch.rand(3, 2),
        pool,
        torch.arange(n_experts, dtype=torch.int32),
        hidden,
        inter,
        torch.tensor([3], dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(n_experts, dtype=torch.uint8),
    )
    torch.library.opcheck(
        torch.ops.moet.w2_moe_slots.default,
        args,
        test_utils=("test_schema", "test_faketensor"),
    )
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = torch.ops.moet.w2_moe_slots(*fake)
        assert tuple(out.shape) == (3, hidden) and out.dtype == torch.float32


def test_w2_dequant_agrees_with_native_views() -> None:
    rng = np.random.default_rng(7)
    sec = logical_sections(rng, 2, 128, 64, 100, 140)
    lay = NativeRowLayout(128, 64)
    v = lay.views(torch.from_numpy(lay.pack(**sec)[1]))
    assert torch.equal(
        w2_dequant(v["w2_codes"], v["w2_scales"]),
        w2_dequant(torch.from_numpy(sec["w2_codes"][1]), torch.from_numpy(sec["w2_scales"][1])),
    )
