"""The FP4 tier's device pool (residency/fp4pool.py) under the residency manager, on a small MoE
stack (pure torch, real moet-store packs for both tiers): every step's output equals an
independent forward that takes each routed expert's FP4 row where an Fp4Tier fed the same
routing holds it and its W2 row elsewhere; a pool of every pair serves all-FP4 from the first
step; prefills never change the FP4 pool; a failed FP4 fetch publishes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_residency_manager import INTER, LAYOUT, ROUTING, E, H, L, Stack, steps

import moet_store
from moet_kernels.layout import RowLayout
from moet_kernels.reference import route_reference, tiered_moe_slots_reference
from moet_store._faults import inject
from moet_vllm.residency.fp4pool import Fp4Pool
from moet_vllm.residency.fp4tier import Fp4Tier
from moet_vllm.residency.manager import OBSERVE_LAG, MoetResidencyError, ResidencyManager

FP4 = RowLayout(H, INTER, "fp4r")


class Fp4Stack(Stack):
    """The W2 stack plus an fp4r row per (layer, expert) in a pack of its own."""

    def __init__(self, seed: int, directory):
        super().__init__(seed, directory)
        rng = np.random.default_rng([seed, 4])
        self.fp4_sections = [
            {
                "w13_codes": rng.integers(0, 256, (E, 2 * INTER, H // 2), np.uint8),
                "w13_scales": rng.integers(121, 125, (E, 2 * INTER, H // 32), np.uint8),
                "w2_codes": rng.integers(0, 256, (E, H, INTER // 2), np.uint8),
                "w2_scales": rng.integers(121, 125, (E, H, INTER // 32), np.uint8),
            }
            for _ in range(L)
        ]
        self.fp4_rows = [FP4.pack(**s) for s in self.fp4_sections]
        self.fp4_spec = moet_store.PackSpec("fp4r", 0, 0, L, E, FP4.row_bytes, {"test": seed})
        w = moet_store.open_pack_for_write(directory, self.fp4_spec)
        for layer, rows in enumerate(self.fp4_rows):
            w.write_layer(layer, rows)
        w.close()

    def fp4_store(self, backend="ram", **kw):
        return moet_store.open_store(self.directory, self.fp4_spec, backend=backend, **kw)

    def expected(self, x: torch.Tensor, fp4_resident: np.ndarray) -> torch.Tensor:
        """The forward with layer l's expert e from its FP4 row where fp4_resident[l, e], else
        its W2 row: pools built here from the sections, not by the manager; the flat keys it
        routed in `self.keys`."""
        h, self.keys = x, []
        for layer in range(L):
            w, ids = route_reference(h @ self.routers[layer], ROUTING)
            self.keys.append(layer * E + np.unique(ids.numpy()))
            w2_pool = torch.from_numpy(LAYOUT.pack(**self.sections[layer]))
            fp4_pool = torch.from_numpy(self.fp4_rows[layer])
            ident = torch.arange(E, dtype=torch.int32)
            fp4_table = torch.where(torch.from_numpy(fp4_resident[layer]), ident, -1)
            y = tiered_moe_slots_reference(
                h, ids, w, [(fp4_pool, fp4_table, FP4), (w2_pool, ident, LAYOUT)], h.shape[0],
                torch.zeros(1, dtype=torch.int32), torch.zeros(E, dtype=torch.uint8),
            )  # fmt: skip
            h = h + y
        self.keys = np.concatenate(self.keys)
        return h


def fp4_manager(
    stack: Fp4Stack, n_fp4: int, n_slots: int = L * E, fp4_store=None, hot_path=None, **gate
):
    """A W2 pool of `n_slots` (every expert, preloaded, as `gpu_pool=all` boots: nothing can
    miss) beside an FP4 pool of `n_fp4`."""
    fp4 = Fp4Pool(FP4, fp4_store or stack.fp4_store(), L, list(range(L)), E, n_fp4, "cpu",
                  hot_path=hot_path)  # fmt: skip
    mgr = ResidencyManager(
        LAYOUT, list(range(L)), E, n_slots, stack.store(), reduce_max=lambda m: m, kpi_every=0,
        fp4=fp4, **gate,
    )  # fmt: skip
    if n_slots == L * E:
        mgr.hold_every_expert()
    return mgr


class Twin:
    """An Fp4Tier taking the manager's decisions apart from it: fed each decode pass's routing
    (the manager's routed mask) `lag` passes later, just before that pass runs (0: at once)."""

    def __init__(self, n_fp4: int, lag: int = 0):
        self.tier, self.lag, self.queue, self.promoted = Fp4Tier(n_fp4, L, E), lag, [], 0

    def before_pass(self) -> None:
        while self.queue and len(self.queue) >= max(self.lag, 1):
            keys = self.queue.pop(0)
            if keys is not None:  # a prefill teaches nothing
                self.tier.observe(keys, gated=False)
                plan = self.tier.heat_plan(keys)
                self.tier.commit(plan)
                self.promoted += len(plan.fetch_keys)

    def after_pass(self, mgr: ResidencyManager, scan: bool) -> None:
        o, e = np.nonzero(mgr.routed.numpy())
        self.queue.append(None if scan else o.astype(np.int64) * E + e)
        if self.lag == 0:
            self.before_pass()


VOCAB = torch.from_numpy(np.random.default_rng(9).standard_normal((H, 50)).astype(np.float32))


def logits_of(h: torch.Tensor) -> torch.Tensor:
    """A stand-in for the model's lm_head over the stack's output rows."""
    return h @ VOCAB


@pytest.mark.parametrize("w2_slots", [L * E, 12], ids=["w2-complete", "w2-partial"])
@pytest.mark.parametrize("backend", ["ram", "pagecache"])
@pytest.mark.parametrize("n_fp4", [3, 6])
def test_each_step_runs_the_fp4_rows_the_tier_holds_and_w2_elsewhere(
    tmp_path, n_fp4, backend, w2_slots
):
    """From the `ram` host tier the rows are copied from its arena (queued copies), from
    `pagecache` fetched in batches: the same outputs. Beside a W2 pool that can miss, heat
    decides after each step's last pass (its one sync); beside one of every expert, a pass has
    no sync and heat learns its routing exactly OBSERVE_LAG passes later."""
    stack = Fp4Stack(n_fp4, tmp_path)
    mgr = fp4_manager(stack, n_fp4, w2_slots, fp4_store=stack.fp4_store(backend))
    assert (mgr.fp4.host_rows is not None) == (backend == "ram")
    reads = []  # the passes' one sync each, where a W2 pool can miss
    read_counters = mgr._read_counters
    mgr._read_counters = lambda: reads.append(1) or read_counters()
    twin = Twin(n_fp4, lag=OBSERVE_LAG if w2_slots == L * E else 0)
    passes = 0
    for x, scan in steps(n_fp4, 40):
        passes += 1
        twin.before_pass()
        want = stack.expected(x, twin.tier.resident.copy())
        got = mgr.run_forward(
            lambda x=x, eager=False: stack.forward(x, mgr), scan=scan, n_real=x.shape[0]
        )
        assert torch.equal(got, want)
        twin.after_pass(mgr, scan)
        if twin.lag == 0:
            assert np.array_equal(twin.tier.resident, mgr.fp4.tier.resident)
            assert np.array_equal(mgr.fp4.table.numpy() >= 0, twin.tier.resident)
    assert len(reads) >= passes if w2_slots < L * E else not reads
    promoted = twin.promoted
    assert promoted >= n_fp4  # the pool filled
    if n_fp4 == 6:  # and swapped by heat (3 slots hold their hot pairs past the swap margin)
        assert promoted > n_fp4
    c = mgr.fp4.tier.counters
    assert c.promotions == promoted and c.evictions == promoted - n_fp4
    line = mgr.kpi_line()
    assert f"FP4 pool coverage {100 * n_fp4 / (L * E):.1f}%" in line and "FP4 promotions" in line


def test_a_pool_of_every_pair_serves_all_fp4_from_the_first_step(tmp_path):
    stack = Fp4Stack(1, tmp_path)
    mgr = fp4_manager(stack, L * E)
    everything = np.ones((L, E), dtype=bool)
    for x, scan in steps(1, 10):
        got = mgr.run_forward(
            lambda x=x, eager=False: stack.forward(x, mgr), scan=scan, n_real=x.shape[0]
        )
        assert torch.equal(got, stack.expected(x, everything))
    assert mgr.fp4.tier.counters.promotions == 0  # filled at boot, nothing left to promote


def test_a_failed_fp4_fetch_fails_the_step_and_publishes_nothing(tmp_path):
    stack = Fp4Stack(2, tmp_path)
    with inject(eio_after=0):
        bad = moet_store.open_store(tmp_path, stack.fp4_spec, backend="pagecache", preheat=False)
    mgr = fp4_manager(stack, 4, fp4_store=bad)
    x = torch.randn(1, H)
    with pytest.raises(MoetResidencyError, match="FP4 experts from the pack files failed 3 times"):
        for _ in range(OBSERVE_LAG + 1):  # the pass that applies the first one's heat fails
            mgr.run_forward(lambda eager=False: stack.forward(x, mgr), n_real=1)
    assert bool((mgr.fp4.table < 0).all())  # an FP4 row half-read is never served
    assert not mgr.fp4.tier.resident.any()


@pytest.mark.parametrize("in_place", [False, True], ids=["replay", "in-place"])
@pytest.mark.parametrize("tau", [0.0, 10.0, 1e9])
def test_the_gate_replays_a_step_below_tau_with_its_routed_experts_at_fp4(tmp_path, tau, in_place):
    """margin >= 0 always: tau 0 never gates, 1e9 every decode step with a pair at W2, 10 some
    (below tau times that share of the step's pairs). A gated
    step's output is the second pass's, with the first pass's routed pairs promoted; reading in
    place (a W2 pool of 4 slots: most rows read from host memory), the same decisions."""
    from moet_vllm.residency.fp4tier import confidence

    stack = Fp4Stack(5, tmp_path)
    mgr = fp4_manager(stack, 6, n_slots=4 if in_place else 24, gate=True, gate_metric="margin",
                      gate_tau=tau, read_in_place=in_place)  # fmt: skip
    twin = Fp4Tier(6, L, E)
    gated = decode = 0
    for x, scan in steps(5, 30):
        want = stack.expected(x, twin.resident.copy())
        w2 = ~twin.resident.ravel()[np.unique(stack.keys)]  # the step's pairs outside the pool
        fires = not scan and bool(confidence(logits_of(want), "margin").min() < tau * w2.mean())
        if fires:
            twin.commit(twin.gate_plan(stack.keys))
            want = stack.expected(x, twin.resident.copy())
        got = mgr.run_forward(lambda x=x, eager=False: stack.forward(x, mgr), scan=scan,
                              n_real=x.shape[0], logits_of=logits_of)  # fmt: skip
        assert torch.equal(got, want)
        if not scan:
            twin.observe(stack.keys, fires)
            twin.commit(twin.heat_plan(stack.keys))
            decode += 1
            gated += fires
        assert np.array_equal(mgr.fp4.tier.resident, twin.resident)
    assert mgr.fp4.tier.counters.gated_steps == gated
    if tau == 0:
        assert gated == 0
    elif tau == 1e9:
        assert gated == decode
    else:
        assert 0 < gated < decode
    assert f"gate replay {100 * gated / decode:.1f}% of decode steps" in mgr.kpi_line()


def test_the_gate_is_tunable_at_runtime(tmp_path):
    stack = Fp4Stack(6, tmp_path)
    mgr = fp4_manager(stack, 6, gate=True, gate_metric="margin", gate_tau=1e9)
    x = torch.randn(1, H)
    mgr.run_forward(lambda eager=False: stack.forward(x, mgr), n_real=1, logits_of=logits_of)
    assert mgr.fp4.tier.counters.gated_steps == 1
    mgr.tune.poll = lambda: {"gate": "0"}  # what `moet tune gate=0` brings (metrics.TuneWatcher)
    mgr.run_forward(lambda eager=False: stack.forward(x, mgr), n_real=1, logits_of=logits_of)
    assert mgr.gate is False and mgr.fp4.tier.counters.gated_steps == 1


def test_the_fp4_hot_set_persists_and_preloads_the_next_boot(tmp_path):
    stack = Fp4Stack(7, tmp_path)
    hot = tmp_path / "fp4.pool-hot.json"
    mgr = fp4_manager(stack, 6, hot_path=hot)
    for x, scan in steps(7, 20):
        mgr.run_forward(lambda x=x, eager=False: stack.forward(x, mgr), scan=scan, n_real=len(x))
    mgr.save_hot_set()  # what every KPI line does: the 6 hottest pairs (swaps lag heat a little)
    held = np.zeros((L, E), dtype=bool)
    held.ravel()[mgr.fp4.tier.policy.hot_keys()] = True
    assert held.sum() == 6
    again = fp4_manager(stack, 6, hot_path=hot)
    assert again.fp4.load_hot_set() == 6  # activate() does this at boot
    assert np.array_equal(again.fp4.tier.resident, held)
    assert np.array_equal(again.fp4.table.numpy() >= 0, held)
    x = torch.randn(2, H)  # and it serves those rows at FP4 from the first step
    got = again.run_forward(lambda eager=False: stack.forward(x, again), scan=True, n_real=2)
    assert torch.equal(got, stack.expected(x, held))
    hot.write_text("{not json")
    assert fp4_manager(stack, 6, hot_path=hot).fp4.load_hot_set() == 0  # corrupt: nothing


def test_fp4_counters_reach_the_metrics_collector(tmp_path, monkeypatch):
    """What a worker publishes (Publisher) is what `/metrics` exports (Collector): the FP4
    families appear where a rank serves the tier, with its numbers."""
    from moet_vllm.residency import metrics

    monkeypatch.setenv(metrics.RUN_DIR_ENV, str(tmp_path / "run"))
    stack = Fp4Stack(8, tmp_path)
    mgr = fp4_manager(stack, 6, gate=True, gate_metric="margin", gate_tau=1e9)
    for x, scan in steps(8, 6):
        mgr.run_forward(lambda x=x, eager=False: stack.forward(x, mgr), scan=scan,
                        n_real=len(x), logits_of=logits_of)  # fmt: skip
    metrics.Publisher(0).publish(mgr.counters, mgr.coverage, force=True, fp4=mgr.fp4.metrics())
    got = {m.name: m.samples[0].value for m in metrics.Collector().collect()}
    c = mgr.fp4.tier.counters
    assert got["moet_fp4_gated_steps"] == c.gated_steps > 0
    assert got["moet_fp4_promotions"] == c.promotions > 0
    assert got["moet_fp4_pool_coverage"] == pytest.approx(6 / (L * E))
    assert got["moet_steps"] == 6


def test_an_auto_fp4_pool_takes_what_the_w2_pool_leaves_up_to_its_cap(tmp_path, monkeypatch):
    """fp4_pool=auto: one slot at load; before capture, on CUDA from the KV budget the W2 pool
    leaves (carve_auto_pool), on CPU from the memory free then, less the reserve, at most its
    cap; then it serves as an explicit pool of that size would."""
    from moet_vllm.residency import manager as residency
    from moet_vllm.residency import sizing

    stack = Fp4Stack(9, tmp_path)
    mgr = fp4_manager(stack, 1)
    mgr.fp4.auto_cap, mgr.reserve_bytes = 6, 100
    residency.activate(mgr)
    row = FP4.row_bytes
    # CUDA's path: a budget of 3 more rows (the W2 pool is explicit here: it takes nothing)
    assert residency.carve_auto_pool(None, 3 * row + 150) == 3 * row
    assert mgr._fp4_auto == (4, 3 * row + 150)
    residency.size_auto_pool()
    assert mgr.fp4.n_slots == 4 and mgr.fp4.pool.shape[0] == 4 and mgr.fp4.auto_cap is None
    residency.size_auto_pool()  # idempotent
    assert mgr.fp4.n_slots == 4
    # CPU's path, a larger machine: the cap
    again = fp4_manager(stack, 1)
    again.fp4.auto_cap, again.reserve_bytes = 6, 100
    residency.activate(again)
    monkeypatch.setattr(sizing, "free_bytes", lambda device: 100 * row)
    residency.size_auto_pool()
    assert again.fp4.n_slots == 6
    twin = Twin(6, lag=OBSERVE_LAG)  # (the W2 pool holds every expert: no pass syncs)
    for x, scan in steps(9, 20):
        twin.before_pass()
        want = stack.expected(x, twin.tier.resident.copy())
        got = again.run_forward(lambda x=x, eager=False: stack.forward(x, again), scan=scan,
                                n_real=len(x))  # fmt: skip
        assert torch.equal(got, want)
        twin.after_pass(again, scan)
    assert twin.promoted > 0
    again.close()
