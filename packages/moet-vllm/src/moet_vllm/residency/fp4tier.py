"""The FP4 tier's decisions: which (MoE layer, expert) pairs hold FP4 rows, and when the
confidence gate replays a step (issue 19; design.md, Residency).

Every routed expert has a W2 row; a pool of FP4 rows beside it serves the pairs it holds instead
(FP4 slot > W2 slot). There is no miss at this tier, so what enters the pool is chosen by two
rules, both applied between forward passes:

- **heat**: after each step, a routed pair not in the pool enters it while a slot is free, or
  when its decayed routing count beats the coldest resident pair's (which leaves) by more than
  `swap_sigmas` standard deviations of their difference (sqrt of the two counts' sum: routing
  counts are Poisson-like), at most `max_promotions` pairs a step. The margin keeps noise from
  swapping rows: on simulated routing (uniform or Zipf, batch 1 and 8, a 25% pool) 2 sigmas cut
  the promotions from ~4 a step to 0.03-0.75 with the same hit rate or a higher one, and each
  promotion is an FP4 row over PCIe;
- **the gate**: when the step's token is not confident enough for the W2 it ran (`confidence`
  below tau times the share of the step's routed pairs outside the pool, `Fp4Tier.gates`), every
  pair the step routed enters the pool (the coldest others leave) and the step runs again; that
  second pass is final (at most one gate replay a step). Scaling tau by the W2 share spends the
  replays where W2 moved the token most, and never on a step whose experts all ran at FP4
  already (its replay would compute the same): on the fixture, at the same share of steps
  replayed, it buys a lower loss than confidence alone (docs/quality.md).

The slots are a :class:`~moet_vllm.residency.policy.ResidencyPolicy` (decayed frequency, the W2
pool's), so the serving runner and the quality simulation (moet_vllm.gate_eval) take the same
decisions from the same routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .policy import Plan, ResidencyPolicy, distinct

METRICS = ("prob", "margin")
DEFAULT_MAX_PROMOTIONS = 4
DEFAULT_SWAP_SIGMAS = 2.0  # docs/quality.md: chosen on the fixture's curve


def confidence(logits, metric: str = "prob"):
    """Per row of `logits` (torch, [..., vocab]): the top-1 probability (`prob`) or the gap between
    the two largest log-probabilities in nats (`margin`)."""
    import torch

    if metric not in METRICS:
        raise ValueError(f"confidence metric {metric!r}: expected one of {METRICS}")
    lp = torch.log_softmax(logits.double(), -1)
    top = lp.topk(2, dim=-1).values
    return top[..., 0].exp() if metric == "prob" else top[..., 0] - top[..., 1]


@dataclass
class TierCounters:
    steps: int = 0
    gated_steps: int = 0
    promotions: int = 0  # rows that entered the pool (heat and gate)
    evictions: int = 0


class Fp4Tier:
    """The FP4 pool of `n_slots` over `moe_layers` x `n_experts` pairs (flat keys, layer-major).
    The caller applies each returned plan (copies the fetched pairs' FP4 rows in, drops the
    evicted ones) and then commits it."""

    def __init__(
        self,
        n_slots: int,
        moe_layers: int,
        n_experts: int,
        *,
        max_promotions: int = DEFAULT_MAX_PROMOTIONS,
        swap_sigmas: float = DEFAULT_SWAP_SIGMAS,
        **policy_options,
    ) -> None:
        self.policy = ResidencyPolicy(
            n_slots, moe_layers, n_experts, predict_threshold=0.0, **policy_options
        )
        self.max_promotions = int(max_promotions)
        self.swap_sigmas = float(swap_sigmas)
        self.counters = TierCounters()

    @property
    def resident(self) -> np.ndarray:
        """bool [moe_layers, n_experts]: the pairs the pool holds."""
        return self.policy.slot_table >= 0

    def w2_share(self, routed: np.ndarray) -> float:
        """The share of the distinct pairs of `routed` (flat keys of a pass) outside the pool."""
        keys = distinct(routed, self.policy.n_keys)
        return float(np.count_nonzero(self.policy.slot_table.ravel()[keys] < 0)) / max(len(keys), 1)

    def gates(self, conf: float, routed: np.ndarray, tau: float) -> bool:
        """The gate's rule: whether a pass that routed `routed` and whose least confident real
        token has confidence `conf` replays (see the module doc)."""
        return bool(conf < tau * self.w2_share(routed))

    def gate_plan(self, routed: np.ndarray) -> Plan:
        """Every pair of `routed` (flat keys of the step) into the pool, for the gate's replay (as
        many as there are slots; pairs beyond them stay W2)."""
        keys = distinct(routed, self.policy.n_keys)[: self.policy.n_slots]
        return self.policy.plan(keys)

    def heat_plan(self, routed: np.ndarray) -> Plan:
        """After `observe`: the routed pairs outside the pool that enter it by heat (see the
        module doc)."""
        pol = self.policy
        keys = distinct(routed, pol.n_keys)
        table = pol.slot_table.ravel()
        out = keys[table[keys] < 0]
        if len(out) == 0:
            return Plan(version=pol.version)
        free = int(np.count_nonzero(pol.slot_keys < 0))
        if free >= len(out):
            return pol.plan(out)
        others = table >= 0  # the resident pairs this step did not route: the swap candidates
        others[keys] = False
        resident = np.flatnonzero(others)
        if free == 0:  # a full pool (every step once warm): most steps swap nothing, and the
            # hottest outsider against the coldest resident settles that without sorting
            if self.max_promotions <= 0 or len(resident) == 0:
                return Plan(version=pol.version)
            hot, cold = pol.score[out].max(), pol.score[resident].min()
            if not hot - cold > self.swap_sigmas * np.sqrt(hot + cold):
                return Plan(version=pol.version)
        hottest = out[np.argsort(-pol.score[out], kind="stable")]
        coldest = resident[np.argsort(pol.score[resident], kind="stable")]
        hot, cold = pol.score[hottest], pol.score[coldest]
        n = free
        while (
            n < min(len(hottest), self.max_promotions + free)
            and n - free < len(coldest)
            and hot[n] - cold[n - free] > self.swap_sigmas * np.sqrt(hot[n] + cold[n - free])
        ):
            n += 1
        return pol.plan(hottest[:n]) if n else Plan(version=pol.version)

    def commit(self, plan: Plan) -> None:
        self.policy.commit(plan)
        self.counters.promotions += len(plan.fetch_keys)
        self.counters.evictions += len(plan.evict_keys)

    def observe(self, routed: np.ndarray, gated: bool) -> None:
        """End of a step: its final pass routed `routed` (flat keys)."""
        self.policy.observe(routed)
        self.counters.steps += 1
        self.counters.gated_steps += int(gated)
