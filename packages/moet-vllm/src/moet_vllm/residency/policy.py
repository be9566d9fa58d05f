"""The serving cache policy of the GPU expert pool: promotion/eviction by decayed frequency.

One pool of ``n_slots`` expert slots is shared by every MoE layer (design.md, "Residency and
replay"). A key is one (moe_layer, expert) pair, carried as a flat id ``moe_layer * n_experts +
expert`` (:func:`key_ids`, :func:`key_pairs`). The policy mirrors the device ``slot_table``
(int32 [moe_layers, n_experts], -1 = not resident) on the host and decides, between two forward
passes, which rows to fetch into which slots and which keys give their slots up. It never touches
memory: the residency manager copies the rows and publishes the slot table.

A step, as the manager drives it::

    plan = policy.plan(routed, scan=prefill)  # pure: what the step needs, nothing changes yet
    #   evictions: slot_table[l, e] = -1; fetches: copy the row into pool[slot], then
    #   slot_table[l, e] = slot; a failed copy publishes nothing and the plan is simply dropped
    policy.commit(plan)                       # the host mirror follows the published table
    policy.observe(decode_routed)             # once per step, after its last forward pass
    policy.learn(tokens, token_keys)          # what each input token routed (the predictor)

and, before a decode step's first forward pass, ``plan_ahead(tokens)`` (the predicted fetch).
:meth:`ResidencyPolicy.step` does plan + commit + observe at once (the simulator, tests). Rules:

- **Demand, and predicted from the tokens.** A key enters the pool when a step routes it and it
  is missing (the step then replays with it resident), or before a decode step's forward pass
  when the step's input tokens are predicted to route it (:class:`TokenTable`: the share of the
  earlier occurrences of that token id that routed it is at least ``predict_threshold``); the
  predicted keys are pinned while that fetch is planned. Free slots are used first, lowest index
  first. Nothing else is prefetched.
- **Pins.** Every key routed by the current step (decode and scan alike, and for a second-order
  replay the union of the step's passes) is pinned: it is never a victim while the step runs.
  The one exception: when a step's decode and scan keys together outnumber the slots, decode
  misses take the slots of the step's resident scan keys, which then come back as unplaced.
- **Victims** are the resident, unpinned keys with the lowest decayed frequency; ties go to the
  least recently used, then to the lowest key id. The same inputs always give the same plan.
- **Scans.** Prefill keys (``scan``) fill free slots, then may evict only *probation* keys: those
  outside the decode hot set, the ``protected_fraction`` of the pool with the highest decayed
  frequency. A scan never evicts the hot set; scan keys that find no room come back in
  ``Plan.unplaced`` (the manager splits the chunk or serves it without caching). Scans do not
  raise frequencies: a prefill chunk touches most experts once and would flatten the scores.

Decayed frequency: after each step every score is multiplied by ``decay = 2 ** (-1 / half_life)``
and each key gets +1 per token of the step that routed it, so a key's score is the number of its
routings with a weight halving every ``half_life`` steps (the LRFU family: a half-life of 0 is
LRU, an infinite one LFU). The default half-life, :data:`DEFAULT_HALF_LIFE_STEPS` = 32 steps, was
chosen on the policy simulator (docs/residency.md, bench/residency.py --tune): over half-lives from
8 steps to infinity it had the fewest missing pairs and, within 1%, the fewest replays on the
synthetic traces (with the fixture's real trace added, 128 steps replays 0.5% fewer steps). Routing
drifts with the text (an expert hot for a few hundred tokens, then cold), which long memories
follow too slowly (LFU replayed up to 3x more often on the DeepSeek-shaped trace), while 32 steps
still ranks an expert routed every few steps above one routed once.

The prediction: a step's input tokens are known before its forward pass, and which experts a
token routes depends much on the token itself (on the fixture model's test split the experts
that token id routed most often before are 56-72% of those it routes, the previous token's 19-26%).
Fetching them before the forward turns would-be replays into one batched copy without a second
forward pass; on the fixture's trace it brought the replay % from 1.5-3.1x Belady's (decayed
frequency alone, batch 1, pools of 30-95%) to 0.8-1.5x, for 2-5.2x the rows fetched
(docs/residency.md). The default threshold, :data:`DEFAULT_PREDICT_THRESHOLD` = 0.1, is the
simulator's trade between the two (bench/residency.py --tune).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

#: Steps after which a routing counts half (docs/residency.md: the simulator's sweep).
DEFAULT_HALF_LIFE_STEPS = 32.0
#: Share of the pool (the hottest resident keys) that a scan may never evict.
DEFAULT_PROTECTED_FRACTION = 0.8
#: P(key | input token id) from which a key is fetched before the forward pass (0: no prediction).
DEFAULT_PREDICT_THRESHOLD = 0.1
#: Host memory of the token table (:class:`TokenTable`); token ids share rows beyond it.
DEFAULT_TABLE_BYTES = 256 << 20
#: Rows of the token table at most (more than the vocabularies of the models served).
MAX_TABLE_ROWS = 1 << 18
#: Reading in place: rows promoted into the pool after one decode pass at most. On the GLM-4.5-Air
#: shape's concentrated trace the hotter-than-the-victim rule alone promotes 5-13 rows a pass at
#: 60-90% pools (batch 8-32); the cap bounds a burst (a topic change) to ~1.3 ms of PCIe at 4.4 MB
#: a row (docs/residency.md, "Reading in place").
PROMOTE_ROWS_PER_PASS = 16

_EMPTY = np.zeros(0, dtype=np.int64)


def key_ids(moe_layers: np.ndarray, experts: np.ndarray, n_experts: int) -> np.ndarray:
    """Flat key ids (int64) of (moe_layer, expert) pairs."""
    return np.asarray(moe_layers, dtype=np.int64) * n_experts + np.asarray(experts, np.int64)


def key_pairs(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """int64 [n, 2] (moe_layer, expert) of flat key ids."""
    ids = np.asarray(ids, dtype=np.int64)
    return np.stack([ids // n_experts, ids % n_experts], axis=1)


def distinct(ids: np.ndarray, n_keys: int) -> np.ndarray:
    """The distinct flat key ids of ``ids`` (each in [0, n_keys)), ascending. A routed mask's
    keys (np.nonzero of it) are that already and come back as they are; others go through a mask
    over the keys, which costs less host time than np.unique's sort at decode sizes."""
    ids = np.asarray(ids, dtype=np.int64).ravel()
    if len(ids) < 2 or bool(np.all(ids[1:] > ids[:-1])):
        return ids
    seen = np.zeros(n_keys, dtype=bool)
    seen[ids] = True
    return np.flatnonzero(seen)


def routed_keys(topk_ids: np.ndarray, n_experts: int) -> np.ndarray:
    """Flat key ids (int64, one per routing) of routed expert ids ``[tokens, moe_layers, top_k]``.

    Duplicates are kept: :meth:`ResidencyPolicy.observe` counts a key once per token that routes
    it; :meth:`ResidencyPolicy.plan` de-duplicates.
    """
    topk_ids = np.asarray(topk_ids)
    if topk_ids.ndim != 3:
        raise ValueError(
            f"routed expert ids must be [tokens, moe_layers, top_k], got {topk_ids.shape}"
        )
    layer = np.arange(topk_ids.shape[1], dtype=np.int64)[None, :, None]
    return (layer * n_experts + topk_ids.astype(np.int64)).ravel()


@dataclass(frozen=True)
class Plan:
    """What changes in the pool between two forward passes.

    Apply ``evict`` (slot_table[l, e] = -1), copy each ``fetch`` row into ``pool[slot]`` (one
    batched H2D copy), then publish ``slot_table[l, e] = slot`` for the fetches. ``fetch_slots``
    reuse free slots and the slots of ``evict_keys``. ``unplaced_keys`` are scan keys that found no
    free or probation slot (never decode keys). ``version`` ties the plan to the policy state it was
    computed from: :meth:`ResidencyPolicy.commit` refuses a stale plan. The last ``n_prefetch``
    fetches are prefetches, not missing keys (the simulator's prefetching policies; the serving
    policy fetches on demand only).
    """

    fetch_keys: np.ndarray = field(default_factory=lambda: _EMPTY)
    fetch_slots: np.ndarray = field(default_factory=lambda: _EMPTY)
    evict_keys: np.ndarray = field(default_factory=lambda: _EMPTY)
    evict_slots: np.ndarray = field(default_factory=lambda: _EMPTY)
    unplaced_keys: np.ndarray = field(default_factory=lambda: _EMPTY)
    version: int = 0
    preload: bool = False
    n_prefetch: int = 0

    @property
    def n_missing(self) -> int:
        """Routed keys that were not resident at the start of the step."""
        return len(self.fetch_keys) - self.n_prefetch + len(self.unplaced_keys)

    @property
    def replay(self) -> bool:
        """Whether the step's first forward pass missed (it must be replayed)."""
        return self.n_missing > 0


def lowest(cands: np.ndarray, n: int, *orders: np.ndarray) -> np.ndarray:
    """The ``n`` candidate ids that sort first by ``orders[0][id]``, then ``orders[1][id]``, ...,
    then by id; in that order. ``cands`` must be sorted ascending. A partition on the first
    order, a sort of the ties at the cut and of the ``n`` chosen."""
    if n <= 0:
        return _EMPTY
    first = orders[0][cands]
    if n < len(cands):
        cut = np.partition(first, n - 1)[n - 1]
        below, ties = cands[first < cut], cands[first == cut]
        need = n - len(below)
        if need < len(ties):
            rest = [o[ties] for o in reversed(orders[1:])]
            ties = ties[np.lexsort((ties, *rest))[:need]]
        cands = np.concatenate([below, ties])
    # lexsort: the last key is the primary one; ids break the remaining ties
    order = np.lexsort((cands, *(o[cands] for o in reversed(orders[1:])), orders[0][cands]))
    return cands[order]


class TokenTable:
    """Which keys each input token id routed: P(key | token), counted online, in bounded memory.

    One row of uint16 counts per token id (``counts[row, key]``, ``seen[row]`` occurrences), at
    most ``max_bytes`` of them and :data:`MAX_TABLE_ROWS` (allocated zeroed, so untouched rows
    cost no memory). A token id
    owns row ``token % rows`` (``tag``); when another id maps there, each of its occurrences
    takes one from the owner's ``seen``, and the row changes hands when that reaches 0 (the
    frequent ids keep their rows, as in a Misra-Gries summary). A row halves its counts before
    they would overflow. Nothing else: the table never touches the pool.
    """

    def __init__(self, n_keys: int, max_bytes: int = DEFAULT_TABLE_BYTES) -> None:
        self.n_keys = int(n_keys)
        self.rows = int(min(max(max_bytes // (2 * self.n_keys), 1), MAX_TABLE_ROWS))
        self.counts = np.zeros((self.rows, self.n_keys), dtype=np.uint16)
        self.seen = np.zeros(self.rows, dtype=np.int64)
        self.tag = np.full(self.rows, -1, dtype=np.int64)

    def learn(self, tokens: np.ndarray, token_keys: np.ndarray) -> None:
        """``tokens`` int [n]: input token ids; ``token_keys`` int [n, k]: the flat keys each one
        routed (every MoE layer's top-k)."""
        tokens = np.asarray(tokens, dtype=np.int64).ravel()
        token_keys = np.asarray(token_keys, dtype=np.int64).reshape(len(tokens), -1)
        if len(tokens) == 0:
            return
        if int(tokens.min()) < 0:
            raise ValueError("token ids must be >= 0")
        uniq, inv, occ = np.unique(tokens, return_inverse=True, return_counts=True)
        rows = uniq % self.rows
        for i in np.flatnonzero(self.tag[rows] != uniq):  # another id's row: worn down
            row, tok, n = int(rows[i]), int(uniq[i]), int(occ[i])
            if self.seen[row] > n:
                self.seen[row] -= n
            else:  # taken over, with the new id's own counts only
                self.tag[row], self.seen[row] = tok, 0
                self.counts[row] = 0
        take = (self.tag[rows] == uniq)[inv]  # (two new ids of one row: the last one wins)
        if not take.any():
            return
        trows = rows[inv[take]]
        hot, n_hot = np.unique(trows, return_counts=True)
        full = hot[self.seen[hot] + n_hot >= 0xFFFF]
        if len(full):  # halve before a count could overflow (counts <= seen)
            self.counts[full] //= 2
            self.seen[full] //= 2
        self.seen[hot] += n_hot
        keys = token_keys[take]
        flat = self.counts.reshape(-1)
        np.add.at(flat, (trows[:, None] * self.n_keys + keys).ravel(), 1)

    def predict(self, tokens: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
        """(keys, P) of the keys that some token of ``tokens`` routed with a share >= threshold,
        most likely first (ties: lowest key id). Unknown tokens predict nothing."""
        tokens = np.unique(np.asarray(tokens, dtype=np.int64).ravel())
        rows = tokens % self.rows
        rows = rows[(self.tag[rows] == tokens) & (self.seen[rows] > 0)]
        if len(rows) == 0 or threshold <= 0:
            return _EMPTY, np.zeros(0)
        prob = (self.counts[rows] / self.seen[rows, None].astype(np.float64)).max(axis=0)
        keys = np.flatnonzero(prob >= threshold)
        keys = lowest(keys, len(keys), -prob)
        return keys, prob[keys]


class ResidencyPolicy:
    """Slot assignment and decayed-frequency eviction for one pool shared by all MoE layers.

    ``slot_table`` (int32 [moe_layers, n_experts], -1 = not resident) and ``slot_keys`` (int64
    [n_slots], -1 = free) are the host mirror of the device tables after the last commit.
    """

    def __init__(
        self,
        n_slots: int,
        moe_layers: int,
        n_experts: int,
        *,
        half_life_steps: float = DEFAULT_HALF_LIFE_STEPS,
        protected_fraction: float = DEFAULT_PROTECTED_FRACTION,
        predict_threshold: float = DEFAULT_PREDICT_THRESHOLD,
        table_bytes: int = DEFAULT_TABLE_BYTES,
    ) -> None:
        if n_slots < 1 or moe_layers < 1 or n_experts < 1:
            raise ValueError("n_slots, moe_layers and n_experts must be >= 1")
        if not half_life_steps > 0:
            raise ValueError(f"half_life_steps must be > 0, got {half_life_steps}")
        if not 0.0 <= protected_fraction <= 1.0:
            raise ValueError(f"protected_fraction must be in [0, 1], got {protected_fraction}")
        if not 0.0 <= predict_threshold <= 1.0:
            raise ValueError(f"predict_threshold must be in [0, 1], got {predict_threshold}")
        self.n_slots = int(n_slots)
        self.moe_layers = int(moe_layers)
        self.n_experts = int(n_experts)
        self.half_life_steps = float(half_life_steps)
        self.decay = 2.0 ** (-1.0 / self.half_life_steps)
        self.protected_fraction = float(protected_fraction)
        n_keys = self.moe_layers * self.n_experts
        self.slot_table = np.full((self.moe_layers, self.n_experts), -1, dtype=np.int32)
        self.slot_keys = np.full(self.n_slots, -1, dtype=np.int64)
        self.score = np.zeros(n_keys, dtype=np.float64)  # decayed routings (decode only)
        self.last_use = np.full(n_keys, -1, dtype=np.int64)  # step of the last decode or scan use
        self.steps = 0  # steps observed
        self.version = 0  # commits applied
        self.predict_threshold = float(predict_threshold)
        self.tokens = TokenTable(n_keys, table_bytes) if self.predict_threshold > 0 else None

    # -- what the manager calls -------------------------------------------------------------

    @property
    def n_keys(self) -> int:
        return self.moe_layers * self.n_experts

    @property
    def resident(self) -> np.ndarray:
        """Flat ids of the resident keys, ascending."""
        return np.flatnonzero(self.slot_table.ravel() >= 0)

    def plan(self, routed: np.ndarray, scan: np.ndarray | None = None) -> Plan:
        """The fetches and evictions that make every routed key of a step resident.

        ``routed``: flat key ids the step's decode tokens route (duplicates allowed); ``scan``:
        flat key ids its prefill tokens route. Pure: the policy does not change until
        :meth:`commit`. Raises ``ValueError`` when the decode keys alone outnumber the slots.
        """
        dec = self._unique(routed)
        scn = self._unique(scan) if scan is not None else _EMPTY
        if len(dec) > self.n_slots:
            raise ValueError(
                f"a step routes {len(dec)} distinct decode (moe_layer, expert) pairs but the pool "
                f"has {self.n_slots} slots: the pool must hold at least one step"
            )
        table = self.slot_table.ravel()
        miss_dec = dec[table[dec] < 0]
        if len(scn):
            scn = np.setdiff1d(scn, dec, assume_unique=True)
        miss_scn = scn[table[scn] < 0]
        if len(miss_dec) == 0 and len(miss_scn) == 0:
            return Plan(version=self.version)

        free = np.flatnonzero(self.slot_keys < 0)
        pinned = np.zeros(self.n_keys, dtype=bool)
        pinned[dec] = True
        pinned[scn] = True
        evictable = self.resident
        evictable = evictable[~pinned[evictable]]

        # decode misses: free slots first, then the coldest unpinned keys anywhere, and last the
        # slots of this step's resident scan keys (decode and scan together outnumber the slots)
        n_free = min(len(free), len(miss_dec))
        short = len(miss_dec) - n_free
        victims = self._victims(evictable, min(short, len(evictable)))
        bumped = _EMPTY
        if short > len(victims):
            scan_resident = scn[table[scn] >= 0]
            bumped = self._victims(scan_resident, short - len(victims))
            victims = np.concatenate([victims, bumped])
        dec_slots = np.concatenate([free[:n_free], table[victims].astype(np.int64)])
        free = free[n_free:]

        # scan misses: remaining free slots, then probation keys (never the decode hot set)
        scan_victims = _EMPTY
        if len(miss_scn):
            n_free_s = min(len(free), len(miss_scn))
            left = len(miss_scn) - n_free_s
            if left:
                probation = np.setdiff1d(evictable, victims, assume_unique=True)
                probation = np.setdiff1d(probation, self.hot_set(), assume_unique=True)
                scan_victims = self._victims(probation, min(left, len(probation)))
            scn_slots = np.concatenate([free[:n_free_s], table[scan_victims].astype(np.int64)])
            placed = len(scn_slots)
            unplaced, miss_scn = miss_scn[placed:], miss_scn[:placed]
        else:
            scn_slots, unplaced = _EMPTY, _EMPTY
        unplaced = np.sort(np.concatenate([unplaced, bumped]))

        evict = np.concatenate([victims, scan_victims])
        return Plan(
            fetch_keys=np.concatenate([miss_dec, miss_scn]),
            fetch_slots=np.concatenate([dec_slots, scn_slots]),
            evict_keys=evict,
            evict_slots=table[evict].astype(np.int64),
            unplaced_keys=unplaced,
            version=self.version,
        )

    def plan_promotion(self, routed: np.ndarray, max_rows: int) -> Plan:
        """Reading in place (nothing has to be resident): bring at most ``max_rows`` of the
        step's non-resident decode keys into the pool, hottest first, each into a free slot or
        over a colder unpinned key. A key no hotter than its would-be victim stays read in place:
        swapping two keys of the pool's edge back and forth costs a row's copy each time and
        saves nothing. Call after :meth:`observe` of the step (its routings count). Pure."""
        dec = self._unique(routed)
        table = self.slot_table.ravel()
        cands = dec[table[dec] < 0]
        n = min(int(max_rows), len(cands))
        if n <= 0:
            return Plan(version=self.version)
        cands = lowest(cands, n, -self.score, -self.last_use)  # hottest first
        free = np.flatnonzero(self.slot_keys < 0)[:n]
        rest = cands[len(free) :]
        evictable = self.resident
        pinned = np.zeros(self.n_keys, dtype=bool)
        pinned[dec] = True
        victims = self._victims(evictable[~pinned[evictable]], len(rest))  # coldest first
        # hottest candidate against coldest victim: the first pair that does not gain ends it
        gain = self.score[rest[: len(victims)]] > self.score[victims]
        k = int(np.argmin(gain)) if not gain.all() else len(victims)
        victims = victims[:k]
        fetch = np.concatenate([cands[: len(free)], rest[:k]])
        victim_slots = table[victims].astype(np.int64)
        return Plan(
            fetch_keys=fetch,
            fetch_slots=np.concatenate([free, victim_slots]),
            evict_keys=victims,
            evict_slots=victim_slots,
            version=self.version,
        )

    @property
    def predicts(self) -> bool:
        """Whether the policy fetches predicted keys before the forward (and learns tokens)."""
        return self.tokens is not None

    def plan_ahead(self, tokens: np.ndarray) -> Plan:
        """The fetch before a decode step's first forward pass: the keys its input ``tokens`` are
        predicted to route (:class:`TokenTable`, share >= ``predict_threshold``) that are not
        resident. Planned like a demand fetch of the predicted keys (they are the pins; victims
        are the coldest other keys); the plan's fetches are prefetches (``n_prefetch``), so it
        is no replay. Pure, like :meth:`plan`; empty without prediction."""
        if self.tokens is None:
            return Plan(version=self.version)
        keys, _ = self.tokens.predict(tokens, self.predict_threshold)
        if len(keys) == 0:
            return Plan(version=self.version)
        plan = self.plan(keys[: self.n_slots])
        return replace(plan, n_prefetch=len(plan.fetch_keys))

    def learn(self, tokens: np.ndarray, token_keys: np.ndarray) -> None:
        """After a step (decode or prefill): ``token_keys`` int [n, k] are the flat keys that each
        of its input ``tokens`` int [n] routed (the last forward pass's routing)."""
        if self.tokens is not None:
            token_keys = np.asarray(token_keys, dtype=np.int64)
            self._check(token_keys)
            self.tokens.learn(tokens, token_keys)

    def plan_preload(self, keys: np.ndarray) -> Plan:
        """A warm start: fetch ``keys`` (the persisted hot set, hottest first) into free slots.

        Keys beyond the free slots, and resident ones, are skipped. After the commit, until decode
        steps rank them, the preloaded keys are evicted coldest first.
        """
        keys = np.asarray(keys, dtype=np.int64).ravel()
        self._check(keys)
        _, first = np.unique(keys, return_index=True)
        keys = keys[np.sort(first)]
        keys = keys[self.slot_table.ravel()[keys] < 0]
        free = np.flatnonzero(self.slot_keys < 0)
        keys = keys[: len(free)]
        return Plan(
            fetch_keys=keys, fetch_slots=free[: len(keys)], version=self.version, preload=True
        )

    def commit(self, plan: Plan, scan: np.ndarray | None = None) -> None:
        """Apply a plan whose copies are done and whose slot-table entries are published."""
        if plan.version != self.version:
            raise ValueError(f"stale plan (computed at version {plan.version}, now {self.version})")
        table = self.slot_table.ravel()
        table[plan.evict_keys] = -1
        self.slot_keys[plan.evict_slots] = -1
        if len(plan.fetch_keys):
            if np.any(self.slot_keys[plan.fetch_slots] >= 0):
                raise ValueError("plan fetches into an occupied slot")
            table[plan.fetch_keys] = plan.fetch_slots
            self.slot_keys[plan.fetch_slots] = plan.fetch_keys
        if plan.preload:  # hottest first: the later a key, the earlier it goes
            self.last_use[plan.fetch_keys] = -2 - np.arange(len(plan.fetch_keys))
        if scan is not None:
            self.last_use[self._unique(scan)] = self.steps
        self.version += 1

    def observe(self, routed: np.ndarray) -> None:
        """End of a step: decay every score, then +1 per routing of the step's decode tokens."""
        routed = np.asarray(routed, dtype=np.int64).ravel()
        self._check(routed)
        self.score *= self.decay
        self.score += np.bincount(routed, minlength=self.n_keys)
        self.last_use[routed] = self.steps
        self.steps += 1

    def step(self, routed: np.ndarray, scan: np.ndarray | None = None) -> Plan:
        """plan + commit + observe: one whole step (for simulators and tests)."""
        plan = self.plan(routed, scan)
        self.commit(plan, scan)
        self.observe(routed)
        return plan

    def hot_set(self) -> np.ndarray:
        """Flat ids of the decode hot set: the ``protected_fraction`` of the pool's slots held by
        the resident keys of highest decayed frequency (keys never routed by decode excluded)."""
        res = self.resident
        res = res[self.score[res] > 0]
        n = min(len(res), int(np.floor(self.protected_fraction * self.n_slots)))
        if n == 0:
            return _EMPTY
        neg = -self.score
        return np.sort(lowest(res, n, neg, -self.last_use))

    def hot_keys(self, n: int | None = None) -> np.ndarray:
        """Flat ids of the keys with the highest decayed frequency, hottest first (what a warm start
        persists); ``n`` defaults to the pool size."""
        n = self.n_slots if n is None else n
        seen = np.flatnonzero(self.score > 0)
        return lowest(seen, min(n, len(seen)), -self.score, -self.last_use)

    # -- the victim order; baseline policies of the simulator override it ------------------

    def _victims(self, cands: np.ndarray, n: int) -> np.ndarray:
        """``n`` of the sorted candidate keys to evict, first victim first."""
        return lowest(cands, n, self.score, self.last_use)

    # -- helpers --------------------------------------------------------------------------

    def _check(self, ids: np.ndarray) -> None:
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.n_keys):
            raise ValueError(f"key ids must be in [0, {self.n_keys})")

    def _unique(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).ravel()
        self._check(ids)
        return distinct(ids, self.n_keys)
