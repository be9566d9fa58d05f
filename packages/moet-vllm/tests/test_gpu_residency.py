"""Tiered residency on the GPU at the manager level (marker `gpu`, run by ci/gpu.sh on the H200):
the serving `ResidencyManager` over a moet-store host tier, with moet-kernels' op in a CUDA graph
as the forward pass (3 MoE layers x 32 experts, top-4, hidden 512, intermediate 256: the pool
holds every expert, so no step misses). A miss-free step costs one device-to-host sync, the miss
counter's; the predicted fetch's cost is measured against it; a pool held whole (`gpu_pool=all`
beside an FP4 tier) costs none. The FP4 pool's promotions from a `ram` FP4 pack are copies queued
from its pinned arena, without a sync."""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
import torch

import moet_store
from moet_kernels.layout import NativeRowLayout, RowLayout
from moet_kernels.ops import w2_moe_slots
from moet_kernels.testing import random_scales
from moet_vllm.residency.fp4pool import Fp4Pool
from moet_vllm.residency.manager import (
    OBSERVE_LAG,
    ResidencyManager,
    pin_host_memory,
    unpin_host_memory,
)

pytestmark = pytest.mark.gpu
H, INTER, L, E, K = 512, 256, 3, 32, 4
STEPS = 50
SYNC_WARNING = "called a synchronizing CUDA operation"


def manager(tmp_path, predict: bool, fp4: Fp4Pool | None = None) -> ResidencyManager:
    """A pool of every (layer, expert) over packs of random rows (trained-shaped scales),
    preloaded."""
    lay = NativeRowLayout(H, INTER)
    spec = moet_store.PackSpec("w2", 0, 0, L, E, lay.row_bytes, {"test": "syncs"})
    gen = torch.Generator(device="cuda").manual_seed(0)
    with moet_store.open_pack_for_write(tmp_path, spec) as writer:
        for layer in range(L):
            secs = {
                name: random_scales((E, *shape), "trained", gen)
                if "scales" in name
                else torch.randint(0, 256, (E, *shape), dtype=torch.uint8, device="cuda")
                for name, (_, shape) in RowLayout(H, INTER).sections.items()
            }
            writer.write_layer(layer, lay.pack(**secs).cpu().numpy())
    store = moet_store.open_store(tmp_path, spec, backend="ram")
    mgr = ResidencyManager(
        lay, list(range(L)), E, L * E, store, kpi_every=0, predict=predict, device="cuda",
        reduce_max=int, fp4=fp4,
    )  # fmt: skip
    mgr.preload(np.arange(L * E))
    return mgr


class Graph:
    """One decode token through the L layers' op, captured once and replayed by `forward`."""

    def __init__(self, mgr: ResidencyManager):
        self.mgr = mgr
        self.x = torch.randn(1, H, device="cuda").to(torch.bfloat16)
        self.ids = torch.randint(0, E, (L, 1, K), dtype=torch.int32, device="cuda")
        self.w = torch.rand(L, 1, K, device="cuda")
        self._eager()  # the op's buffers, before the capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._eager()

    def _eager(self):
        h = self.x
        for layer in range(L):
            table, routed = self.mgr.layer_tables(layer, self.ids[layer])
            h = h + w2_moe_slots(
                h, self.ids[layer], self.w[layer], self.mgr.pool, table, H, INTER,
                self.mgr.n_real, self.mgr.miss_count, routed,
            )  # fmt: skip
        return h

    def forward(self, eager: bool = False):
        if eager:
            return self._eager()
        self.graph.replay()
        return self.out


class CountedSyncs:
    """Counts the syncs inside the block: explicit stream syncs (torch.cuda.Stream.synchronize,
    `n`; torch.cuda.synchronize() is not one) and the implicit ones torch's sync debug mode flags
    (`sites`, where each was called: a pageable copy, an .item(), ...)."""

    def __enter__(self):
        self.n, self._original = 0, torch.cuda.Stream.synchronize

        def counted(stream):  # counted here, not flagged again by the debug mode
            self.n += 1
            torch.cuda.set_sync_debug_mode("default")
            try:
                return self._original(stream)
            finally:
                torch.cuda.set_sync_debug_mode("warn")

        torch.cuda.Stream.synchronize = counted
        self._caught = warnings.catch_warnings(record=True)
        self._warnings = self._caught.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.Stream.synchronize = self._original
        self._caught.__exit__(*exc)
        self.sites = [  # torch's own text (not set_sync_debug_mode's first-call notice)
            f"{w.filename}:{w.lineno}"
            for w in self._warnings
            if str(w.message).startswith(SYNC_WARNING)
        ]


def run(mgr, graph, token_ids=None) -> tuple[int, list[str], float]:
    """STEPS decode steps -> (explicit stream syncs, where torch flagged implicit syncs, us/step)."""
    with CountedSyncs() as syncs:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            mgr.run_forward(graph.forward, n_real=1, token_ids=token_ids)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    return syncs.n, syncs.sites, 1e6 * seconds / STEPS


def test_a_step_that_misses_nothing_syncs_once_and_predicting_costs_more(tmp_path):
    """On demand (the kernels' default, predict=auto): one explicit sync per step (the miss
    count and routed mask together), no implicit one, no replay. With the predicted fetch the
    same steps sync more (the input tokens before the forward, the routing after it) and take
    longer; both costs are printed (docs/residency.md)."""
    on_demand = manager(tmp_path / "a", predict=False)
    syncs, implicit, us = run(on_demand, Graph(on_demand))
    assert (syncs, implicit) == (STEPS, []), (syncs, implicit)
    assert on_demand.counters.replayed_steps == 0 and on_demand.counters.steps == STEPS
    predicting = manager(tmp_path / "b", predict=True)
    token = torch.tensor([7], device="cuda")  # vLLM's input ids live on the GPU
    p_syncs, p_implicit, p_us = run(predicting, Graph(predicting), token_ids=token)
    assert predicting.counters.replayed_steps == 0
    assert p_syncs + len(p_implicit) > syncs
    print(
        f"per miss-free step: on demand {syncs / STEPS:.0f} sync, {us:.1f} us; predicting "
        f"{(p_syncs + len(p_implicit)) / STEPS:.1f} syncs, {p_us:.1f} us ({p_us / us:.2f}x)"
    )
    # unregistered before their stores free the memory (else a later store's arena at the same
    # address fails cudaHostRegister, "already mapped", and the next CUDA call reports it)
    on_demand.close(), predicting.close()


def test_a_pool_held_whole_beside_the_fp4_tier_runs_its_steps_without_a_sync(tmp_path):
    """`gpu_pool=all` with the FP4 tier and the gate off (`hold_every_expert`): no pass can
    miss, so no pass syncs; the FP4 tier learns each pass's routing OBSERVE_LAG passes later
    (its routed mask copied back with an event) and promotes by heat, copies queued from the
    pinned FP4 arena. Its time per step is printed beside the same pool merely preloaded (one
    sync a step)."""
    syncing = manager(tmp_path / "a", predict=False)
    _, _, us_sync = run(syncing, Graph(syncing))
    syncing.close()
    lay = RowLayout(H, INTER, "fp4r")
    rng = np.random.default_rng(1)
    spec = moet_store.PackSpec("fp4r", 0, 0, L, E, lay.row_bytes, {"test": "no sync"})
    (tmp_path / "fp4").mkdir()
    with moet_store.open_pack_for_write(tmp_path / "fp4", spec) as writer:
        for layer in range(L):
            writer.write_layer(layer, rng.integers(0, 256, (E, lay.row_bytes), dtype=np.uint8))
    n_fp4 = 8
    fp4 = Fp4Pool(lay, moet_store.open_store(tmp_path / "fp4", spec, backend="ram"), L,
                  list(range(L)), E, n_fp4, "cuda")  # fmt: skip
    whole = manager(tmp_path / "b", predict=False, fp4=fp4)
    whole.hold_every_expert()
    graph = Graph(whole)
    syncs, implicit, us = run(whole, graph)
    assert (syncs, implicit) == (0, []), (syncs, implicit)
    assert fp4.tier.counters.steps == STEPS - OBSERVE_LAG  # the last passes are on their way
    routed = {layer * E + int(e) for layer in range(L) for e in graph.ids[layer].flatten()}
    held = set(np.flatnonzero(fp4.tier.resident).tolist())
    assert len(held) == min(n_fp4, len(routed)) and held <= routed
    assert np.array_equal(fp4.table.cpu().numpy() >= 0, fp4.tier.resident)
    assert whole.counters.steps == STEPS and whole.counters.replayed_steps == 0
    print(f"per step: pool held whole beside the FP4 tier {us:.1f} us, no sync; preloaded, "
          f"one sync {us_sync:.1f} us")  # fmt: skip
    whole.close()


def test_fp4_promotions_are_queued_copies_from_the_pinned_arena(tmp_path):
    """A plan of 16 FP4 rows of GLM-4.5-Air's expert size (9.8 MB) into the FP4 pool: from a
    `ram` FP4 pack its arena is registered with CUDA and the rows are copies queued on the
    stream, with no sync; from `pagecache` they are fetched and waited for. Either way the pool
    holds the pack's bytes and the table publishes them; both rates are printed."""
    lay = RowLayout(4096, 1408, "fp4r")
    n_layers, n_exp = 2, 16
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 256, (n_exp, lay.row_bytes), dtype=np.uint8) for _ in range(n_layers)]
    spec = moet_store.PackSpec("fp4r", 0, 0, n_layers, n_exp, lay.row_bytes, {"test": "fp4 copy"})
    with moet_store.open_pack_for_write(tmp_path, spec) as writer:
        for layer, layer_rows in enumerate(rows):
            writer.write_layer(layer, layer_rows)
    keys = np.arange(n_layers * n_exp)[::2]
    rate = {}
    for backend in ("ram", "pagecache"):
        store = moet_store.open_store(tmp_path, spec, backend=backend)
        fp4 = Fp4Pool(lay, store, n_layers, list(range(n_layers)), n_exp, len(keys), "cuda")
        try:
            assert (fp4.host_rows is not None) == (backend == "ram")  # ram: pinned and mapped
            torch.cuda.synchronize()
            with CountedSyncs() as syncs:
                t0 = time.perf_counter()
                fp4.gate(keys)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
            assert (syncs.n == 0) == (backend == "ram"), (backend, syncs.n)
            assert syncs.sites == [], (backend, syncs.sites)  # the table published queued
            table = fp4.table.cpu().numpy()
            for key in keys:
                layer, e = divmod(int(key), n_exp)
                got = fp4.pool[int(table[layer, e])].cpu().numpy()
                assert table[layer, e] >= 0 and np.array_equal(got, rows[layer][e])
            rate[backend] = len(keys) * lay.row_bytes / seconds / 1e9
        finally:
            fp4.close()
    print(
        f"16 FP4 rows of {lay.row_bytes / 1e6:.1f} MB: queued from the pinned arena "
        f"{rate['ram']:.1f} GB/s, fetched from pagecache and waited for {rate['pagecache']:.1f} GB/s"
    )


def test_a_failed_pinning_warns_and_leaves_cuda_usable(tmp_path, caplog):
    """Registering an arena CUDA already holds fails (712, already registered): the store is
    named in a warning, served unpinned, and the runtime's last error is cleared, so the next
    kernel launch does not report it as its own failure (run 14: the next pool's allocation)."""
    lay = RowLayout(H, INTER, "fp4r")
    spec = moet_store.PackSpec("fp4r", 0, 0, 1, 2, lay.row_bytes, {"test": "pinned twice"})
    with moet_store.open_pack_for_write(tmp_path, spec) as writer:
        writer.write_layer(0, np.zeros((2, lay.row_bytes), dtype=np.uint8))
    store = moet_store.open_store(tmp_path, spec, backend="ram")
    first = pin_host_memory(store, "cuda")
    try:
        assert store.arena_address in first
        with caplog.at_level("WARNING", logger="vllm.moet"):
            again = pin_host_memory(store, "cuda")
        assert store.arena_address not in again
        assert "pinning the host tier's arena" in caplog.text and str(tmp_path) in caplog.text
        x = torch.zeros(4, device="cuda") + 1  # a kernel launch, checked by torch
        torch.cuda.synchronize()
        assert x.sum().item() == 4
        unpin_host_memory(again)
    finally:
        unpin_host_memory(first)
        store.close()
