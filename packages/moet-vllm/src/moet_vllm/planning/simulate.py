"""Trace-driven simulation of the expert pool: online policies, Belady's offline policies and a
lower bound.

The model is the serving one (design.md, "Residency and replay"). Step t routes a set R_t of
(moe_layer, expert) keys. It *replays* when any key of R_t was not resident at its start; the
missing keys are then fetched (demand only: a key enters the pool only when a step routes it) and
every key of R_t stays resident until the step ends, so after step t the pool holds R_t and at most
``n_slots`` keys. Metrics over the measured steps: replay % of steps, missing pairs per step,
bytes fetched (missing pairs x slot bytes).

Policies, all the same :class:`~moet_vllm.residency.policy.ResidencyPolicy` machinery differing
only in the victim order:

- ``decay``: the serving policy object itself (decayed frequency).
- ``lfu``: decayed frequency with no decay (routings since the start: "perfect" LFU).
- ``lru``: least recently routed first.
- ``min``: Belady's MIN, offline: the key routed again furthest in the future first.
- ``belady``: Belady for replay steps, offline: first the keys whose next routing falls in a step
  that replays anyway (a key that is not resident and not routed before it is routed there), the
  furthest first; then MIN's order.

**What is optimal** when a step needs all its keys resident. Write a schedule as its *kept
intervals*: key k routed at steps p < s and resident in between, so that s finds it. After step b
the pool holds R_b plus the kept intervals crossing b, at most ``n_slots``.

- *Missing pairs (bytes).* Every routing that does not end a kept interval is a missing pair, so
  the fewest missing pairs is the most intervals packed under the capacity profile
  ``n_slots - |R_b|``. MIN achieves it: the keys of R_t have distance 0 and are never victims, and
  the classic exchange argument goes through (a schedule that evicts y where MIN evicts x, whose
  next routing is later, can keep y and drop x instead until y's next routing, without an extra
  miss). Checked against brute force (tests/test_planning.py).
- *Replay steps.* A step is replay-free only if *all* the intervals ending at it are kept: the
  optimum packs whole groups of intervals, an all-or-nothing packing for which we know no
  polynomial algorithm. MIN is not optimal for it: it may evict a key whose next step would
  otherwise be clean rather than one whose next step replays anyway (the tests keep such a
  trace). ``belady`` uses that freedom; on random tiny traces it is optimal in all but about
  1 in 1000 and never worse than MIN, but it is not proven optimal either. So replay % has a
  bracket: :func:`replay_lower_bound` (the LP relaxation's dual: no schedule, online or offline,
  replays fewer steps) <= optimum <= ``belady`` (a feasible schedule).

**Fetching more than the missing keys.** A replayed step costs one more forward pass and one
batched copy, whatever the copy holds (up to its bytes), so a policy may also fetch keys no step
has asked for yet. Two models, outside the demand-only one above (so neither MIN, ``belady`` nor
:func:`replay_lower_bound` bounds them):

- *Prefetch on replay steps* (``decay+pf``, ``min+pf``): a replayed step fetches up to
  ``prefetch`` more keys besides its missing ones; a replay-free step fetches nothing. ``min+pf``
  is its clairvoyant reference (MIN's victims, the keys routed soonest prefetched). Whatever the
  fetch budget and the information, a schedule that changes the pool only at replay steps cannot
  replay fewer steps than :func:`prefetch_lower_bound` (exact for an unbounded budget).
- *Fetch before the forward* (``predict``): before a step runs, the experts its input tokens are
  predicted to route (learned online from what each token id routed before) are fetched; the step
  replays only if the prediction missed some. It needs the tokens of the trace. With perfect
  information it would never replay, so its currency is the steps that fetch before the forward
  and the bytes, next to the replays.

**What no online policy can beat** (synthetic traces): a synthetic token routes its top-k experts
of each layer as a draw from weights that only the generator's hidden state (topic and phrase)
determines (:func:`~moet_vllm.planning.traces.synthetic_state`). Whatever an online policy does,
in any of the models above, the pool it holds when a step starts was chosen before the step's
draw, so the step is replay-free with probability at most ``max_{|S| <= n_slots} P(R_t within
S | state)``; :func:`online_clean_bound` bounds that and sums the expected replays.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..residency.policy import DEFAULT_PREDICT_THRESHOLD, Plan, ResidencyPolicy, lowest

ONLINE = ("lru", "lfu", "decay")
OFFLINE = ("min", "belady")
POLICIES = ONLINE + OFFLINE
#: prefetch on replay steps: online (decayed frequency) and its clairvoyant reference
PREFETCHING = ("decay+pf", "min+pf")
#: fetch before the forward what the step's input tokens are predicted to route (needs tokens)
PREDICT = "predict"
#: extra keys a replayed step fetches, by default (decay+pf, min+pf)
DEFAULT_PREFETCH = 16


def decode_steps(ids: np.ndarray, n_experts: int, batch: int = 1) -> np.ndarray:
    """Routed flat keys of each decode step: int64 [steps, batch * moe_layers * top_k].

    Batch 1: one token per step. Batch B: the trace is cut into B contiguous parts of
    ``tokens // B`` tokens, treated as B concurrent sequences; step t routes token t of each part
    (a key routed by several tokens appears once per token; the step needs their union).
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


def hottest(steps: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` most routed keys of ``steps``, hottest first (ties: lowest id)."""
    counts = np.bincount(np.asarray(steps).ravel())
    seen = np.flatnonzero(counts)
    return lowest(seen, min(n, len(seen)), -counts)


class LRUPolicy(ResidencyPolicy):
    """Evicts the least recently routed key (ties: lowest key id)."""

    def _victims(self, cands: np.ndarray, n: int) -> np.ndarray:
        return lowest(cands, n, self.last_use)


class BeladyPolicy(ResidencyPolicy):
    """The offline policies for the steps they are built from (see the module doc):
    ``step_aware=False`` is MIN, ``True`` is Belady for replay steps. Ties: lowest key id.
    Must be driven with exactly those steps."""

    def __init__(
        self, n_slots: int, moe_layers: int, n_experts: int, steps: np.ndarray, step_aware: bool
    ) -> None:
        super().__init__(n_slots, moe_layers, n_experts, predict_threshold=0.0)
        self.step_aware = step_aware
        self._uniq = unique_steps(steps)
        self.never = len(self._uniq)
        seen = np.full(self.n_keys, self.never, dtype=np.int64)
        self._next: list[np.ndarray] = [None] * len(self._uniq)
        for t in range(len(self._uniq) - 1, -1, -1):
            keys = self._uniq[t]
            self._next[t] = seen[keys]
            seen[keys] = t
        self.next_use = seen  # every key's next routing (a preloaded key waits for its first)

    def _victims(self, cands: np.ndarray, n: int) -> np.ndarray:
        if not self.step_aware:
            return lowest(cands, n, -self.next_use)
        # steps bound to replay: the next routing of a key that is not resident now (the
        # current step's own misses mark the current step, which no candidate is routed in)
        doomed = np.zeros(self.never + 1, dtype=bool)
        doomed[self.next_use[self.slot_table.ravel() < 0]] = True
        doomed[self.never] = True
        # one key: keys of doomed steps (never again included) before the others, then MIN
        prio = np.where(doomed[self.next_use], -(self.never + 1), 0) - self.next_use
        return lowest(cands, n, prio)

    def observe(self, routed: np.ndarray) -> None:
        t = self.steps
        self.next_use[self._uniq[t]] = self._next[t]
        self.last_use[self._uniq[t]] = t
        self.steps += 1


class PrefetchOnReplay:
    """Mixin: a replayed decode step also fetches up to ``prefetch`` keys that are not resident,
    best first in the policy's own order (:meth:`_rank`), each into a free slot or the slot of the
    lowest-ranked unpinned resident key, and only while the fetched key ranks strictly above the
    key it displaces. A replay-free step fetches nothing. The prefetches come last in
    ``Plan.fetch_keys`` (``Plan.n_prefetch``)."""

    prefetch: int = 0

    def _rank(self) -> tuple[np.ndarray, ...]:
        """Per-key orders, lowest first = evicted first (ties: the next order, then the id)."""
        raise NotImplementedError

    def _prefetchable(self) -> np.ndarray:
        """bool [n_keys]: keys worth fetching at all."""
        raise NotImplementedError

    def plan(self, routed, scan=None) -> Plan:
        plan = super().plan(routed, scan)
        if not plan.replay or self.prefetch <= 0 or (scan is not None and len(scan)):
            return plan
        table = self.slot_table.ravel().copy()
        table[plan.evict_keys] = -1
        table[plan.fetch_keys] = plan.fetch_slots
        occupied = self.slot_keys >= 0
        occupied[plan.evict_slots] = False
        occupied[plan.fetch_slots] = True
        orders = self._rank()
        cands = np.flatnonzero((table < 0) & self._prefetchable())
        cands = lowest(cands, min(self.prefetch, len(cands)), *[-o for o in orders])
        if len(cands) == 0:
            return plan
        free = np.flatnonzero(~occupied)[: len(cands)]
        pinned = np.zeros(self.n_keys, dtype=bool)
        pinned[np.asarray(routed, dtype=np.int64).ravel()] = True
        resident = np.flatnonzero(table >= 0)
        victims = lowest(resident[~pinned[resident]], len(cands) - len(free), *orders)
        n_swap = 0
        for c, v in zip(cands[len(free) :], victims):
            if not _outranks(orders, c, v):
                break
            n_swap += 1
        victims = victims[:n_swap]
        keys = cands[: len(free) + n_swap]
        if len(keys) == 0:
            return plan
        vslots = table[victims].astype(np.int64)
        return replace(
            plan,
            fetch_keys=np.concatenate([plan.fetch_keys, keys]),
            fetch_slots=np.concatenate([plan.fetch_slots, free, vslots]),
            evict_keys=np.concatenate([plan.evict_keys, victims]),
            evict_slots=np.concatenate([plan.evict_slots, vslots]),
            n_prefetch=len(keys),
        )


def _outranks(orders: tuple[np.ndarray, ...], a: int, b: int) -> bool:
    """Whether key ``a`` sorts strictly after key ``b`` (is kept before it)."""
    for o in orders:
        if o[a] != o[b]:
            return bool(o[a] > o[b])
    return False


class DecayPrefetchPolicy(PrefetchOnReplay, ResidencyPolicy):
    """Decayed frequency that also prefetches on replay steps (``decay+pf``): the keys of highest
    decayed frequency that are not resident."""

    def __init__(self, n_slots, moe_layers, n_experts, *, prefetch=DEFAULT_PREFETCH, **knobs):
        super().__init__(n_slots, moe_layers, n_experts, **knobs)
        self.prefetch = int(prefetch)

    def _rank(self):
        return (self.score, self.last_use)

    def _prefetchable(self):
        return self.score > 0


class MinPrefetchPolicy(PrefetchOnReplay, BeladyPolicy):
    """``min+pf``, offline: MIN's victims, and on replay steps the keys routed soonest."""

    def __init__(self, n_slots, moe_layers, n_experts, steps, *, prefetch=DEFAULT_PREFETCH):
        super().__init__(n_slots, moe_layers, n_experts, steps, step_aware=False)
        self.prefetch = int(prefetch)

    def _rank(self):
        return (-self.next_use,)

    def _prefetchable(self):
        return self.next_use < self.never


class PredictPolicy(ResidencyPolicy):
    """The serving policy driven by a trace with tokens (``predict``): before each step's forward
    pass, :meth:`~ResidencyPolicy.plan_ahead` of the step's input tokens; after it,
    :meth:`~ResidencyPolicy.learn` from what each of them routed. ``tokens`` int [steps, batch]:
    the input token ids of each step; ``token_keys`` int [steps, batch, keys per token]: the flat
    keys each of them routed."""

    def __init__(self, n_slots, moe_layers, n_experts, tokens, token_keys, **knobs):
        knobs.setdefault("predict_threshold", DEFAULT_PREDICT_THRESHOLD)
        super().__init__(n_slots, moe_layers, n_experts, **knobs)
        self.step_tokens = np.asarray(tokens, dtype=np.int64)
        self.token_keys = np.asarray(token_keys, dtype=np.int64)
        if self.step_tokens.shape != self.token_keys.shape[:2]:
            raise ValueError("tokens [steps, batch] and token_keys [steps, batch, k] must agree")

    def before_step(self, t: int) -> Plan:
        """The fetch before step ``t``'s forward pass (an empty plan when nothing is predicted)."""
        return self.plan_ahead(self.step_tokens[t])

    def observe(self, routed) -> None:
        t = self.steps
        self.learn(self.step_tokens[t], self.token_keys[t])
        super().observe(routed)


def step_tokens(ids: np.ndarray, tokens: np.ndarray, n_experts: int, batch: int = 1):
    """For ``predict``: (int64 [steps, batch] input token ids, int64 [steps, batch, moe_layers *
    top_k] the flat keys each routed), cut into steps as :func:`decode_steps` does."""
    n_tok, n_layers, k = ids.shape
    if len(tokens) < n_tok:
        raise ValueError(f"{len(tokens)} tokens for a trace of {n_tok}")
    n = n_tok // batch
    toks = np.asarray(tokens[: n * batch], dtype=np.int64).reshape(batch, n).T
    flat = np.arange(n_layers, dtype=np.int64)[None, :, None] * n_experts + ids.astype(np.int64)
    keys = flat[: n * batch].reshape(batch, n, n_layers * k).transpose(1, 0, 2)
    return np.ascontiguousarray(toks), np.ascontiguousarray(keys)


def make_policy(
    name: str,
    n_slots: int,
    moe_layers: int,
    n_experts: int,
    steps: np.ndarray,
    *,
    prefetch: int = DEFAULT_PREFETCH,
    tokens: np.ndarray | None = None,
    token_keys: np.ndarray | None = None,
    **knobs,
) -> ResidencyPolicy:
    """A fresh policy by name (``POLICIES``, ``PREFETCHING``, ``PREDICT``); ``knobs`` go to the
    decayed-frequency policy (and to ``predict``, which needs ``tokens`` and ``token_keys``:
    :func:`step_tokens`). Only ``predict`` predicts: the others get ``predict_threshold=0``."""
    if name == PREDICT:
        if tokens is None or token_keys is None:
            raise ValueError("'predict' needs the trace's tokens and the keys each one routed")
        return PredictPolicy(n_slots, moe_layers, n_experts, tokens, token_keys, **knobs)
    knobs["predict_threshold"] = 0.0
    if name == "decay":
        return ResidencyPolicy(n_slots, moe_layers, n_experts, **knobs)
    if name == "lfu":
        return ResidencyPolicy(
            n_slots, moe_layers, n_experts, half_life_steps=math.inf, predict_threshold=0.0
        )
    if name == "lru":
        return LRUPolicy(n_slots, moe_layers, n_experts, predict_threshold=0.0)
    if name in OFFLINE:
        return BeladyPolicy(n_slots, moe_layers, n_experts, steps, step_aware=name == "belady")
    if name == "decay+pf":
        return DecayPrefetchPolicy(n_slots, moe_layers, n_experts, prefetch=prefetch, **knobs)
    if name == "min+pf":
        return MinPrefetchPolicy(n_slots, moe_layers, n_experts, steps, prefetch=prefetch)
    known = (*POLICIES, *PREFETCHING, PREDICT)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(known)}")


@dataclass
class SimResult:
    policy: str
    n_slots: int
    steps: int  # measured steps (after the warm-up)
    replay_steps: int
    missing_pairs: int  # routed keys not resident when their step's first pass ran
    bytes_fetched: int  # every fetched row (missing, prefetched, fetched before the forward)
    fetched_rows: int = 0
    early_fetch_steps: int = 0  # steps that fetched before their forward pass (predict)

    @property
    def replay_pct(self) -> float:
        return 100.0 * self.replay_steps / max(self.steps, 1)

    @property
    def missing_per_step(self) -> float:
        return self.missing_pairs / max(self.steps, 1)

    @property
    def rows_per_step(self) -> float:
        return self.fetched_rows / max(self.steps, 1)

    @property
    def early_fetch_pct(self) -> float:
        return 100.0 * self.early_fetch_steps / max(self.steps, 1)

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "replay_pct": self.replay_pct,
            "missing_per_step": self.missing_per_step,
            "rows_per_step": self.rows_per_step,
            "early_fetch_pct": self.early_fetch_pct,
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
    """Drive ``policy`` through every step (``decode_steps``); count the steps from ``warmup`` on.

    ``initial``: keys preloaded before the first step, hottest first (a warm start). A policy with
    a ``before_step(t)`` method (``predict``) fetches what it returns before step t's forward.
    """
    if initial is not None:
        policy.commit(policy.plan_preload(initial))
    before = getattr(policy, "before_step", None)
    replays = pairs = rows = early = 0
    for t, routed in enumerate(steps):
        n_early = 0
        if before is not None:
            pre = before(t)
            policy.commit(pre)
            n_early = len(pre.fetch_keys)
        plan = policy.step(routed)
        if t >= warmup:
            replays += plan.replay
            pairs += plan.n_missing
            rows += len(plan.fetch_keys) + n_early
            early += n_early > 0
    n = max(len(steps) - warmup, 0)
    return SimResult(name, policy.n_slots, n, replays, pairs, rows * slot_bytes, rows, early)


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
    """``simulate`` a fresh policy by name (``knobs``: see :func:`make_policy`)."""
    pol = make_policy(name, n_slots, moe_layers, n_experts, steps, **knobs)
    return simulate(pol, steps, warmup=warmup, initial=initial, slot_bytes=slot_bytes, name=name)


# -- the lower bound ----------------------------------------------------------------------------


def replay_lower_bound(
    steps: np.ndarray | list[np.ndarray],
    n_slots: int,
    *,
    warmup: int = 0,
    initial: np.ndarray | None = None,
    iters: int = 400,
    upper: int | None = None,
) -> int:
    """A number of replay steps in ``[warmup, steps)`` that no schedule can go below.

    Boundary b is the pool at the start of step b. A replay-free step s needs every key of R_s
    kept since its previous routing p: at boundaries p+2..s it takes a slot beyond R_{b-1}, whose
    capacity is ``n_slots - |R_{b-1}|``. With ``warmup > 0`` the pool at boundary ``warmup`` may
    hold any ``n_slots`` keys (a relaxation: every reachable state is allowed), so a key last routed
    before the window counts from there; with ``warmup == 0`` the pool starts with ``initial`` (or
    empty) and the first routing of any other key forces a replay.

    Choosing the replay-free steps is a packing problem; for any prices ``lam >= 0`` on the
    boundaries, ``sum_b lam_b cap_b + sum_s max(0, 1 - cost_s(lam))`` bounds the replay-free steps
    from above (weak duality of its LP relaxation). Projected subgradient steps lower it (Polyak
    steps aimed at ``upper``, the replay-free steps of a feasible schedule, when given); the bound
    is valid at every iterate, and the best one is returned.
    """
    uniq = unique_steps(steps) if isinstance(steps, np.ndarray) else list(steps)
    T = len(uniq)
    b0 = int(warmup)
    if not 0 <= b0 <= T:
        raise ValueError(f"warmup must be in [0, {T}]")
    n_window = T - b0
    if n_window == 0:
        return 0
    sizes = np.array([len(u) for u in uniq], dtype=np.int64)
    if int(sizes.max()) > n_slots:
        raise ValueError(f"a step routes {int(sizes.max())} keys, more than {n_slots} slots")
    n_keys = max(int(u.max()) + 1 for u in uniq if len(u))
    preloaded = np.zeros(n_keys, dtype=bool)
    if initial is not None and b0 == 0:
        init = np.unique(np.asarray(initial, dtype=np.int64))
        if len(init) > n_slots:
            raise ValueError("initial holds more keys than slots")
        preloaded[init[init < n_keys]] = True

    last = np.full(n_keys, -1, dtype=np.int64)
    forced = np.zeros(T, dtype=bool)
    starts, ends = [], []
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
    free = np.flatnonzero(~forced[b0:]) + b0
    if len(free) == 0:
        return n_window
    # intervals grouped by (end step, start boundary), with multiplicities
    pair = np.unique(np.concatenate(ends) * (T + 1) + np.concatenate(starts), return_counts=True)
    e_u, a_u, w_u = pair[0] // (T + 1), pair[0] % (T + 1), pair[1].astype(np.float64)
    n_s = np.bincount(e_u, weights=w_u, minlength=T)  # kept intervals a replay-free step needs
    cap = np.empty(T, dtype=np.float64)
    cap[0] = n_slots
    cap[1:] = n_slots - sizes[:-1]
    cap[b0] = n_slots

    lam = np.zeros(T, dtype=np.float64)
    best = float(len(free))
    target = float(upper) if upper is not None else None
    theta, stall = 1.0, 0
    for _ in range(iters):
        cum = np.concatenate([[0.0], np.cumsum(lam)])  # cum[b + 1] = lam[0] + ... + lam[b]
        cost = n_s * cum[1:] - np.bincount(e_u, weights=w_u * cum[a_u], minlength=T)
        slack = np.maximum(0.0, 1.0 - cost[free])
        val = float(lam[b0:] @ cap[b0:]) + float(slack.sum())
        if val < best - 1e-9:
            best, stall = val, 0
        else:
            stall += 1
            if stall >= 20:
                theta, stall = theta / 2, 0
        active = np.zeros(T, dtype=bool)
        active[free[slack > 0]] = True
        on = active[e_u]
        delta = np.bincount(a_u[on], weights=w_u[on], minlength=T + 1).astype(np.float64)
        delta[1:] -= n_s * active
        g = cap - np.cumsum(delta)[:T]
        g[:b0] = 0.0
        g[(lam <= 0) & (g > 0)] = 0.0  # projection: prices stay >= 0
        gg = float(g @ g)
        if gg == 0.0:
            break
        goal = target if target is not None else 0.9 * best
        lam = np.maximum(0.0, lam - theta * max(val - goal, 1e-3) / gg * g)
    clean_max = math.floor(best + 1e-6)
    return n_window - min(clean_max, n_window)


def prefetch_lower_bound(
    steps: np.ndarray | list[np.ndarray], n_slots: int, *, warmup: int = 0
) -> int:
    """Replay steps in ``[warmup, steps)`` that no schedule which changes the pool only at replay
    steps can go below, whatever it fetches there and whatever it knows (prefetching included).

    Between two replays the pool does not change, so it holds every key the steps in between
    route: the steps cut into runs whose keys fit in ``n_slots``, each run after the first
    starting with a replay (the pool at ``warmup`` may be anything, as in
    :func:`replay_lower_bound`). Cutting each run as late as possible gives the fewest runs, so
    this is exact for an unbounded fetch budget.
    """
    uniq = unique_steps(steps) if isinstance(steps, np.ndarray) else list(steps)
    n_keys = max((int(u.max()) + 1 for u in uniq if len(u)), default=1)
    held = np.zeros(n_keys, dtype=bool)
    count = replays = 0
    for keys in uniq[warmup:]:
        if len(keys) > n_slots:
            raise ValueError(f"a step routes {len(keys)} keys, more than {n_slots} slots")
        new = keys[~held[keys]]
        if count + len(new) > n_slots:
            replays += 1
            held[:] = False
            held[keys] = True
            count = len(keys)
        else:
            held[new] = True
            count += len(new)
    return replays


def online_clean_bound(weights, step_tokens: np.ndarray, top_k: int, pools) -> np.ndarray:
    """Expected replay steps (float64, one per pool size in ``pools``) that no online policy can go
    below when each token's routing is a Plackett-Luce draw of ``top_k`` distinct experts per
    layer from weights known in advance (a synthetic trace's hidden state,
    :meth:`~moet_vllm.planning.traces.SyntheticState.weights`), independent of everything else.

    ``weights(token)`` -> float [moe_layers, E]; ``step_tokens`` int [steps, batch]: the tokens of
    each counted step. A policy holds some pool S before the step's draw; the step is replay-free
    when every draw lands in S. Drawing without replacement, each draw lands in S_l with
    probability at most W(S_l) / W_l (the weight of S_l in layer l's total: removing drawn
    experts of S_l only lowers the share), so P(replay-free) <= prod over the step's tokens and
    layers of (W(S_l) / W_l) ** top_k. Its logarithm is concave in the slots given to each layer
    (the best S_l of a size is the heaviest experts; letting each token choose its own set only
    raises the bound), so giving slots greedily to the largest gain maximizes it exactly.
    """
    pools = np.asarray(pools, dtype=np.int64)
    step_tokens = np.asarray(step_tokens, dtype=np.int64)
    if step_tokens.ndim == 1:
        step_tokens = step_tokens[:, None]
    out = np.zeros(len(pools), dtype=np.float64)
    for toks in step_tokens:
        f = 0.0
        for tok in toks:
            w = np.sort(np.asarray(weights(int(tok)), dtype=np.float64), axis=1)[:, ::-1]
            share = np.cumsum(w, axis=1) / w.sum(axis=1, keepdims=True)
            f = f + top_k * np.log(np.minimum(share, 1.0))  # [L, E]: f[l, s - 1] for s slots
        n_layers = f.shape[0]
        base = float(f[:, top_k - 1].sum())  # every layer needs top_k slots
        gains = np.sort(np.diff(f[:, top_k - 1 :], axis=1).ravel())[::-1]
        cum = np.concatenate([[0.0], np.cumsum(gains)])
        extra = np.clip(pools - n_layers * top_k, -1, len(gains))
        log_p = np.where(extra < 0, -np.inf, base + cum[np.maximum(extra, 0)])
        out += 1.0 - np.exp(log_p)
    return out
