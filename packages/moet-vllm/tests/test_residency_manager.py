"""The residency manager's fetch-and-replay loop on a small MoE stack (pure torch, no vLLM engine),
with real moet-store packs as the host tier: tiered outputs are bit-identical to the fully
resident stack for random routings and pool sizes; second-order misses, eviction storms, strict and
approximate modes, fetch failures, warm starts and TP consensus."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

import moet_store
from moet_kernels.layout import RowLayout
from moet_kernels.reference import (
    Routing,
    route_reference,
    tiered_moe_slots_reference,
    w2_moe_reference,
    w2_moe_slots_reference,
)
from moet_store._faults import inject
from moet_vllm.residency import sizing
from moet_vllm.residency.manager import (
    AutoPool,
    MoetResidencyError,
    ResidencyManager,
    activate,
    size_auto_pool,
)

L, E, H, INTER, TOP_K = 3, 8, 64, 32, 2
LAYOUT = RowLayout(H, INTER)
ROUTING = Routing(top_k=TOP_K)


class Stack:
    """L MoE layers with residual connections: a later layer's routing depends on the earlier
    layers' outputs, so a corrected early layer can route later layers elsewhere."""

    def __init__(self, seed: int, directory):
        rng = np.random.default_rng(seed)
        self.routers = [
            torch.from_numpy(rng.standard_normal((H, E)).astype(np.float32)) for _ in range(L)
        ]
        self.sections = []
        for _ in range(L):
            self.sections.append(
                {
                    "w13_codes": rng.integers(0, 256, (E, 2 * INTER, H // 4), np.uint8),
                    "w13_scales": rng.integers(121, 125, (E, 2 * INTER, H // 32), np.uint8),
                    "w2_codes": rng.integers(0, 256, (E, H, INTER // 4), np.uint8),
                    "w2_scales": rng.integers(121, 125, (E, H, INTER // 32), np.uint8),
                }
            )
        self.spec = moet_store.PackSpec("w2", 0, 0, L, E, LAYOUT.row_bytes, {"test": seed})
        w = moet_store.open_pack_for_write(directory, self.spec)
        for layer, sec in enumerate(self.sections):
            w.write_layer(layer, LAYOUT.pack(**sec))
        w.close()
        self.directory = directory

    def store(self, backend="ram", **kw):
        return moet_store.open_store(self.directory, self.spec, backend=backend, **kw)

    def forward(self, x: torch.Tensor, mgr: ResidencyManager | None) -> torch.Tensor:
        h = x
        for layer in range(L):
            w, ids = route_reference(h @ self.routers[layer], ROUTING)
            if mgr is None:
                t = {k: torch.from_numpy(v) for k, v in self.sections[layer].items()}
                y = w2_moe_reference(
                    h, ids, w, (t["w13_codes"], t["w13_scales"]), (t["w2_codes"], t["w2_scales"])
                )
            else:
                tiers, routed = mgr.layer_tiers(layer, ids)
                n_real = mgr.n_real_tokens if mgr.n_real_tokens is not None else h.shape[0]
                y = tiered_moe_slots_reference(
                    h, ids, w, tiers.ordered, n_real, mgr.miss_count, routed
                )
            h = h + y
        return h


def manager(stack: Stack, n_slots: int, **kw) -> ResidencyManager:
    kw.setdefault("reduce_max", lambda m: m)
    kw.setdefault("kpi_every", 0)
    return ResidencyManager(
        LAYOUT, list(range(L)), E, n_slots, kw.pop("store", None) or stack.store(), **kw
    )


def steps(seed: int, n: int):
    """(x, scan) per step: decode steps of 1-3 tokens, now and then a 12-token prefill chunk."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        t = 12 if i % 7 == 0 else int(rng.integers(1, 4))
        yield torch.from_numpy(rng.standard_normal((t, H)).astype(np.float32)), t == 12


@pytest.mark.parametrize(
    "n_slots, host_tier", [(4, "ram"), (7, "pagecache"), (12, "tiered"), (24, "ram")]
)
def test_tiered_outputs_are_bit_identical_to_the_resident_stack(tmp_path, n_slots, host_tier):
    stack = Stack(n_slots, tmp_path)
    mgr = manager(stack, n_slots, store=stack.store(host_tier))
    for x, scan in steps(n_slots, 40):
        want = stack.forward(x, None)
        got = mgr.run_forward(
            lambda x=x, eager=False: stack.forward(x, mgr), scan=scan, n_real=x.shape[0]
        )
        assert torch.equal(got, want)
    c = mgr.counters
    assert c.steps == 40 and c.replayed_steps > 0 and c.fetched_rows > 0
    if n_slots < L * E:  # eviction storms: the pool was refilled many times over
        assert c.fetched_rows > n_slots
    if n_slots == 4:  # smaller than some decode steps' working sets: streamed through staging
        assert c.streamed_steps > 0 and c.staged_rows > 0
    assert "replay" in mgr.kpi_line()


@pytest.mark.parametrize("n_slots", [4, 12, L * E])
def test_reading_in_place_is_bit_identical_without_a_sync_or_replay(tmp_path, n_slots):
    """host_tier=ram, read_in_place: what the pool lacks is computed from the host rows, so no
    step replays; the pool still takes what steps read (promotions, one step later), and a pool
    of every expert stops reading from host memory once warm."""
    stack = Stack(100 + n_slots, tmp_path)
    mgr = manager(stack, n_slots, read_in_place=True)
    assert mgr.host_pool is not None and mgr.host_pool.data_ptr() == mgr.store.arena_address
    late_reads = 0
    for i, (x, scan) in enumerate(steps(n_slots, 40)):
        want = stack.forward(x, None)
        got = mgr.run_forward(
            lambda x=x, eager=False: stack.forward(x, mgr), scan=scan, n_real=x.shape[0]
        )
        assert torch.equal(got, want)
        if i == 30:
            late_reads = mgr.counters.host_read_rows
    c = mgr.counters
    assert c.steps == 40 and c.replays == c.replayed_steps == c.missing_pairs == 0
    assert c.host_read_steps > 0 and c.host_read_rows > 0 and c.fetched_rows > 0
    assert c.observed_steps == c.steps - 1  # every pass's routing came back but the last one's
    assert c.streamed_steps == 0  # a step larger than the pool reads the rest in place
    if n_slots == L * E:  # warm: the last steps found every expert in the pool
        assert c.host_read_rows == late_reads
    assert "read in place" in mgr.kpi_line()


def test_reading_in_place_needs_every_row_in_host_memory(tmp_path):
    stack = Stack(5, tmp_path)
    with pytest.raises(MoetResidencyError, match="read_in_place needs host_tier='ram'"):
        manager(stack, 8, store=stack.store("pagecache"), read_in_place=True)


def test_second_order_misses_are_replayed(tmp_path):
    stack = Stack(3, tmp_path)
    mgr = manager(stack, 10)
    for x, scan in steps(5, 25):
        got = mgr.run_forward(
            lambda x=x, eager=False: stack.forward(x, mgr), scan=scan, n_real=x.shape[0]
        )
        assert torch.equal(got, stack.forward(x, None))
    assert mgr.counters.second_order > 0  # a corrected layer routed a later one elsewhere


def test_padding_rows_never_count(tmp_path):
    stack = Stack(4, tmp_path)
    mgr = manager(stack, L * E)
    x = torch.randn(4, H)
    mgr.run_forward(lambda eager=False: stack.forward(x, mgr), n_real=0)  # every row is padding
    assert mgr.counters.replayed_steps == 0 and mgr.counters.fetched_rows == 0


def test_strict_mode_refuses_to_serve_zeroed_experts(tmp_path):
    stack = Stack(5, tmp_path)
    mgr = manager(stack, 12, max_replays=0)
    x = torch.randn(2, H)
    with pytest.raises(MoetResidencyError, match="refusing to serve zeroed experts"):
        mgr.run_forward(lambda eager=False: stack.forward(x, mgr), n_real=2)


def test_approximate_mode_serves_and_reports_what_it_skipped(tmp_path):
    stack = Stack(6, tmp_path)
    mgr = manager(stack, 12, miss_mode="approximate", miss_tolerance=1000)
    x = torch.randn(2, H)
    got = mgr.run_forward(lambda eager=False: stack.forward(x, mgr), n_real=2)
    c = mgr.counters
    assert c.unrestored_steps == 1 and c.skipped_pairs > 0 and c.replays == 0
    assert not torch.equal(got, stack.forward(x, None))  # zeroed experts: a different output
    # the missing experts were still fetched (for the next steps): layer 0's routing does not
    # depend on any expert, so all of its routed experts are resident now
    _, ids = route_reference(x @ stack.routers[0], ROUTING)
    assert c.fetched_rows > 0 and bool((mgr.slot_table[0, ids.unique()] >= 0).all())


def test_a_failed_fetch_is_retried_then_fails_without_publishing(tmp_path):
    stack = Stack(7, tmp_path)
    with inject(eio_after=0):
        store = moet_store.open_store(tmp_path, stack.spec, backend="pagecache", preheat=False)
    mgr = manager(stack, 12, store=store)
    x = torch.randn(2, H)
    with pytest.raises(MoetResidencyError, match="failed 3 times"):
        mgr.run_forward(lambda eager=False: stack.forward(x, mgr), n_real=2)
    assert mgr.counters.fetch_retries == 3
    assert bool((mgr.slot_table < 0).all())  # nothing published: zeroed experts never served
    assert mgr.policy.version == 0


def test_warm_start_preloads_the_saved_hot_set(tmp_path):
    stack = Stack(8, tmp_path)
    hot = tmp_path / "pool-hot.json"
    first = manager(stack, 12, hot_path=hot)
    for x, scan in steps(8, 30):
        first.run_forward(
            lambda x=x, eager=False: stack.forward(x, first), scan=scan, n_real=x.shape[0]
        )
    first.save_hot_set()
    saved = json.loads(hot.read_text())["keys"]
    second = manager(stack, 12, hot_path=hot)
    assert second.load_hot_set() == min(12, len(saved)) > 0
    resident = set(np.flatnonzero(second.slot_table.numpy().ravel() >= 0).tolist())
    assert resident == set(saved[:12])
    hot.write_text("{not json")
    assert manager(stack, 12, hot_path=hot).load_hot_set() == 0  # ignored, with a warning


def test_tensor_parallel_ranks_replay_together(tmp_path):
    """A simulated pair of TP ranks: each takes the larger miss count of the two, so a rank with
    no misses of its own replays with the other (the collective calls stay matched)."""
    barrier, box = threading.Barrier(2), {}

    def reduce_max(rank):
        def f(missed):
            box[rank] = missed
            barrier.wait()
            out = max(box.values())
            barrier.wait()
            return out

        return f

    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir(), b_dir.mkdir()
    stack = Stack(9, a_dir)
    Stack(9, b_dir)
    ranks = [
        manager(stack, L * E, reduce_max=reduce_max(0)),
        manager(stack, L * E, reduce_max=reduce_max(1)),
    ]
    x = torch.randn(2, H)
    ranks[0].preload(np.arange(L * E))  # rank 0 holds every expert: it cannot miss
    calls = [0, 0]

    def run(r):
        def fwd(eager=False):
            calls[r] += 1
            return stack.forward(x, ranks[r])

        ranks[r].run_forward(fwd, n_real=2)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    # rank 0 had nothing to fetch, yet ran exactly as many passes as rank 1
    assert calls[0] == calls[1] >= 2
    assert ranks[0].counters.missing_pairs == 0 and ranks[1].counters.missing_pairs > 0


def test_moet_tune_changes_a_running_manager(tmp_path, monkeypatch, caplog):
    from moet_vllm import cli
    from moet_vllm.residency import metrics

    run = tmp_path / "run"
    monkeypatch.setenv(metrics.RUN_DIR_ENV, str(run))
    stack = Stack(10, tmp_path)
    mgr = manager(stack, 12)
    assert (
        cli.main(["tune", "miss_mode=approximate", "miss_tolerance=1000", "--run", str(run)]) == 0
    )
    x = torch.randn(2, H)
    mgr.run_forward(lambda eager=False: stack.forward(x, mgr), n_real=2)
    assert mgr.miss_mode == "approximate" and mgr.counters.unrestored_steps == 1
    # a bad value written behind the CLI's back is logged and ignored
    (run / metrics.TUNE_FILE).write_text('{"max_replays": "many"}')
    mgr.tune.last = 0.0
    with caplog.at_level("WARNING"):
        mgr.run_forward(lambda eager=False: stack.forward(x, mgr), n_real=2)
    assert mgr.max_replays == 4 and "ignoring runtime settings" in caplog.text
    assert cli.main(["tune", "gpu_pool=10", "--run", str(run)]) == 2  # not runtime-tunable


# -- the expert predictor -----------------------------------------------------------------------


def token_steps(seed: int, n: int, vocab: int = 6):
    """(token ids, x) per decode step of 1-2 tokens: x is the tokens' embedding, so a token's
    routing in every layer is a function of its id (as it largely is in a trained model)."""
    rng = np.random.default_rng(seed)
    emb = torch.from_numpy(rng.standard_normal((vocab, H)).astype(np.float32))
    for _ in range(n):
        toks = torch.from_numpy(rng.integers(0, vocab, int(rng.integers(1, 3))))
        yield toks, emb[toks]


@pytest.mark.parametrize("predict", [True, False])
def test_predicted_experts_are_fetched_before_the_forward(tmp_path, predict):
    stack = Stack(11, tmp_path)
    mgr = manager(stack, 12, predict=predict)
    replays_late = 0
    for i, (toks, x) in enumerate(token_steps(11, 120)):
        got = mgr.run_forward(
            lambda x=x, eager=False: stack.forward(x, mgr), n_real=len(toks), token_ids=toks
        )
        assert torch.equal(got, stack.forward(x, None))  # still bit-identical
        if i == 59:
            before = mgr.counters.replayed_steps
    replays_late = mgr.counters.replayed_steps - before
    c = mgr.counters
    if predict:
        # every token id was seen in the first 60 steps: each later step's experts are fetched
        # before its forward (at most 2 tokens x 3 layers x top-2 = 12 keys: the pool holds them)
        assert replays_late == 0
        assert c.predicted_steps > 30 and 0 < c.predicted_rows <= c.fetched_rows
        assert "predicted fetches" in mgr.kpi_line()
    else:
        assert replays_late > 10 and c.predicted_steps == 0


def test_prefill_learns_but_never_fetches_a_guess(tmp_path):
    stack = Stack(12, tmp_path)
    mgr = manager(stack, 12)
    toks = torch.tensor([0, 1, 2, 3, 4, 5] * 2)
    emb = torch.from_numpy(np.random.default_rng(12).standard_normal((6, H)).astype(np.float32))
    mgr.run_forward(
        lambda eager=False: stack.forward(emb[toks], mgr), scan=True, n_real=12, token_ids=toks
    )
    assert mgr.counters.predicted_steps == 0
    assert mgr.policy.tokens.predict([3], 0.5)[0].size == L * TOP_K  # learned from the prefill
    mgr.run_forward(lambda eager=False: stack.forward(emb[:1], mgr), n_real=1, token_ids=toks[:1])
    assert mgr.counters.replayed_steps == 1  # the prefill's; the decode step's were predicted


def test_a_failed_predicted_fetch_does_not_fail_the_step(tmp_path, monkeypatch, caplog):
    stack = Stack(13, tmp_path)
    mgr = manager(stack, 12)
    for toks, x in token_steps(13, 30):
        mgr.run_forward(
            lambda x=x, eager=False: stack.forward(x, mgr), n_real=len(toks), token_ids=toks
        )
    # token 99 (never seen) is learned to route a key that is not resident: a sure guess
    guess = int(np.flatnonzero(mgr.policy.slot_table.ravel() < 0)[0])
    mgr.policy.learn([99, 99], [[guess], [guess]])
    real, calls = mgr._copy_rows, []

    def flaky(keys, slots):
        calls.append(list(keys))
        if len(calls) == 1:  # the predicted fetch fails half-way: its slots hold garbage
            for slot in slots:
                mgr.pool[int(slot)].fill_(0x55)
            raise MoetResidencyError("moet: fetching failed (test)")
        return real(keys, slots)

    monkeypatch.setattr(mgr, "_copy_rows", flaky)
    predicted = mgr.counters.predicted_steps
    x = torch.randn(1, H)
    with caplog.at_level("WARNING"):
        got = mgr.run_forward(
            lambda eager=False: stack.forward(x, mgr), n_real=1, token_ids=torch.tensor([99])
        )
    assert "the predicted fetch failed" in caplog.text and len(calls[0]) >= 1
    assert torch.equal(got, stack.forward(x, None))  # the garbage slots were never read
    # the host mirror and the device table agree; the guess was not published
    table = mgr.slot_table.numpy()
    assert np.array_equal(table, mgr.policy.slot_table)
    o, e = divmod(guess, E)
    assert int(table[o, e]) < 0 or any(k == (o, e) for k in sum(calls[1:], []))
    assert mgr.counters.predicted_steps == predicted  # a failed fetch is not counted


def test_predict_is_a_config_switch():
    from moet_vllm.config import resolve

    assert resolve(None, None, {}).predict == "auto"  # on with the torch reference only
    assert resolve(None, None, {"MOET_PREDICT": "1"}).predict is True
    assert resolve(None, None, {"MOET_PREDICT": "0"}).predict is False


@pytest.mark.parametrize("n_slots", [10, 14, 20])
def test_serving_replays_the_steps_the_simulator_predicts(tmp_path, n_slots):
    """With the routing fixed by a trace (no second-order misses), the manager replays exactly
    the steps the simulator replays with the same policy and warm start, and misses the same
    pairs: the simulator's figures describe serving."""
    import dataclasses

    from moet_vllm.planning import simulate, traces

    stack = Stack(n_slots, tmp_path)
    profile = dataclasses.replace(
        traces.GLM_5_2, moe_layers=L, n_experts=E, top_k=TOP_K, topic_experts=4, phrase_experts=2
    )
    trace = traces.synthetic_trace(profile, 60, seed=n_slots)  # uint16 [tokens, L, k]
    keys = simulate.decode_steps(trace, E)
    hot = simulate.hottest(keys, L * E)
    sim = simulate.run_policy("decay", keys, n_slots, L, E, initial=hot)
    mgr = manager(stack, n_slots, predict=False)
    mgr.preload(hot)
    rng = np.random.default_rng(n_slots)
    weights = torch.full((1, TOP_K), 1.0 / TOP_K)

    def forward(x, ids):
        h = x
        for layer in range(L):
            table, routed = mgr.layer_tables(layer, ids[layer])
            y = w2_moe_slots_reference(
                h, ids[layer], weights, mgr.pool, table, LAYOUT, 1, mgr.miss_count, routed
            )
            h = h + y
        return h

    for t in range(len(trace)):
        x = torch.from_numpy(rng.standard_normal((1, H)).astype(np.float32))
        ids = torch.from_numpy(trace[t].astype(np.int64)).view(L, 1, TOP_K)
        mgr.run_forward(lambda x=x, ids=ids, eager=False: forward(x, ids), n_real=1)
    c = mgr.counters
    assert 0 < sim.replay_steps < len(trace)  # the pool is neither too small nor everything
    assert (c.replayed_steps, c.missing_pairs) == (sim.replay_steps, sim.missing_pairs)


def test_auto_sizing_takes_what_the_kv_cache_left_less_the_reserve():
    row, gib = 10 << 20, sizing.GIB
    # 2 GiB free, 1 GiB reserve: 102 more slots of 10 MiB on top of the 14 of the load-time pool
    assert sizing.auto_slots(2 * gib, gib, row, 14, 1000, 14, False) == 14 + 102
    assert sizing.auto_slots(100 * gib, gib, row, 14, 1000, 14, False) == 1000  # one per key
    assert sizing.auto_slots(gib // 2, gib, row, 14, 1000, 14, False) == 14  # nothing to add
    with pytest.raises(sizing.MoetSizingError) as e:
        sizing.auto_slots(gib // 2, gib, row, 4, 1000, 14, False)
    msg = str(e.value)
    assert "0.50 GiB free after the KV cache" in msg and "pool_reserve_gib=1" in msg
    assert "hold 4 expert slots of 10.0 MiB, below the boot floor of 14" in msg
    assert "leave at least 1.10 GiB free" in msg  # 10 more slots + the reserve
    assert sizing.auto_slots(gib // 2, gib, row, 4, 1000, 14, True) == 4  # consented
    # the floor of design.md: 1.15 x 3 layers x top-4 x 1 token x 1 sequence = 13.8
    assert sizing.boot_floor(3, 4, 1, 1) == 14 and sizing.boot_floor(3, 4, 2, 16) == 111
    assert sizing.arena_bytes("1.5", 10 * gib) == 3 * gib // 2
    assert 0 < sizing.arena_bytes("auto", 10 * gib) <= 10 * gib


def test_an_auto_pool_resized_before_serving_is_bit_identical(tmp_path, monkeypatch):
    """gpu_pool=auto: the load-time pool (the floor) serves the profiling passes, then takes the
    memory the KV cache left; outputs stay those of the resident stack, the saved hot set is
    preloaded into the new pool."""
    stack = Stack(5, tmp_path)
    hot = tmp_path / "pool-hot.json"
    mgr = manager(stack, 4, hot_path=hot)
    for x, scan in steps(5, 10):  # vLLM's profile and warm-up passes
        got = mgr.run_forward(
            lambda x=x, eager=False: stack.forward(x, mgr), scan=scan, n_real=x.shape[0]
        )
        assert torch.equal(got, stack.forward(x, None))
    mgr.save_hot_set()
    mgr.auto = AutoPool(reserve_bytes=0, floor=4, below_floor_ok=False)
    activate(mgr)
    # the KV cache left room for 15 more slots (a fake free-memory figure: the real one is the
    # host's, far more than this toy needs)
    monkeypatch.setattr(sizing, "free_bytes", lambda device: 15 * LAYOUT.row_bytes + 100)
    size_auto_pool()
    assert mgr.n_slots == 19 and mgr.auto is None and mgr.pool.shape[0] == 19 + E
    assert int((mgr.slot_table >= 0).sum()) == min(19, len(json.loads(hot.read_text())["keys"]))
    size_auto_pool()  # idempotent: the hook may run in both worker classes
    assert mgr.n_slots == 19
    for x, scan in steps(6, 30):
        got = mgr.run_forward(
            lambda x=x, eager=False: stack.forward(x, mgr), scan=scan, n_real=x.shape[0]
        )
        assert torch.equal(got, stack.forward(x, None))
    mgr.close()


def test_a_pool_that_does_not_fit_is_a_clear_error(tmp_path, monkeypatch):
    stack = Stack(6, tmp_path)
    mgr = manager(stack, 4)

    def no_memory(*args, **kwargs):  # an allocator out of memory (the real one cannot be made to
        raise torch.OutOfMemoryError("CUDA out of memory")  # fail safely on demand)

    monkeypatch.setattr(torch, "zeros", no_memory)
    with pytest.raises(sizing.MoetSizingError) as e:
        mgr.resize(1000)
    msg = str(e.value)
    assert "a pool of 1000 expert slots (1008 rows with the pinned and staging ones" in msg
    assert "does not fit in cpu memory" in msg and "lower gpu_pool, or use gpu_pool=auto" in msg
