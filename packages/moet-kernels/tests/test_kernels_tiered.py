"""tiered_moe_slots_reference, and the op with an FP4 pool: per expert the FP4 row where the FP4
pool holds it, else the W2 row, else a miss (design.md, Residency), checked against a float64
loop over the chosen weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moet_kernels.layout import NativeRowLayout, RowLayout
from moet_kernels.ops import _check_args, w2_moe_slots
from moet_kernels.reference import (
    tier_dequant,
    tiered_moe_slots_reference,
    w2_moe_slots_reference,
)

E, H, INTER, TOP_K, TOKENS = 10, 64, 32, 3, 9


def tier_rows(rng, tier: str, native: bool):
    """Random logical sections of E experts of a tier, and their rows (native or logical)."""
    logical = RowLayout(H, INTER, tier)
    sec = {
        name: rng.integers(*((120, 125) if "scales" in name else (0, 256)), (E, *shape), np.uint8)
        for name, (_, shape) in logical.sections.items()
    }
    lay = NativeRowLayout(H, INTER, tier) if native else logical
    return sec, lay, torch.from_numpy(lay.pack(**sec))


def pool_of(rng, rows, resident):
    """A pool holding the `resident` experts in shuffled slots, garbage elsewhere; its table."""
    pool = torch.from_numpy(rng.integers(0, 256, (E + 2, rows.shape[1]), np.uint8))
    table = torch.full((E,), -1, dtype=torch.int32)
    for e, slot in zip(resident, rng.permutation(E + 2)[: len(resident)], strict=False):
        pool[slot] = rows[e]
        table[e] = int(slot)
    return pool, table


def float64_moe(x, ids, w, weights_of):
    """The MoE in float64 from each expert's (w13 [2I, H], w2 [H, I]) or None (a miss)."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            ws = weights_of(int(ids[t, j]))
            if ws is None:
                continue
            gu = ws[0] @ x[t].double()
            act = torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]
            out[t] += float(w[t, j]) * (ws[1] @ act)
    return out


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("fp4", ["fp4r", "fp4x-mxfp4"])
def test_each_expert_takes_the_first_tier_that_holds_it(fp4, native) -> None:
    rng = np.random.default_rng(7)
    s4, lay4, rows4 = tier_rows(rng, fp4, native)
    s2, lay2, rows2 = tier_rows(rng, "w2", native)
    in_fp4, in_w2 = [0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7]  # 3..5 in both: FP4 wins; 8, 9 missing
    pool4, table4 = pool_of(rng, rows4, in_fp4)
    pool2, table2 = pool_of(rng, rows2, in_w2)
    x = torch.from_numpy(rng.standard_normal((TOKENS, H)).astype(np.float32))
    ids = torch.from_numpy(np.stack([rng.permutation(E)[:TOP_K] for _ in range(TOKENS)]))
    w = torch.from_numpy(rng.random((TOKENS, TOP_K)).astype(np.float32))
    miss, routed = torch.zeros(1, dtype=torch.int32), torch.zeros(E, dtype=torch.uint8)
    n_real = TOKENS - 2
    tiers = [(pool4, table4, lay4), (pool2, table2, lay2)]
    got = tiered_moe_slots_reference(x, ids, w, tiers, n_real, miss, routed)

    def weights_of(e):
        tier, sec = (fp4, s4) if e in in_fp4 else ("w2", s2) if e in in_w2 else (None, None)
        if tier is None:
            return None
        proj = [tier_dequant(tier, *(torch.from_numpy(sec[f"{p}_{q}"][e]) for q in ("codes",
                "scales"))) for p in ("w13", "w2")]  # fmt: skip
        return proj[0], proj[1]

    want = float64_moe(x, ids, w, weights_of)
    assert float((got.double() - want).norm() / want.norm()) < 1e-6
    real = ids[:n_real]
    assert int(miss) == int(((real == 8) | (real == 9)).sum())
    assert routed.tolist() == [int(e in real.unique().tolist()) for e in range(E)]


def test_one_tier_is_w2_moe_slots_reference_and_an_empty_first_tier_falls_through() -> None:
    rng = np.random.default_rng(3)
    _, lay4, rows4 = tier_rows(rng, "fp4r", True)
    _, lay2, rows2 = tier_rows(rng, "w2", True)
    pool4, _ = pool_of(rng, rows4, [])
    pool2, table2 = pool_of(rng, rows2, [0, 2, 4, 5, 6, 8])
    x = torch.from_numpy(rng.standard_normal((TOKENS, H)).astype(np.float32))
    ids = torch.from_numpy(np.stack([rng.permutation(E)[:TOP_K] for _ in range(TOKENS)]))
    w = torch.from_numpy(rng.random((TOKENS, TOP_K)).astype(np.float32))
    outs = []
    for mode in ("exact", "kernel"):
        m1, r1 = torch.zeros(1, dtype=torch.int32), torch.zeros(E, dtype=torch.uint8)
        m2, r2 = torch.zeros(1, dtype=torch.int32), torch.zeros(E, dtype=torch.uint8)
        m3, r3 = torch.zeros(1, dtype=torch.int32), torch.zeros(E, dtype=torch.uint8)
        one = w2_moe_slots_reference(x, ids, w, pool2, table2, lay2, TOKENS, m1, r1, mode=mode)
        tiered = tiered_moe_slots_reference(
            x, ids, w, [(pool2, table2, lay2)], TOKENS, m2, r2, mode
        )
        none_fp4 = torch.full((E,), -1, dtype=torch.int32)
        through = tiered_moe_slots_reference(
            x, ids, w, [(pool4, none_fp4, lay4), (pool2, table2, lay2)], TOKENS, m3, r3, mode
        )
        assert torch.equal(one, tiered) and torch.equal(one, through)  # bit-identical
        assert int(m1) == int(m2) == int(m3) > 0 and torch.equal(r1, r2) and torch.equal(r1, r3)
        outs.append(one)
    assert not torch.equal(outs[0], outs[1])  # the modes differ (int8 activations)


def test_bad_tier_lists_are_refused() -> None:
    rng = np.random.default_rng(1)
    _, lay2, rows2 = tier_rows(rng, "w2", True)
    pool2, table2 = pool_of(rng, rows2, [0, 1])
    x = torch.zeros(2, H)
    ids, w = torch.zeros(2, TOP_K, dtype=torch.long), torch.ones(2, TOP_K)
    args = (2, torch.zeros(1, dtype=torch.int32), torch.zeros(E, dtype=torch.uint8))
    with pytest.raises(ValueError, match="at least one"):
        tiered_moe_slots_reference(x, ids, w, [], *args)
    refine = RowLayout(H, INTER, "fp4r-refine")
    with pytest.raises(ValueError, match="need their w2 row"):
        tiered_moe_slots_reference(x, ids, w, [(pool2, table2, refine)], *args)
    other = NativeRowLayout(H, 2 * INTER)
    with pytest.raises(ValueError, match="inter=32"):
        tiered_moe_slots_reference(
            x, ids, w, [(pool2, table2, lay2), (pool2, table2, other)], *args
        )
    with pytest.raises(ValueError, match="slot tables must all be"):
        tiered_moe_slots_reference(
            x, ids, w, [(pool2, table2, lay2), (pool2, table2[:5], lay2)], *args
        )


@pytest.mark.parametrize("fp4", ["fp4r", "fp4x-mxfp4"])
def test_the_op_prefers_its_fp4_pool(fp4) -> None:
    """w2_moe_slots(..., fp4_pool=, fp4_slot_table=, fp4_tier=) on the CPU: the float64 loop over
    the FP4 row where the FP4 pool holds an expert, else the W2 row, else nothing."""
    rng = np.random.default_rng(11)
    s4, lay4, rows4 = tier_rows(rng, fp4, True)
    s2, lay2, rows2 = tier_rows(rng, "w2", True)
    in_fp4, in_w2 = [1, 2, 6, 7], [0, 2, 3, 7, 8]  # 2, 7 in both; 4, 5, 9 missing
    pool4, table4 = pool_of(rng, rows4, in_fp4)
    pool2, table2 = pool_of(rng, rows2, in_w2)
    x = torch.from_numpy(rng.standard_normal((TOKENS, H)).astype(np.float32))
    ids = torch.from_numpy(np.stack([rng.permutation(E)[:TOP_K] for _ in range(TOKENS)]))
    w = torch.from_numpy(rng.random((TOKENS, TOP_K)).astype(np.float32))
    n_real = torch.tensor([TOKENS - 1], dtype=torch.int32)
    miss, routed = torch.zeros(1, dtype=torch.int32), torch.zeros(E, dtype=torch.uint8)
    got = w2_moe_slots(x, ids, w, pool2, table2, H, INTER, n_real, miss, routed, "w2",
                       pool4, table4, fp4)  # fmt: skip

    def weights_of(e):
        tier, sec = (fp4, s4) if e in in_fp4 else ("w2", s2) if e in in_w2 else (None, None)
        if tier is None:
            return None
        return [tier_dequant(tier, *(torch.from_numpy(sec[f"{p}_{q}"][e]) for q in ("codes",
                "scales"))) for p in ("w13", "w2")]  # fmt: skip

    want = float64_moe(x, ids, w, weights_of)
    assert float((got.double() - want).norm() / want.norm()) < 1e-6
    real = ids[: TOKENS - 1]
    assert int(miss) == int(sum((real == e).sum() for e in (4, 5, 9)))
    assert routed.tolist() == [int(e in real.unique().tolist()) for e in range(E)]


def test_the_op_refuses_a_bad_fp4_tier() -> None:
    rng = np.random.default_rng(12)
    _, lay4, rows4 = tier_rows(rng, "fp4r", True)
    _, lay2, rows2 = tier_rows(rng, "w2", True)
    pool4, table4 = pool_of(rng, rows4, [0])
    pool2, table2 = pool_of(rng, rows2, [1])
    x, w = torch.zeros(2, H), torch.ones(2, TOP_K)
    ids = torch.zeros(2, TOP_K, dtype=torch.long)
    args = (x, ids, w, pool2, table2, H, INTER, torch.tensor([2], dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32), torch.zeros(E, dtype=torch.uint8), "w2")  # fmt: skip
    with pytest.raises(ValueError, match="go together"):
        w2_moe_slots(*args, pool4)
    with pytest.raises(ValueError, match="fp4_tier must be one of"):
        w2_moe_slots(*args, pool2, table2, "w2")
    with pytest.raises(ValueError, match=r"fp4_pool must be uint8 \[n_slots, >= \d+\]"):
        w2_moe_slots(*args, pool2, table4, "fp4r")  # W2 rows are shorter than fp4r rows
    with pytest.raises(ValueError, match="fp4_slot_table has 5 experts"):
        w2_moe_slots(*args, pool4, table4[:5], "fp4r")
    with pytest.raises(TypeError, match="fp4_slot_table must be a contiguous torch.int32"):
        w2_moe_slots(*args, pool4, table4.long(), "fp4r")
    # a tensor on another device than x (checked before the dispatch, which a meta tensor would
    # send to the fake implementation)
    tiers = {"fp4": (pool4.to("meta"), table4, lay4), "device": (pool2, table2, lay2)}
    with pytest.raises(ValueError, match="fp4_pool is on meta but x is on cpu"):
        _check_args(x, ids, w, tiers, args[7], args[8], args[9])
    device = {"device": tiers["device"]}
    with pytest.raises(ValueError, match="miss_count is on meta but x is on cpu"):
        _check_args(x, ids, w, device, args[7], args[8].to("meta"), args[9])
    # host rows: in host memory (pinned, beside a CUDA x), their table on x's device
    with pytest.raises(ValueError, match="host_pool must be host memory"):
        _check_args(x, ids, w, {**device, "host": (pool2.to("meta"), table2, lay2)}, *args[7:10])
    with pytest.raises(ValueError, match="host_slot_table is on meta but x is on cpu"):
        _check_args(x, ids, w, {**device, "host": (pool2, table2.to("meta"), lay2)}, *args[7:10])
