"""w2_moe_slots_reference (experts in a pool of slots) against w2_moe_reference (all resident)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moet_kernels.layout import RowLayout
from moet_kernels.reference import w2_moe_reference, w2_moe_slots_reference

E, H, INTER, TOP_K = 12, 64, 32, 3


def setup(seed: int, tokens: int):
    rng = np.random.default_rng(seed)
    lay = RowLayout(H, INTER)
    sec = {
        "w13_codes": rng.integers(0, 256, (E, 2 * INTER, H // 4), np.uint8),
        "w13_scales": rng.integers(121, 126, (E, 2 * INTER, H // 32), np.uint8),
        "w2_codes": rng.integers(0, 256, (E, H, INTER // 4), np.uint8),
        "w2_scales": rng.integers(121, 126, (E, H, INTER // 32), np.uint8),
    }
    t = {k: torch.from_numpy(v) for k, v in sec.items()}
    x = torch.from_numpy(rng.standard_normal((tokens, H)).astype(np.float32))
    ids = torch.from_numpy(np.stack([rng.permutation(E)[:TOP_K] for _ in range(tokens)]))
    w = torch.from_numpy(rng.random((tokens, TOP_K)).astype(np.float32))
    full = w2_moe_reference(
        x, ids, w, (t["w13_codes"], t["w13_scales"]), (t["w2_codes"], t["w2_scales"])
    )
    rows = torch.from_numpy(lay.pack(**sec))
    return rng, lay, t, x, ids, w, full, rows


def pool_with(rng, rows, resident: list[int], n_slots: int):
    """A pool with `resident` experts in random slots (garbage elsewhere), and its slot table."""
    pool = torch.from_numpy(rng.integers(0, 256, (n_slots, rows.shape[1] + 512), np.uint8))
    table = torch.full((E,), -1, dtype=torch.int32)
    for e, slot in zip(resident, rng.permutation(n_slots)[: len(resident)], strict=True):
        pool[slot, : rows.shape[1]] = rows[e]
        table[e] = int(slot)
    return pool, table


@pytest.mark.parametrize("tokens", [1, 4, 33])
def test_all_resident_is_bit_identical_to_the_resident_reference(tokens):
    rng, lay, _, x, ids, w, full, rows = setup(tokens, tokens)
    pool, table = pool_with(rng, rows, list(range(E)), E + 3)
    miss, routed = torch.zeros(1, dtype=torch.int32), torch.zeros(E, dtype=torch.uint8)
    out = w2_moe_slots_reference(x, ids, w, pool, table, lay, tokens, miss, routed)
    assert torch.equal(out, full)
    assert miss.item() == 0
    assert set(torch.nonzero(routed).flatten().tolist()) == set(ids.flatten().tolist())


@pytest.mark.parametrize("seed", range(6))
def test_misses_are_zeroed_counted_and_marked(seed):
    tokens, n_real = 20, 14  # rows 14.. are padding
    rng, lay, t, x, ids, w, _, rows = setup(100 + seed, tokens)
    resident = sorted(rng.permutation(E)[: rng.integers(2, E - 1)].tolist())
    pool, table = pool_with(rng, rows, resident, len(resident) + 2)
    miss, routed = torch.zeros(1, dtype=torch.int32), torch.zeros(E, dtype=torch.uint8)
    out = w2_moe_slots_reference(x, ids, w, pool, table, lay, n_real, miss, routed)
    missing = ~torch.isin(ids, torch.tensor(resident))
    assert miss.item() == int(missing[:n_real].sum())  # padding rows never count
    assert set(torch.nonzero(routed).flatten().tolist()) == set(ids[:n_real].flatten().tolist())
    zeroed = torch.where(missing, torch.zeros_like(w), w)  # a missing pair contributes nothing
    want = w2_moe_reference(
        x, ids, zeroed, (t["w13_codes"], t["w13_scales"]), (t["w2_codes"], t["w2_scales"])
    )
    assert torch.equal(out, want)


def test_counters_accumulate_across_layers_and_bad_pools_are_refused():
    rng, lay, _, x, ids, w, _, rows = setup(7, 5)
    pool, table = pool_with(rng, rows, [], 2)
    miss, routed = torch.zeros(1, dtype=torch.int32), torch.zeros(E, dtype=torch.uint8)
    for _ in range(2):
        w2_moe_slots_reference(x, ids, w, pool, table, lay, 5, miss, routed)
    assert miss.item() == 2 * 5 * TOP_K
    with pytest.raises(ValueError, match="pool must be uint8"):
        w2_moe_slots_reference(x, ids, w, pool[:, :10], table, lay, 5, miss, routed)
