"""The FP4 tier on the device (issue 19; design.md, Residency): a pool of FP4 expert rows (`fp4r`,
or the checkpoint's own `fp4x` data) beside the W2 pool, one slot per (MoE layer, expert) it
holds, preferred over the W2 slot by the MoE op.

* `pool` uint8 [n_slots, row_bytes] and `table` int32 [moe_layers, E] (-1: no FP4 row) on the
  layers' device, allocated at boot (`fp4_pool=auto`: re-sized once, before graph capture) and
  never moved after, so a captured CUDA graph reads them by address; MTP (pinned) layers keep
  table rows of -1 (their experts stay W2);
* the host source: a moet-store `Store` over the model's FP4 pack (loading.py writes it),
  registered with CUDA like the W2 one; with the `ram` host tier its arena rows are copied into
  the pool by copies queued on the stream, with no wait (the next pass is queued after them),
  else fetched in a batch and waited for;
* the decisions: `fp4tier.Fp4Tier` (heat after each decode step), the same rules the quality
  simulation (`moet eval-gate`) takes. Plans are applied only between forward passes: the
  evictions are published first, then the rows copied, then their slots published.

A pool that holds every pair is filled at boot: there is nothing left to decide. Otherwise the hot
set saved at the KPI lines of an earlier run (`<FP4 pack>.pool-hot.json`) preloads it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .fp4tier import Fp4Tier, TierCounters
from .manager import (
    MoetResidencyError,
    apply_plan,
    fetch_rows,
    host_rows,
    load_hot_set,
    pin_host_memory,
    queue_row_copies,
    save_hot_set,
    unpin_host_memory,
)
from .policy import Plan

log = logging.getLogger("vllm.moet")


class Fp4Pool:
    def __init__(
        self,
        layout,
        store,
        moe_layers: int,
        tiered: list[int],
        n_experts: int,
        n_slots: int,
        device: torch.device,
        fetch_attempts: int = 3,
        hot_path=None,
    ):
        self.layout, self.store, self.n_experts = layout, store, n_experts
        self.tiered = list(tiered)  # the MoE-layer ordinal of each tiered layer (the tier's keys)
        self.moe_layers, self.device = moe_layers, torch.device(device)
        self.fetch_attempts = fetch_attempts
        self.hot_path = hot_path  # the persisted hot set (next to the FP4 pack)
        self.auto_cap: int | None = None  # fp4_pool=auto: slots at most, sized before capture
        self.routed_pairs = self.hit_pairs = 0  # decode steps' routed pairs, and those at FP4
        self.pool = None
        self._pinned = pin_host_memory(store, device)
        self.host_rows = self._host_rows()
        self._allocate(n_slots)

    def _host_rows(self):
        """(arena rows, arena slot per pair) of a `ram` store holding every tiered pair's row,
        pinned on a GPU; else None (rows are fetched)."""
        st = self.store
        if getattr(st, "backend", None) != "ram" or not st.arena_address:
            return None
        if self.device.type == "cuda" and st.arena_address not in self._pinned:
            return None
        rows, slots = host_rows(st, self.moe_layers, self.n_experts)
        return (rows, slots) if (slots[self.tiered] >= 0).all() else None

    def _allocate(self, n_slots: int) -> None:
        """A pool of `n_slots`, an empty table and tier; filled at once if it holds every pair."""
        self.n_slots = n_slots
        self.tier = Fp4Tier(n_slots, len(self.tiered), self.n_experts)
        self.pool = None  # the old pool's memory is free before the new one is taken
        row = self.layout.row_bytes
        try:
            self.pool = torch.zeros(n_slots, row, dtype=torch.uint8, device=self.device)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            raise MoetResidencyError(
                f"moet: an FP4 pool of {n_slots} slots ({n_slots * row / 2**30:.2f} GiB) does not "
                f"fit in {self.device} memory: lower fp4_pool, or fp4_pool=auto"
            ) from e
        self.table = torch.full(
            (self.moe_layers, self.n_experts), -1, dtype=torch.int32, device=self.device
        )
        if n_slots >= len(self.tiered) * self.n_experts:
            self.apply(self.tier.policy.plan(np.arange(self.tier.policy.n_keys)))
            self.tier.counters = TierCounters()  # the boot fill is no step's promotion

    def resize(self, n_slots: int) -> int:
        """fp4_pool=auto, before graph capture (never once a graph holds the pool's address): a
        pool of `n_slots` instead, preloaded from the saved hot set -> rows preloaded."""
        self._allocate(n_slots)
        return self.load_hot_set()

    @property
    def coverage(self) -> float:
        """Share of the tiered (layer, expert) pairs the pool holds at once."""
        return self.n_slots / max(1, len(self.tiered) * self.n_experts)

    def layer(self, ordinal: int) -> tuple[torch.Tensor, torch.Tensor, object]:
        """(pool, slot-table row, layout) of one MoE layer: the op's FP4 tier."""
        return self.pool, self.table[ordinal], self.layout

    def save_hot_set(self) -> None:
        save_hot_set(self.hot_path, self.tier.policy)

    def load_hot_set(self) -> int:
        """Boot: the saved hot set into free slots (a full pool has none) -> rows loaded."""
        keys = load_hot_set(self.hot_path, self.tier.policy)
        if keys is None:
            return 0
        plan = self.tier.policy.plan_preload(keys)
        self.apply(plan)
        self.tier.counters = TierCounters()  # a warm start is no step's promotion
        log.info("moet: FP4 pool warm start: %d rows preloaded", len(plan.fetch_keys))
        return len(plan.fetch_keys)

    def gate(self, keys: np.ndarray) -> None:
        """The confidence gate fired: every pair the step's pass routed (`keys`) into the pool
        (the coldest others leave), before the step runs once more."""
        self.apply(self.tier.gate_plan(keys))

    def after_step(self, keys: np.ndarray, gated: bool = False) -> None:
        """A decode step's final pass routed `keys` (flat keys over the tiered layers; `gated`:
        that pass was the gate's replay): count what ran at FP4, let the tier learn, and
        promote by heat."""
        keys = np.asarray(keys, dtype=np.int64)
        self.routed_pairs += len(keys)
        self.hit_pairs += int(np.count_nonzero(self.tier.resident.ravel()[keys]))
        self.tier.observe(keys, gated)
        plan = self.tier.heat_plan(keys)
        if len(plan.fetch_keys):
            self.apply(plan)

    def apply(self, plan: Plan) -> None:
        """Evict, fetch and publish one plan (between forward passes); a failed fetch publishes
        nothing it read, and the victims leave the pool (manager.apply_plan)."""

        def copy(keys, slots) -> None:
            if self.host_rows is not None:
                queue_row_copies(self.pool, *self.host_rows, self.layout.row_bytes, keys, slots)
            else:
                fetch_rows(self.store, self.pool, self.layout.row_bytes, keys, slots,
                           self.fetch_attempts, "FP4")  # fmt: skip

        apply_plan(plan, self.table, self.tiered, self.n_experts, copy, self.tier.commit,
                   self.tier.commit)  # fmt: skip

    def metrics(self) -> dict:
        """Totals since boot for `/metrics` (metrics.FP4_COUNTERS) and the pool's coverage."""
        c = self.tier.counters
        return {"fp4_promotions": c.promotions, "fp4_evictions": c.evictions,
                "fp4_gated_steps": c.gated_steps,
                "fp4_routed_pairs": self.routed_pairs, "fp4_hit_pairs": self.hit_pairs,
                "fp4_pool_coverage": self.coverage}  # fmt: skip

    def kpi(self, steps: int, window: dict) -> str:
        """The KPI line's FP4 part over the `steps` since `window` (updated in place)."""
        c = self.tier.counters
        routed = self.routed_pairs - window.get("fp4_routed", 0)
        hits = self.hit_pairs - window.get("fp4_hits", 0)
        prom = (c.promotions - window.get("fp4_promotions", 0)) / max(steps, 1)
        evic = (c.evictions - window.get("fp4_evictions", 0)) / max(steps, 1)
        decode = c.steps - window.get("fp4_steps", 0)
        gated = 100 * (c.gated_steps - window.get("fp4_gated", 0)) / max(decode, 1)
        window.update(fp4_routed=self.routed_pairs, fp4_hits=self.hit_pairs,
                      fp4_promotions=c.promotions, fp4_evictions=c.evictions, fp4_steps=c.steps,
                      fp4_gated=c.gated_steps)  # fmt: skip
        return (
            f", FP4 pool coverage {100 * self.coverage:.1f}% (routed experts at FP4 "
            f"{100 * hits / max(routed, 1):.1f}%), gate replay {gated:.1f}% of decode steps, FP4 "
            f"promotions {prom:.2f} / evictions {evic:.2f} per step"
        )

    def close(self) -> None:
        unpin_host_memory(self._pinned)
        self._pinned = []
        self.store.close()
