"""Tiered residency in a worker: the expert pool, its slot table, the miss counter, and the
fetch-and-replay loop around each forward pass (design.md, "Residency and replay").

One `ResidencyManager` per worker process serves every MoE layer of the model:

* `pool` uint8 [n_slots, row_bytes]: expert rows (`moet_kernels.layout.RowLayout`), one slot each;
  `slot_table` int32 [moe_layers, E] (-1: not resident); `miss_count` int32 [1] and `routed` uint8
  [moe_layers, E], which the MoE layers' route op fills during a forward pass; when predicting,
  `route_ids` int32 [tiered layers, rows, top_k], a copy of each pass's routing written inside the
  forward (so inside a captured CUDA graph too), from which the predictor learns. All are
  allocated before serving and never move once a CUDA graph reads them by address; only
  `gpu_pool=auto` re-sizes the pool once, after the KV cache and before graph capture (`resize`).
* the host tier: a moet-store `Store` over the model's pack files (backend ram, pagecache or
  tiered), the source of every fetch;
* the policy (`policy.ResidencyPolicy`): which experts to fetch into which slots, which to evict.

`run_forward(forward, ...)` is the runner hook's body: on a decode step, first fetch the experts
its input tokens are predicted to route (`policy.plan_ahead`, one batch); then zero the counters,
run the forward, read the miss counter (the one sync), and while experts were missing fetch them
all in one batch, publish their slots and replay the same forward, up to `max_replays` times;
last, the policy learns what each input token routed (`policy.learn`). A step that still misses fails
(strict, the default) or, in approximate mode, is served and counted as unrestored. The MTP
drafter's layer (its experts only ever routed by drafter passes, which are not replayed) is
pinned resident, outside the policy's pool.

Reading in place (`read_in_place`, the `ram` host tier): every expert row is in pinned host
memory, so the route op computes an expert the pool lacks from its host row (`host_pool`,
`host_table`), over the bus, and nothing misses: one pass per step, no sync, no replay (vLLM's
asynchronous scheduling keeps its overlap). The pass's routed mask comes back asynchronously;
the first later step that finds it arrived has the policy promote those experts into the pool,
by copies queued on the stream before its own pass (so every pass reads the rows it was meant to).
A pool that holds every expert (`gpu_pool=all` with an FP4 tier: `hold_every_expert`) cannot miss
either, and runs the same way: one pass, no sync.

The FP4 tier (`fp4`, a `fp4pool.Fp4Pool`, with `fp4_tier`): the op prefers an expert's FP4 slot
over its W2 slot; after each decode step the FP4 pool learns the step's routing and promotes by
heat: from its final pass's counters, or, where nothing can miss and the gate is off, from its
routed mask OBSERVE_LAG passes later (exactly then, so that outputs do not depend on the device's
timing). With the gate on, a decode step syncs for its confidence and the tier decides at once. A
prefill never changes the FP4 pool.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..compat import MoetVllmError
from ..config import coerce_runtime
from . import sizing
from .fp4tier import confidence
from .metrics import Publisher, TuneWatcher
from .policy import PROMOTE_ROWS_PER_PASS, Plan, ResidencyPolicy, key_pairs

log = logging.getLogger("vllm.moet")
# cudaHostRegisterMapped: kernels may address the registered memory (reading in place; with
# unified addressing at the same address as the host's)
HOST_REGISTER_MAPPED = 2
_active: ResidencyManager | None = None


class MoetResidencyError(MoetVllmError):
    """A step whose experts could not all be made resident (strict mode), or a failed fetch."""


@dataclass(frozen=True)
class AutoPool:
    """A `gpu_pool=auto` pool still to be sized, once the KV cache is allocated."""

    reserve_bytes: int  # memory left free (pool_reserve_gib)
    floor: int  # the boot floor, in slots
    below_floor_ok: bool
    slots: int | None = None  # CUDA: planned from vLLM's KV budget (carve_auto_pool)
    free_bytes: int = 0  # that budget


def active() -> ResidencyManager | None:
    """The manager of this worker process, once the model is loaded with a partial pool."""
    return _active


@dataclass(frozen=True)
class LayerTiers:
    """What one MoE layer's op reads, each (pool, slot-table row, layout) or None, by preference:
    FP4 slot > device slot > host row (design.md, Residency)."""

    fp4: tuple | None
    device: tuple
    host: tuple | None

    @property
    def ordered(self) -> list[tuple]:
        """The tiers present, by preference (the torch reference's `tiers`)."""
        return [t for t in (self.fp4, self.device, self.host) if t is not None]


RETURN_RING = 4  # passes observed later: routed masks that may be on their way back at once
# with an FP4 tier, whose heat decisions change what the next passes compute, a pass observed
# later is observed exactly this many passes later (waited for if the device is that far behind),
# so that the outputs do not depend on the device's timing
OBSERVE_LAG = 2


@dataclass
class _Returning:
    """A pass observed later: its routed mask on its way back to the host."""

    index: int  # the pass's number among the passes observed later
    event: torch.cuda.Event | None  # recorded after the pass's copies (None on the CPU)
    scan: bool  # a prefill pass
    miss: torch.Tensor  # the ring's pinned buffers the copies land in
    routed: torch.Tensor
    resident: np.ndarray  # bool [policy keys]: the pool as the pass read it
    fp4_done: bool = False  # the FP4 tier learnt from the pass already (the gate was on)

    def arrived(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


@dataclass
class Counters:
    """What the KPI line and the metrics report (totals since boot)."""

    steps: int = 0
    replayed_steps: int = 0  # steps whose first forward missed
    replays: int = 0  # forward passes re-run (>= replayed_steps: second-order misses)
    second_order: int = 0  # replays beyond the first of a step
    missing_pairs: int = 0  # routed (token, expert) pairs that missed, first passes
    fetched_rows: int = 0
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0
    streamed_steps: int = 0  # steps larger than the pool: overflow staged layer by layer
    staged_rows: int = 0
    unrestored_steps: int = 0  # approximate mode: served with zeroed experts
    skipped_pairs: int = 0  # approximate mode: missed pairs served as zero
    fetch_retries: int = 0
    predicted_steps: int = 0  # decode steps that fetched predicted experts before their forward
    predicted_rows: int = 0  # rows of those fetches (also in fetched_rows)
    host_read_steps: int = 0  # reading in place: steps that read some expert from host memory
    host_read_rows: int = 0  # the (layer, expert) rows they read
    observed_steps: int = 0  # reading in place: steps whose routed mask came back (of steps)
    window: dict = field(default_factory=dict)  # the counters at the last KPI line


class ResidencyManager:
    def __init__(
        self,
        layout,
        moe_layers: list[int],
        n_experts: int,
        n_slots: int,
        store,
        pinned_layers: list[int] = (),
        *,
        miss_mode: str = "strict",
        miss_tolerance: int = 0,
        max_replays: int = 4,
        kpi_every: int = 100,
        fetch_attempts: int = 3,
        hot_path: Path | None = None,
        predict: bool = True,
        reduce_max=None,
        rank: int = 0,
        device: str | torch.device = "cpu",
        read_in_place: bool = False,
        fp4=None,
        gate: bool = False,
        gate_metric: str = "margin",
        gate_tau: float = 1.0,
    ):
        self.layout, self.n_experts, self.store = layout, n_experts, store
        self.fp4 = fp4  # the FP4 tier's pool (fp4pool.Fp4Pool), or None
        self.gate, self.gate_metric, self.gate_tau = gate, gate_metric, gate_tau  # (with fp4)
        self.moe_layers = list(moe_layers)  # model layer index of each MoE-layer ordinal
        self.pinned = [self.moe_layers.index(m) for m in pinned_layers]
        self.tiered = [o for o in range(len(self.moe_layers)) if o not in self.pinned]
        self._tiered_index = {o: i for i, o in enumerate(self.tiered)}
        self.device, self.predict = torch.device(device), predict
        self.streaming = False  # this forward stages what the pool cannot hold, layer by layer
        self.miss_count = torch.zeros(1, dtype=torch.int32, device=device)
        self.routed = torch.zeros(len(self.moe_layers), n_experts, dtype=torch.uint8, device=device)
        # the real rows of the pass, read by the route op on the device (a captured graph reads
        # the value written before each replay, never the one seen at capture)
        self.n_real = torch.zeros(1, dtype=torch.int32, device=device)
        # what a pass's one sync brings back: the miss count and the routed mask, together
        pin = self.device.type == "cuda"
        self._host_miss = torch.zeros(1, dtype=torch.int32, pin_memory=pin)
        self._host_routed = torch.zeros(
            len(self.moe_layers), n_experts, dtype=torch.uint8, pin_memory=pin
        )
        self._token_ids: np.ndarray | None = None  # the step's input tokens, when predicting
        self.route_ids: torch.Tensor | None = None  # sized by the largest eager pass (_record)
        self.miss_mode, self.miss_tolerance = miss_mode, miss_tolerance
        self.max_replays, self.kpi_every = max_replays, kpi_every
        self.fetch_attempts = fetch_attempts
        self.counters = Counters()
        self.n_real_tokens: int | None = None  # rows of the current forward that count
        self.hot_path = hot_path  # the persisted hot set (warm starts)
        self.reduce_max = reduce_max or tp_reduce_max  # miss-count consensus across TP ranks
        self.publisher = Publisher(rank)  # counters for vLLM's /metrics (metrics.py)
        self.tune = TuneWatcher()  # `moet tune`: runtime settings (metrics.py)
        self.auto: AutoPool | None = None  # gpu_pool=auto: sized by size_auto_pool()
        self.reserve_bytes = 0  # an auto pool (W2 or FP4): device memory it leaves to the KV cache
        self._fp4_auto: tuple[int, int] | None = None  # fp4_pool=auto on CUDA: (slots, budget)
        self._pinned_host = pin_host_memory(self.store, self.device)
        # reading in place: the host tier's rows as a pool the op reads; passes observed later
        # (reading in place, or a pool of every expert): their routed masks on their way back
        # (oldest first: `_Returning`), in a ring of pinned buffers deep enough for vLLM's
        # asynchronous scheduling (a pass or two ahead)
        self.host_pool: torch.Tensor | None = None
        self.host_table: torch.Tensor | None = None
        self._returning: collections.deque[_Returning] = collections.deque()
        self._ring = [
            (torch.zeros(1, dtype=torch.int32, pin_memory=pin),
             torch.zeros(len(self.moe_layers), n_experts, dtype=torch.uint8, pin_memory=pin))
            for _ in range(RETURN_RING)
        ]  # fmt: skip
        self._ring_next = 0
        self.holds_every_expert = False  # hold_every_expert()
        if read_in_place:
            self._map_host_rows()
        self._allocate(n_slots)

    def _allocate(self, n_slots: int) -> None:
        """The pool of `n_slots` policy slots, an empty slot table and policy; the pinned layers'
        experts loaded."""
        n_experts = self.n_experts
        self.n_slots = n_slots
        # [policy slots | pinned (MTP) slots | staging: one layer's experts, for overflow]
        self.stage0 = n_slots + len(self.pinned) * n_experts
        self.pool = None  # the old pool's memory is free before the new one is taken
        rows = self.stage0 + n_experts
        try:
            self.pool = torch.zeros(
                rows, self.layout.row_bytes, dtype=torch.uint8, device=self.device
            )
        except (torch.OutOfMemoryError, RuntimeError) as e:
            need = rows * self.layout.row_bytes
            raise sizing.MoetSizingError(
                f"moet: a pool of {n_slots} expert slots ({rows} rows with the pinned and staging "
                f"ones, {need / sizing.GIB:.2f} GiB) does not fit in {self.device} memory "
                f"({sizing.free_bytes(self.device) / sizing.GIB:.2f} GiB free): lower gpu_pool, or "
                "use gpu_pool=auto"
            ) from e
        self.slot_table = torch.full((len(self.moe_layers), n_experts), -1, dtype=torch.int32)
        self.slot_table = self.slot_table.to(self.device)
        self.policy = ResidencyPolicy(
            n_slots,
            len(self.tiered),
            n_experts,
            **({} if self.predict else {"predict_threshold": 0.0}),
        )
        # pinned layers (MTP drafter): slots n_slots.., filled once
        for i, o in enumerate(self.pinned):
            slots = n_slots + i * n_experts + np.arange(n_experts)
            self._copy_rows([(o, e) for e in range(n_experts)], slots)
            self.slot_table[o] = torch.from_numpy(slots.astype(np.int32))

    def resize(self, n_slots: int) -> int:
        """A pool of `n_slots` instead, before serving (`gpu_pool=auto`, after the KV cache and
        before graph capture): the old pool is dropped, the new one starts from the saved hot set
        (-> experts preloaded). Never once a CUDA graph holds the pool's address."""
        self._allocate(n_slots)
        return self.load_hot_set()

    # -- the MoE layers' view --

    def layer_tables(
        self, model_layer: int, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_table row, routed row) of one MoE layer (by model layer index) for a forward
        routing `ids`. While streaming, this layer's non-resident routed experts are read into
        the staging slots first and the returned table points there (they never enter the pool)."""
        o = self.moe_layers.index(model_layer)
        table = self.slot_table[o]
        if self.policy.predicts and o in self._tiered_index:  # for the predictor
            self._record(self._tiered_index[o], ids)
        if not self.streaming:
            return table, self.routed[o]
        routed = torch.unique(ids[: self.n_real_tokens]).long()
        missing = routed[table[routed] < 0]
        if len(missing):
            staged = self.stage0 + missing
            self._copy_rows([(o, int(e)) for e in missing], staged.tolist())
            table = table.clone()
            table[missing] = staged.to(table.dtype)
            self.counters.staged_rows += len(missing)
        return table, self.routed[o]

    def layer_tiers(self, model_layer: int, ids: torch.Tensor) -> tuple[LayerTiers, torch.Tensor]:
        """`layer_tables` as the tiers the op reads, each (pool, slot_table row, layout): the FP4
        tier's, the device pool's, and (reading in place) the host rows'; and the routed row."""
        table, routed = self.layer_tables(model_layer, ids)
        o = self.moe_layers.index(model_layer)
        return LayerTiers(
            self.fp4.layer(o) if self.fp4 is not None else None,
            (self.pool, table, self.layout),
            (self.host_pool, self.host_table[o], self.layout) if self.host_pool is not None
            else None,
        ), routed  # fmt: skip

    def _record(self, i: int, ids: torch.Tensor) -> None:
        """Copy a pass's routing of tiered layer `i` into `route_ids` (a device copy: inside a
        captured graph it is part of every replay). The buffer grows only outside a capture, to
        the largest pass so far; vLLM profiles with its largest batch before capturing."""
        n, k = ids.shape
        buf = self.route_ids
        if buf is None or buf.shape[1] < n or buf.shape[2] != k:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise MoetResidencyError(
                    f"moet: a CUDA graph captures a pass of {n} tokens x top-{k}, larger than "
                    "any pass run before the capture: run the largest batch eagerly first"
                )
            buf = torch.zeros(len(self.tiered), n, k, dtype=torch.int32, device=self.device)
            self.route_ids = buf
        buf[i, :n].copy_(ids)

    # -- fetching --

    def _map_host_rows(self) -> None:
        """read_in_place: the store's arena as `host_pool` [arena slots, stride] and each
        (layer, expert)'s arena slot in `host_table` (on the device). Every row must be there
        and, on a GPU, the arena pinned: the kernels read it directly."""
        st = self.store
        if getattr(st, "backend", None) != "ram" or not st.arena_address:
            raise MoetResidencyError(
                f"moet: read_in_place needs host_tier='ram' (every expert row in host memory), "
                f"got host_tier={getattr(st, 'backend', None)!r}: set host_tier=ram, or "
                "read_in_place=false"
            )
        if self.device.type == "cuda" and st.arena_address not in self._pinned_host:
            raise MoetResidencyError(
                "moet: read_in_place: the host tier could not be pinned (cudaHostRegister "
                "failed, logged above), so the GPU cannot read it in place: raise the locked-"
                "memory limit (ulimit -l), or set read_in_place=false"
            )
        self.host_pool, table = host_rows(st, len(self.moe_layers), self.n_experts)
        if (table < 0).any():
            o, e = np.argwhere(table < 0)[0]
            raise MoetResidencyError(
                f"moet: read_in_place: the host tier lacks the row of MoE layer "
                f"{self.moe_layers[o]}, expert {e} (pack {st.path}): rebuild the pack cache "
                "(moet cache clear), or set read_in_place=false"
            )
        self._host_slots = table  # the host mirror, read between passes without a sync
        self.host_table = torch.from_numpy(table).to(self.device)

    def _copy_rows(self, keys: list[tuple[int, int]], slots) -> None:
        """Read `keys` (ordinal, expert) from the host tier and copy them into `slots`, in one
        batch; retried, then MoetResidencyError. Nothing is published here. On a GPU the copies
        are queued together and waited for once, before the store releases the rows."""
        if not keys:
            return
        if self.host_pool is not None:  # rows that never move: queued copies, no wait (untimed)
            queue_row_copies(self.pool, self.host_pool, self._host_slots, self.layout.row_bytes,
                             keys, slots)  # fmt: skip
            self._count_fetch(len(keys))
            return
        t0 = time.perf_counter()
        fetch_rows(self.store, self.pool, self.layout.row_bytes, keys, slots, self.fetch_attempts,
                   failed=self._count_retry)  # fmt: skip
        self._count_fetch(len(keys))
        self.counters.fetch_seconds += time.perf_counter() - t0

    def _count_retry(self) -> None:
        self.counters.fetch_retries += 1

    def _count_fetch(self, rows: int) -> None:
        self.counters.fetched_rows += rows
        self.counters.fetched_bytes += rows * self.layout.row_bytes

    def apply(self, plan, scan: np.ndarray | None = None) -> None:
        """Evict, fetch and publish a policy plan (between forward passes)."""
        apply_plan(plan, self.slot_table, self.tiered, self.n_experts, self._copy_rows,
                   lambda p: self.policy.commit(p, scan), self.policy.commit)  # fmt: skip

    def hold_every_expert(self) -> None:
        """`gpu_pool=all`: every tiered expert preloaded, for good, on every TP rank alike, so no
        pass can miss and none needs the ranks' miss consensus (`_run_once`)."""
        if self.n_slots < self.policy.n_keys:
            raise ValueError(f"a pool of {self.n_slots} slots, {self.policy.n_keys} experts")
        self.preload(np.arange(self.policy.n_keys))
        self.holds_every_expert = True

    def preload(self, keys: np.ndarray) -> int:
        """Warm start: the persisted hot set (flat policy keys, hottest first) into free slots."""
        plan = self.policy.plan_preload(keys)
        self.apply(plan)
        return len(plan.fetch_keys)

    def _read_counters(self) -> tuple[int, np.ndarray]:
        """After a pass: (its miss count, the flat keys of every tiered expert it routed), in one
        device-to-host sync (both copied into pinned memory, then the stream waited for)."""
        if self.device.type == "cuda":
            self._host_miss.copy_(self.miss_count, non_blocking=True)
            self._host_routed.copy_(self.routed, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        else:
            self._host_miss.copy_(self.miss_count)
            self._host_routed.copy_(self.routed)
        o, e = np.nonzero(self._host_routed.numpy()[self.tiered])
        return int(self._host_miss[0]), o.astype(np.int64) * self.n_experts + e

    # -- the runner hook --

    def run_forward(
        self, forward, scan: bool = False, n_real: int | None = None, token_ids=None,
        logits_of=None,
    ):  # fmt: skip
        """Run `forward()` (one model forward pass) until every expert it routes is resident;
        a replay that stages the overflow of a step larger than the pool runs
        `forward(eager=True)` (outside any CUDA graph: the staging is Python). `n_real`: rows
        of the batch that are real tokens (padding never counts a miss); `token_ids`: the
        batch's input token ids (int [tokens]; None: no prediction); `logits_of(hidden)`: the
        model's logits of hidden rows, for the confidence gate of a decode step."""
        self.n_real_tokens = n_real
        self.n_real.fill_(2**31 - 1 if n_real is None else n_real)
        self._apply_tuning()
        if self.host_pool is not None or self.holds_every_expert:
            return self._run_once(forward, scan, logits_of)
        c = self.counters
        self._token_ids = None
        if token_ids is not None and self.policy.predicts:
            toks = torch.as_tensor(token_ids)[:n_real].to("cpu", torch.int64).numpy()
            self._token_ids = toks
            if not scan and len(toks):  # a prefill never evicts for a guess
                plan = self.policy.plan_ahead(toks)
                if len(plan.fetch_keys):
                    try:  # one batched fetch, before the first forward pass
                        self.apply(plan)
                        c.predicted_steps += 1
                        c.predicted_rows += len(plan.fetch_keys)
                    except MoetResidencyError as e:  # a guess: the demand fetch decides
                        log.warning("moet: the predicted fetch failed, continuing: %s", e)
        out, keys, missed_first = self._until_resident(forward, scan)
        c.replayed_steps += missed_first > 0
        c.missing_pairs += missed_first
        gated = not scan and self._gates(out, logits_of, keys)
        if gated:  # the step's routed experts to FP4, and the step once more: that pass is final
            self.fp4.gate(keys)
            out, keys, _ = self._until_resident(forward, scan)
        if not scan:
            self.policy.observe(keys)
            if self.fp4 is not None:
                self.fp4.after_step(keys, gated)
        self._learn_tokens()
        self._end_step()
        return out

    def _until_resident(self, forward, scan: bool) -> tuple[object, np.ndarray, int]:
        """Passes of `forward` until one finds every expert it routes resident (replays, up to
        `max_replays`) -> (its output, the flat keys it routed, the first pass's misses)."""
        c = self.counters
        missed_first = 0
        for attempt in range(self.max_replays + 1):
            self.miss_count.zero_()
            self.routed.zero_()
            out = forward(eager=True) if self.streaming else forward()
            local, keys = self._read_counters()  # the one sync of a pass
            missed = self.reduce_max(local)  # every TP rank replays, or none does
            if attempt == 0:
                missed_first = local
            if missed == 0:
                break
            if attempt == 0 and self.miss_mode == "approximate" and missed <= self.miss_tolerance:
                self._plan_and_apply(keys, scan)  # still fetch, for the next steps
                c.unrestored_steps += 1
                c.skipped_pairs += missed
                break
            if attempt == self.max_replays:
                if self.miss_mode == "strict":
                    raise MoetResidencyError(
                        f"moet: {missed} routed experts still missing after {attempt} replays "
                        f"of one step (max_replays={self.max_replays}); refusing to serve "
                        "zeroed experts (miss_mode='strict'): raise gpu_pool or max_replays"
                    )
                c.unrestored_steps += 1
                c.skipped_pairs += missed
                break
            if not self._plan_and_apply(keys, scan):
                self.streaming = True  # the replay stages the overflow, layer by layer
                c.streamed_steps += 1
            c.replays += 1
            c.second_order += attempt > 0
        self.streaming = False
        return out, keys, missed_first

    def _gate_on(self, logits_of) -> bool:
        return self.fp4 is not None and bool(self.gate) and logits_of is not None

    def _gates(self, out, logits_of, keys: np.ndarray) -> bool:
        """Whether a decode step's confidence gate fires: with an FP4 tier and `gate` on, the
        least confidence (`gate_metric`) of the real rows of `out`'s logits is below `gate_tau`
        times the share of the pass's routed pairs (`keys`) at W2 (`Fp4Tier.gates`; one
        device-to-host sync)."""
        if not self._gate_on(logits_of) or not torch.is_tensor(out):
            return False
        rows = out if self.n_real_tokens is None else out[: self.n_real_tokens]
        logits = logits_of(rows) if len(rows) else None
        if logits is None:  # (a pipeline stage without the head)
            return False
        conf = float(confidence(logits, self.gate_metric).min())
        return self.fp4.tier.gates(conf, keys, self.gate_tau)

    def _routed_keys(self) -> np.ndarray:
        """The flat keys of the tiered experts the last pass routed (a device-to-host copy)."""
        o, e = np.nonzero(self.routed.cpu().numpy()[self.tiered])
        return o.astype(np.int64) * self.n_experts + e

    def _run_once(self, forward, scan: bool, logits_of=None):
        """One pass, where nothing can miss: the pool holds every expert, or what it lacks is
        read from host memory in place. Its routed mask comes back asynchronously (a ring
        buffer's pinned copies and an event), observed by a later step (`_promote_arrived`), so
        the pass costs no sync unless the confidence gate reads its logits."""
        self._promote_arrived()
        self.miss_count.zero_()
        self.routed.zero_()
        out = forward()
        # with the gate on, a decode step syncs for its confidence anyway: the FP4 tier then
        # decides at once, from this step's routing, in the order the quality harness takes
        fp4_now = not scan and self._gate_on(logits_of)
        if fp4_now:
            keys = self._routed_keys()
            gated = self._gates(out, logits_of, keys)
            if gated:  # the step's routed experts to FP4, and the step once more: final
                self.fp4.gate(keys)
                self.miss_count.zero_()
                self.routed.zero_()
                out = forward()
                keys = self._routed_keys()
            self.fp4.after_step(keys, gated)
        if len(self._returning) < len(self._ring):
            cuda = self.device.type == "cuda"
            miss, routed = self._ring[self._ring_next % len(self._ring)]  # FIFO: free now
            index, self._ring_next = self._ring_next, self._ring_next + 1
            miss.copy_(self.miss_count, non_blocking=cuda)
            routed.copy_(self.routed, non_blocking=cuda)
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
            # the pool as this pass read it: what it lacked was read in place
            resident = self.policy.slot_table.ravel() >= 0
            self._returning.append(_Returning(index, event, scan, miss, routed, resident, fp4_now))
        # else the ring is full (the device is that far behind): this pass goes unobserved
        self._end_step()
        return out

    def _promote_arrived(self) -> None:
        """For each pass whose routed mask arrived, oldest first (with an FP4 tier: each pass
        OBSERVE_LAG passes later, waited for): count what it read from host memory, and have
        the policy promote the hottest of it over colder keys (a decode pass: `plan_promotion`,
        at most PROMOTE_ROWS_PER_PASS rows; a prefill: free and probation slots, as after a
        miss), and the FP4 tier learn; copies queued on the stream, no wait."""
        c = self.counters
        lagged = self.fp4 is not None
        while self._returning:
            r = self._returning[0]
            if lagged and self._ring_next - r.index < OBSERVE_LAG:
                break
            if lagged:
                r.wait()
            elif not r.arrived():
                break
            self._returning.popleft()
            if int(r.miss[0]):  # nothing could miss: a miss is a broken table
                raise MoetResidencyError(
                    f"moet: {int(r.miss[0])} routed experts had neither a pool slot nor a host "
                    "row in a pass that could not miss; refusing to serve zeroed experts"
                )
            o, e = np.nonzero(r.routed.numpy()[self.tiered])
            keys = o.astype(np.int64) * self.n_experts + e
            read = keys[~r.resident[keys]]
            c.observed_steps += 1
            c.host_read_steps += len(read) > 0
            c.host_read_rows += len(read)
            if r.scan:  # what finds no room stays read in place
                self._plan_and_apply(keys, scan=True)
                continue
            self.policy.observe(keys)
            if self.fp4 is not None and not r.fp4_done:
                self.fp4.after_step(keys)
            if len(read):  # (a pass that read nothing has nothing to place: less host time)
                self.apply(self.policy.plan_promotion(keys, PROMOTE_ROWS_PER_PASS))

    def _end_step(self) -> None:
        """A step's last bookkeeping: its count, the KPI line and the metrics file."""
        c = self.counters
        c.steps += 1
        kpi = bool(self.kpi_every) and c.steps % self.kpi_every == 0
        if kpi:
            log.info("%s", self.kpi_line())
            self.save_hot_set()
        fp4 = self.fp4.metrics() if self.fp4 is not None else None
        self.publisher.publish(c, self.coverage, force=kpi, fp4=fp4)

    def _learn_tokens(self) -> None:
        """Teach the policy what each input token of the step routed (the last pass's ids)."""
        toks, self._token_ids = self._token_ids, None
        buf = self.route_ids
        if toks is None or len(toks) == 0 or buf is None or buf.shape[1] < len(toks):
            return
        ids = buf[:, : len(toks)].to("cpu", torch.int64).numpy()  # [tiered, tokens, top_k]
        keys = ids + (np.arange(len(self.tiered)) * self.n_experts)[:, None, None]
        self.policy.learn(toks, keys.transpose(1, 0, 2).reshape(len(toks), -1))

    def _apply_tuning(self) -> None:
        values = self.tune.poll()
        if values is None:
            return
        try:
            values = coerce_runtime(values, f"moet tune ({self.tune.path})")
        except MoetVllmError as e:
            log.warning("moet: ignoring runtime settings: %s", e.message)
            return
        for key, value in values.items():
            setattr(self, key, value)
        log.info("moet: runtime settings applied: %s", values)

    # -- warm starts --

    def save_hot_set(self) -> None:
        """Persist the pool's hot set (and the FP4 pool's), atomically."""
        save_hot_set(self.hot_path, self.policy)
        if self.fp4 is not None:
            self.fp4.save_hot_set()

    def load_hot_set(self) -> int:
        """Preload the persisted hot set into the pool (boot, before serving); -> rows loaded.
        A missing, foreign or corrupt file preloads nothing."""
        keys = load_hot_set(self.hot_path, self.policy)
        return 0 if keys is None else self.preload(keys)

    def _plan_and_apply(self, keys: np.ndarray, scan: bool) -> bool:
        """Fetch what the policy places; False when some keys have no room (a prefill chunk, or
        a step larger than the pool): the replay then streams them."""
        try:
            if scan:  # prefill: free and probation slots only, never the decode hot set
                plan = self.policy.plan(np.zeros(0, np.int64), scan=keys)
            else:
                plan = self.policy.plan(keys)
        except ValueError:  # more distinct decode keys than slots (a pool below the floor)
            return False
        self.apply(plan, scan=keys if scan else None)
        return len(plan.unplaced_keys) == 0

    # -- reporting --

    @property
    def coverage(self) -> float:
        """Share of the tiered (layer, expert) pairs that fit in the pool at once."""
        return min(1.0, self.n_slots / (len(self.tiered) * self.n_experts))

    def kpi_line(self) -> str:
        c, w = self.counters, self.counters.window
        steps = c.steps - w.get("steps", 0)
        pct = 100.0 * (c.replayed_steps - w.get("replayed_steps", 0)) / max(steps, 1)
        pairs = (c.missing_pairs - w.get("missing_pairs", 0)) / max(steps, 1)
        second = c.second_order - w.get("second_order", 0)
        unrestored = c.unrestored_steps - w.get("unrestored_steps", 0)
        predicted = 100.0 * (c.predicted_steps - w.get("predicted_steps", 0)) / max(steps, 1)
        in_place = ""
        if self.host_pool is not None:
            seen = c.observed_steps - w.get("observed_steps", 0)
            read = 100.0 * (c.host_read_steps - w.get("host_read_steps", 0)) / max(seen, 1)
            rows = (c.host_read_rows - w.get("host_read_rows", 0)) / max(seen, 1)
            in_place = (
                f", read in place {read:.1f}% of steps ({rows:.2f} experts/step; {seen} steps "
                "observed)"
            )
        stats = self.store.stats() if hasattr(self.store, "stats") else {}
        hits, misses = stats.get("hit_rows", 0), stats.get("miss_rows", 0)
        arena = f"{100.0 * hits / (hits + misses):.1f}%" if hits + misses else "n/a"
        fp4 = self.fp4.kpi(steps, w) if self.fp4 is not None else ""  # updates w's fp4_ keys
        c.window = {k: v for k, v in w.items() if k.startswith("fp4_")} | {
            k: getattr(c, k)
            for k in (
                "steps",
                "replayed_steps",
                "missing_pairs",
                "second_order",
                "unrestored_steps",
                "predicted_steps",
                "host_read_steps",
                "host_read_rows",
                "observed_steps",
            )
        }
        return (
            f"moet KPI: {steps} steps: replay {pct:.1f}% of steps, {pairs:.2f} missing pairs/step, "
            f"pool coverage {100 * self.coverage:.1f}%, second-order replays {second}, "
            f"unrestored steps {unrestored}, arena hit {arena}, predicted fetches {predicted:.1f}% "
            f"of steps{in_place}{fp4}"
        )

    def close(self) -> None:
        global _active
        if _active is self:
            _active = None
        unpin_host_memory(self._pinned_host)
        self._pinned_host = []
        self.store.close()
        if self.fp4 is not None:
            self.fp4.close()


def apply_plan(plan, table, tiered, n_experts, copy_rows, commit, commit_evictions) -> None:
    """One pool's plan between forward passes: its evictions published in `table` (-1) first,
    the fetched rows copied (`copy_rows(keys, slots)`), their slots published, `commit(plan)`.
    A failed copy publishes nothing fetched; the victims' slots may hold part of a new row, so
    they leave the pool (`commit_evictions` of them alone) and the error goes on."""
    # fill_, not item assignment: `table[o, e] = v` on a GPU copies a pageable host scalar and
    # syncs, once per entry, where a pass that cannot miss must not sync at all
    for o, e in key_pairs(plan.evict_keys, n_experts):
        table[tiered[o], e].fill_(-1)
    fetch = [(tiered[o], int(e)) for o, e in key_pairs(plan.fetch_keys, n_experts)]
    try:
        if fetch:
            copy_rows(fetch, plan.fetch_slots)
    except MoetResidencyError:
        if len(plan.evict_keys):
            commit_evictions(Plan(evict_keys=plan.evict_keys, evict_slots=plan.evict_slots,
                                  version=plan.version))  # fmt: skip
        raise
    for (o, e), slot in zip(fetch, plan.fetch_slots, strict=True):
        table[o, e].fill_(int(slot))
    commit(plan)


def save_hot_set(path: Path | None, policy: ResidencyPolicy) -> None:
    """Persist `policy`'s hot set (flat keys, hottest first) to `path`, atomically; a failure is
    a warning (a warm start is an optimisation: never fail a step for it)."""
    if path is None:
        return
    keys = policy.hot_keys().tolist()
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps({"version": 1, "n_keys": policy.n_keys, "keys": keys}))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("moet: could not save a pool's hot set to %s: %s", path, e)


def load_hot_set(path: Path | None, policy: ResidencyPolicy) -> np.ndarray | None:
    """The hot set saved at `path` for `policy`'s geometry (in-range keys), or None: a
    missing, foreign or corrupt file (warned) gives nothing to preload."""
    if path is None or not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        keys = np.asarray(saved["keys"], dtype=np.int64)
        if saved.get("n_keys") != policy.n_keys or keys.ndim != 1:
            raise ValueError("a different model geometry")
        return keys[(keys >= 0) & (keys < policy.n_keys)]
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("moet: ignoring the saved hot set %s (%s)", path, e)
        return None


def pin_host_memory(store, device) -> list[int]:
    """On a GPU, register `store`'s arena and stage (the memory its fetched views point into)
    with CUDA, so its rows reach the device by asynchronous DMA and kernels can read the arena in
    place -> the addresses registered (`unpin_host_memory` at close). Unregistered buffers still
    work, with synchronous, pageable copies (~7 GB/s on the H200 against ~55 pinned)."""
    if torch.device(device).type != "cuda":
        return []
    cudart, pinned = torch.cuda.cudart(), []
    for what in ("arena", "stage"):
        addr = getattr(store, f"{what}_address", 0)
        size = getattr(store, f"{what}_bytes", 0)
        if not addr or not size:
            continue
        rc = cudart.cudaHostRegister(addr, size, HOST_REGISTER_MAPPED)
        if int(rc) == 0:
            pinned.append(addr)
            continue
        clear_last_cuda_error()
        log.warning(
            "moet: pinning the host tier's %s of %s (%d bytes) failed (CUDA error %d: %s); its "
            "rows are copied synchronously",
            what,
            getattr(store, "path", "a store"),
            size,
            int(rc),
            cudart.cudaGetErrorString(rc),
        )
    return pinned


def clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error. A failed cudaHostRegister (e.g. 712, memory already
    registered) leaves it set, and torch's next kernel-launch check would raise it as that
    kernel's own failure. Called through the runtime torch loaded (found in the process's
    mappings), not some other copy on the library path."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    for path in sorted(paths):
        ctypes.CDLL(path).cudaGetLastError()


def unpin_host_memory(addresses: list[int]) -> None:
    for addr in addresses:
        torch.cuda.cudart().cudaHostUnregister(addr)


def host_rows(store, moe_layers: int, n_experts: int) -> tuple[torch.Tensor, np.ndarray]:
    """A `ram` store's arena as rows the device copies from or reads directly -> (uint8
    [arena slots, stride] over the arena, int32 [moe_layers, n_experts]: each (MoE-layer
    ordinal, expert)'s arena slot, -1 where the store has no row)."""
    stride, addr, size = store.spec.stride, store.arena_address, store.arena_bytes
    buf = (ctypes.c_uint8 * size).from_address(addr)
    rows = torch.frombuffer(buf, dtype=torch.uint8)[: size // stride * stride].view(-1, stride)
    table = np.array(
        [[store.arena_slot(o, e) for e in range(n_experts)] for o in range(moe_layers)],
        dtype=np.int32,
    ).reshape(moe_layers, n_experts)
    return rows, table


def queue_row_copies(pool, rows, row_slots, row_bytes, keys, slots) -> None:
    """Copy the host rows of `keys` (ordinal, expert; their arena slots in `row_slots`) into
    `pool[slots]`, queued on the stream with no wait: arena rows never move, so nothing is held
    for the copy, and the next pass, queued after it, reads what it wrote."""
    cuda = pool.is_cuda
    for (o, e), slot in zip(keys, slots, strict=True):
        pool[int(slot)].copy_(rows[int(row_slots[o, e])][:row_bytes], non_blocking=cuda)


def fetch_rows(store, pool, row_bytes, keys, slots, attempts: int, what: str = "", failed=None):
    """Read `keys` (ordinal, expert) from `store` and copy each row's first `row_bytes` into
    `pool[slot]`, in one batch, tried up to `attempts` times (`failed()` after each failed try),
    then MoetResidencyError. On a GPU the copies are queued together and waited for once, before the
    store releases the rows. Nothing is published here."""
    cuda = pool.is_cuda
    for attempt in range(1, attempts + 1):
        try:
            with store.fetch(keys) as batch:
                for view, slot in zip(batch.views, slots, strict=True):
                    with warnings.catch_warnings():  # a read-only view, copied at once
                        warnings.simplefilter("ignore", UserWarning)
                        row = torch.frombuffer(view, dtype=torch.uint8)
                    pool[int(slot)].copy_(row[:row_bytes], non_blocking=cuda)
                if cuda:
                    torch.cuda.current_stream(pool.device).synchronize()
            return
        except OSError as e:
            if failed is not None:
                failed()
            if attempt == attempts:
                raise MoetResidencyError(
                    f"moet: fetching {len(keys)} {what + ' ' if what else ''}experts from the "
                    f"pack files failed {attempt} times ({e}); the step's experts cannot be "
                    "restored"
                ) from None


def tp_reduce_max(missed: int) -> int:
    """The largest miss count over the tensor-parallel ranks (CPU group: one small all-reduce)."""
    from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

    if get_tensor_model_parallel_world_size() == 1:
        return missed
    t = torch.tensor([missed], dtype=torch.int64)
    torch.distributed.all_reduce(
        t, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().cpu_group
    )
    return int(t.item())


def activate(manager: ResidencyManager) -> None:
    global _active
    _active = manager
    loaded = manager.load_hot_set()
    if manager.fp4 is not None:
        manager.fp4.load_hot_set()
    log.info(
        "moet: tiered residency: %d expert slots for %d MoE layers x %d experts (pool coverage "
        "%.1f%%, %.1f MB), %d pinned (MTP), host tier %s; warm start: %d experts preloaded%s",
        manager.n_slots,
        len(manager.tiered),
        manager.n_experts,
        100 * manager.coverage,
        manager.pool.numel() / 1e6,
        len(manager.pinned) * manager.n_experts,
        getattr(manager.store, "backend", "?"),
        loaded,
        "; gpu_pool=auto: re-sized once the KV cache is allocated" if manager.auto else "",
    )


def carve_auto_pool(worker, available: int) -> int:
    """CUDA, `gpu_pool=auto`: plan the pool from vLLM's KV budget (`available` bytes, after its
    profiling and CUDA-graph estimate) less the reserve, which the KV cache keeps at least;
    -> the bytes the pool takes out of that budget (compat touch point 9). The pool is allocated
    by `size_auto_pool`, before any graph is captured."""
    mgr = _active
    if mgr is None or (mgr.auto is None and not _fp4_auto(mgr)):
        return 0
    taken = 0
    if mgr.auto is not None:
        n = _auto_slots(mgr, available)
        mgr.auto = dataclasses.replace(mgr.auto, slots=n, free_bytes=available)
        taken = (n - mgr.n_slots) * mgr.layout.row_bytes
    if _fp4_auto(mgr):  # from what the W2 pool leaves
        n4 = _fp4_auto_slots(mgr, available - taken)
        mgr._fp4_auto = (n4, available - taken)
        taken += (n4 - mgr.fp4.n_slots) * mgr.fp4.layout.row_bytes
    return taken


def _fp4_auto(mgr: ResidencyManager) -> bool:
    return mgr.fp4 is not None and mgr.fp4.auto_cap is not None


def _fp4_auto_slots(mgr: ResidencyManager, free: int) -> int:
    """fp4_pool=auto: the FP4 slots `free` bytes hold less the reserve (plus the load-time
    pool's one slot, given back first), at most its cap."""
    fp4 = mgr.fp4
    return min(fp4.auto_cap, max(0, free - mgr.reserve_bytes) // fp4.layout.row_bytes + fp4.n_slots)


def _auto_slots(mgr: ResidencyManager, free: int) -> int:
    """The policy slots a `gpu_pool=auto` pool gets from `free` bytes (sizing.auto_slots)."""
    a = mgr.auto
    n_keys = len(mgr.tiered) * mgr.n_experts
    row = mgr.layout.row_bytes
    return sizing.auto_slots(
        free, a.reserve_bytes, row, mgr.n_slots, n_keys, a.floor, a.below_floor_ok
    )


def size_auto_pool(worker=None) -> None:
    """`gpu_pool=auto`: the pool takes its planned share of vLLM's KV budget (CUDA,
    `carve_auto_pool`), or on CPU the memory left once the KV cache is allocated less the
    reserve; before any CUDA graph is captured (compat touch point 8; runs once)."""
    mgr = _active
    if mgr is None:
        return
    if mgr.auto is not None:
        _size_w2_auto(mgr)
    if _fp4_auto(mgr):
        n4, free = mgr._fp4_auto or (None, 0)
        if n4 is None:  # CPU: from the memory left now
            free = sizing.free_bytes(mgr.device)
            n4 = _fp4_auto_slots(mgr, free)
        mgr.fp4.auto_cap = mgr._fp4_auto = None
        loaded = mgr.fp4.resize(max(n4, 1))
        log.info(
            "moet: fp4_pool=auto: %.2f GiB %s, %.2f GiB kept for the KV cache: %d FP4 slots "
            "(FP4 pool coverage %.1f%%, %.1f MB); warm start: %d rows preloaded",
            free / sizing.GIB, "free" if mgr.device.type != "cuda" else "of the KV budget left",
            mgr.reserve_bytes / sizing.GIB, mgr.fp4.n_slots, 100 * mgr.fp4.coverage,
            mgr.fp4.pool.numel() / 1e6, loaded,
        )  # fmt: skip


def _size_w2_auto(mgr: ResidencyManager) -> None:
    auto = mgr.auto
    n, free = auto.slots, auto.free_bytes
    if n is None:
        free = sizing.free_bytes(mgr.device)
        n = _auto_slots(mgr, free)
    mgr.auto = None
    loaded = mgr.resize(n)
    log.info(
        "moet: gpu_pool=auto: %.2f GiB %s, %.2f GiB kept %s (pool_reserve_gib): %d expert "
        "slots (pool coverage %.1f%%, %.1f MB); warm start: %d experts preloaded",
        free / sizing.GIB,
        "free after the KV cache" if auto.slots is None else "of vLLM's KV-cache budget",
        auto.reserve_bytes / sizing.GIB,
        "free" if auto.slots is None else "for the KV cache",
        n,
        100 * mgr.coverage,
        mgr.pool.numel() / 1e6,
        loaded,
    )


def run_step(forward, n_tokens: int, n_real: int, scan: bool, token_ids=None, logits_of=None):
    """The runner hook's body (compat touch point 7)."""
    if _active is None:
        return forward()
    return _active.run_forward(
        forward, scan=scan, n_real=n_real, token_ids=token_ids, logits_of=logits_of
    )
