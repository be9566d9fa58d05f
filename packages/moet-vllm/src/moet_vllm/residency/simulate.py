"""Trace-driven simulation of the expert pool: online policies, Belady's MIN and a lower bound.

The model is the serving one (design.md, "Residency and replay"). A step routes a set R_t of
(moe_layer, expert) keys. It *replays* when any key of R_t was not resident at its start; the
missing keys are then fetched (demand only: a key enters the pool only when a step routes it) and
every key of R_t stays resident until the step ends, so after step t the pool C_t holds R_t and at
most ``n_slots`` keys. Metrics over the measured steps: replay % of steps, missing pairs per step,
bytes fetched (missing pairs x slot bytes).

Policies, all the same :class:`~moet_vllm.residency.policy.ResidencyPolicy` machinery differing
only in the victim order:

- ``decay``: the serving policy object itself (decayed frequency).
- ``lfu``: decayed frequency with no decay (a key's routings since the start; "perfect" LFU).
- ``lru``: least recently routed first.
- ``belady``: Belady's MIN, offline: the resident key whose next routing is furthest away first
  (never again first), never a key of the current step.

What is optimal when a step needs all its keys resident. Write a schedule as the set of *kept
intervals*: key k routed at steps p < s and resident throughout, so that s finds it. After step b
the pool holds R_b plus the kept intervals that cross b, which must fit in ``n_slots``.

- **Missing pairs (bytes).** Every routing that does not end a kept interval is a missing pair, so
  the fewest missing pairs is the most intervals packed under the capacity profile
  ``n_slots - |R_b|``. Belady's MIN is optimal for it: the classic exchange argument holds because
  the keys of R_t have distance 0 and are never victims (a schedule that keeps the key x with the
  further next use instead of MIN's y can swap the two until y's next use, without a single extra
  miss). Tested against brute force (tests/test_residency_simulate.py).
- **Replay steps.** A step is replay-free only if *all* intervals ending at it are kept: the
  optimum packs whole groups of intervals, a harder problem (the all-or-nothing form of unsplittable
  flow on a path; we know no polynomial algorithm). MIN is not optimal for it: it may evict a key
  whose next step is otherwise clean rather than one whose next step misses anyway (brute force
  finds such traces; a test keeps one). So for replay % this module reports MIN (the classic
  reference, and an upper bound on the optimum, being a feasible schedule) and a **provable lower
  bound** (:func:`replay_lower_bound`, the Lagrangian dual of the packing LP): the optimum lies
  between the two, and no policy, online or offline, replays fewer steps than the bound.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .policy import ResidencyPolicy, lowest

POLICIES = ("lru", "lfu", "decay", "belady")


def decode_steps(ids: np.ndarray, n_experts: int, batch: int = 1) -> np.ndarray:
    """Routed flat keys of each decode step: int64 [steps, batch * moe_layers * top_k].

    Batch 1: one token per step. Batch B: the trace is cut into B contiguous parts of
    ``tokens // B`` tokens, treated as B concurrent sequences; step t routes token t of each part
    (a key routed by several tokens appears once per token; its union is what the step needs).
    """
    tokens, n_layers, k = ids.shape
    if batch < 1 or tokens < batch:
        raise ValueError(f"batch must be in [1, tokens={tokens}], got {batch}")
    n = tokens // batch
    flat = np.arange(n_layers, dtype=np.int64)[None, :, None] * n_experts + ids.astype(np.int64)
    parts = flat[: n * batch].reshape(batch, n, n_layers * k)
    return np.ascontiguousarray(parts.transpose(1, 0, 2).reshape(n, batch * n_layers * k))


def unique_steps(steps: np.ndarray) -> list[np.ndarray]:
    """The distinct keys of each step, ascending."""
    srt = np.sort(steps, axis=1)
    keep = np.ones_like(srt, dtype=bool)
    keep[:, 1:] = srt[:, 1:] != srt[:, :-1]
    return [row[m] for row, m in zip(srt, keep)]


class LRUPolicy(ResidencyPolicy):
    """Evicts the least recently routed key (ties: lowest key id)."""

    def _victims(self, cands: np.ndarray, n: int) -> np.ndarray:
        return lowest(cands, n, self.last_use)


class BeladyPolicy(ResidencyPolicy):
    """Belady's MIN for the steps it is built from: evicts the key routed again furthest in the
    future (never again first; ties: lowest key id). Must be driven with exactly those steps."""

    def __init__(self, n_slots: int, moe_layers: int, n_experts: int, steps: np.ndarray) -> None:
        super().__init__(n_slots, moe_layers, n_experts)
        self._uniq = unique_steps(steps)
        never = len(self._uniq)
        seen = np.full(self.n_keys, never, dtype=np.int64)
        self._next = [None] * len(self._uniq)
        for t in range(len(self._uniq) - 1, -1, -1):
            keys = self._uniq[t]
            self._next[t] = seen[keys]
            seen[keys] = t
        self.next_use = seen  # first routing of every key (a preloaded key waits for it)

    def _victims(self, cands: np.ndarray, n: int) -> np.ndarray:
        return lowest(cands, n, -self.next_use)

    def observe(self, routed: np.ndarray) -> None:
        t = self.steps
        self.next_use[self._uniq[t]] = self._next[t]
        self.last_use[self._uniq[t]] = t
        self.steps += 1


def make_policy(
    name: str, n_slots: int, moe_layers: int, n_experts: int, steps: np.ndarray, **knobs
) -> ResidencyPolicy:
    """A fresh policy by name (``POLICIES``); ``knobs`` go to the decayed-frequency policy."""
    if name == "decay":
        return ResidencyPolicy(n_slots, moe_layers, n_experts, **knobs)
    if name == "lfu":
        return ResidencyPolicy(n_slots, moe_layers, n_experts, half_life_steps=math.inf)
    if name == "lru":
        return LRUPolicy(n_slots, moe_layers, n_experts)
    if name == "belady":
        return BeladyPolicy(n_slots, moe_layers, n_experts, steps)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")


@dataclass
class SimResult:
    policy: str
    n_slots: int
    steps: int  # measured steps (after the warm-up)
    replay_steps: int
    missing_pairs: int
    bytes_fetched: int

    @property
    def replay_pct(self) -> float:
        return 100.0 * self.replay_steps / max(self.steps, 1)

    @property
    def missing_per_step(self) -> float:
        return self.missing_pairs / max(self.steps, 1)

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "replay_pct": self.replay_pct,
            "missing_per_step": self.missing_per_step,
        }


def simulate(
    policy: ResidencyPolicy,
    steps: np.ndarray,
    *,
    warmup: int = 0,
    initial: np.ndarray | None = None,
    slot_bytes: int = 1,
    name: str = "",
) -> SimResult:
    """Drive ``policy`` with every step (``decode_steps``); count the steps from ``warmup`` on.

    ``initial``: keys preloaded before the first step, hottest first (a warm start).
    """
    if initial is not None:
        policy.commit(policy.plan_preload(initial))
    replays = pairs = 0
    for t, routed in enumerate(steps):
        plan = policy.step(routed)
        if t >= warmup:
            replays += plan.replay
            pairs += plan.n_missing
    n = max(len(steps) - warmup, 0)
    return SimResult(name, policy.n_slots, n, replays, pairs, pairs * slot_bytes)


def run_policy(
    name: str,
    steps: np.ndarray,
    n_slots: int,
    moe_layers: int,
    n_experts: int,
    *,
    warmup: int = 0,
    initial: np.ndarray | None = None,
    slot_bytes: int = 1,
    **knobs,
) -> SimResult:
    pol = make_policy(name, n_slots, moe_layers, n_experts, steps, **knobs)
    return simulate(pol, steps, warmup=warmup, initial=initial, slot_bytes=slot_bytes, name=name)


def hottest(steps: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` most routed keys of ``steps``, hottest first (ties: lowest id): the hot set a
    long run would persist, used as the warm start of every policy."""
    counts = np.bincount(steps.ravel())
    seen = np.flatnonzero(counts)
    return lowest(seen, min(n, len(seen)), -counts)


# -- the lower bound ----------------------------------------------------------------------------


def replay_lower_bound(
    steps: np.ndarray | list[np.ndarray],
    n_slots: int,
    *,
    warmup: int = 0,
    initial: np.ndarray | None = None,
    iters: int = 200,
    upper: int | None = None,
) -> int:
    """A number of replay steps in ``[warmup, steps)`` that no schedule can go below.

    Boundary b is the pool's content at the start of step b. A replay-free step s needs every key
    of R_s kept from its previous routing p: at boundaries p+2..s it occupies a slot beyond
    R_{b-1} (capacity ``n_slots - |R_{b-1}|``). With ``warmup > 0`` the pool at boundary
    ``warmup`` may hold any ``n_slots`` keys (a relaxation: any reachable state is allowed), so a
    key last routed before the window counts from there; with ``warmup == 0`` the pool starts
    with ``initial`` (or empty) and the first routing of any other key forces a replay. Choosing which steps are replay-free is a
    packing LP; any prices ``lam >= 0`` on the boundaries give the upper bound
    ``sum_b lam_b cap_b + sum_s max(0, 1 - cost_s(lam))`` on replay-free steps (weak duality),
    tightened by projected subgradient steps (Polyak step towards ``upper``, the replay-free
    steps of a feasible schedule such as MIN's, when given). Valid at every iterate.
    """
    uniq = unique_steps(steps) if isinstance(steps, np.ndarray) else steps
    T = len(uniq)
    b0 = int(warmup)
    if not 0 <= b0 <= T:
        raise ValueError(f"warmup must be in [0, {T}]")
    n_window = T - b0
    if n_window == 0:
        return 0
    n_keys = int(max(int(u.max()) for u in uniq if len(u)) + 1)
    last = np.full(n_keys, -1, dtype=np.int64)
    starts, ends, forced = [], [], np.zeros(T, dtype=bool)
    sizes = np.array([len(u) for u in uniq], dtype=np.int64)
    if int(sizes.max()) > n_slots:
        raise ValueError(f"a step routes {int(sizes.max())} keys, more than {n_slots} slots")
    preloaded = np.zeros(n_keys, dtype=bool)
    if initial is not None and b0 == 0:
        init = np.asarray(initial, dtype=np.int64)
        init = init[init < n_keys]
        if len(np.unique(init)) > n_slots:
            raise ValueError("initial holds more keys than slots")
        preloaded[init] = True
    for s, keys in enumerate(uniq):
        p = last[keys]
        last[keys] = s
        if s < b0:
            continue
        if b0 == 0 and np.any((p < 0) & ~preloaded[keys]):
            forced[s] = True
            continue
        a = np.where(p < b0, b0, p + 2)
        a = a[a <= s]
        starts.append(a)
        ends.append(np.full(len(a), s, dtype=np.int64))
    a = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    e = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    cap = np.empty(T, dtype=np.float64)
    cap[0] = n_slots
    cap[1:] = n_slots - sizes[:-1]
    cap[b0] = n_slots
    free_steps = np.flatnonzero(~forced[b0:]) + b0
    n_free = len(free_steps)
    # steps whose intervals are all empty cost nothing: always replay-free in the relaxation
    lam = np.zeros(T, dtype=np.float64)
    a_m1 = a - 1
    best = float(n_free)
    target = float(upper) if upper is not None else None
    theta = 1.0
    stall = 0
    for _ in range(iters):
        cum = np.concatenate([[0.0], np.cumsum(lam)])  # cum[b + 1] = sum lam[..b]
        cost_i = cum[e + 1] - cum[a_m1 + 1]
        cost = np.bincount(e, weights=cost_i, minlength=T)
        slack = np.maximum(0.0, 1.0 - cost[free_steps])
        val = float(lam[b0:] @ cap[b0:]) + float(slack.sum())
        if val < best - 1e-9:
            best, stall = val, 0
        else:
            stall += 1
            if stall >= 10:
                theta, stall = theta / 2, 0
        active = np.zeros(T, dtype=bool)
        active[free_steps[slack > 0]] = True
        on = active[e]
        load = np.bincount(a[on], minlength=T + 1)[:T] - np.bincount(e[on] + 1, minlength=T + 1)[:T]
        load = np.cumsum(load).astype(np.float64)
        g = cap - load
        g[:b0] = 0.0
        # a coordinate at lam = 0 with a positive gradient cannot move: project it out
        g[(lam <= 0) & (g > 0)] = 0.0
        gg = float(g @ g)
        if gg == 0.0:
            break
        goal = target if target is not None else best * 0.95
        step = theta * max(val - goal, 1e-3 * max(val, 1.0)) / gg
        lam = np.maximum(0.0, lam - step * g)
    clean_max = math.floor(best + 1e-9)
    return n_window - min(clean_max, n_window)
