"""Byte-exact rows through every backend x engine x (buffered | O_DIRECT)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import ENGINES, check_batch, make_spec, write_pack

import moet_store
from moet_store._faults import inject

CASES = [
    ("tiered", "auto"),
    ("tiered", True),
    ("tiered", False),
    ("pagecache", False),
    ("ram", False),
    ("ram", True),
]


@pytest.fixture
def pack(tmp_path):
    spec = make_spec(n_layers=4, n_experts=8, row_bytes=5000)
    rows = write_pack(tmp_path, spec)
    return tmp_path, spec, rows


def all_keys(spec):
    return list(itertools.product(range(spec.n_layers), range(spec.n_experts)))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("backend,direct", CASES)
def test_cold_warm_reboot(pack, backend, direct, engine):
    d, spec, rows = pack
    keys = all_keys(spec)
    kw = dict(backend=backend, direct=direct, engine=engine, arena_bytes=spec.file_bytes)
    with moet_store.open_store(d, spec, **kw) as st:
        info = st.runtime_info()
        assert info["engine"] == engine
        if backend != "pagecache" and direct is True:
            assert info["direct"] is True
        with st.fetch(keys) as b:  # cold
            check_batch(b, keys, rows)
        s1 = st.stats()
        with st.fetch(keys) as b:  # warm
            check_batch(b, keys, rows)
            if backend != "pagecache":
                assert all(b.hits)
        s2 = st.stats()
        if backend == "pagecache":
            assert s2["miss_rows"] == 2 * len(keys)
        else:
            assert s2["hit_rows"] - s1["hit_rows"] == len(keys)
            assert s2["reads"] == len(keys)  # each row read exactly once
        assert s2["latency_us_p50"] is not None and s2["latency_us_p99"] >= s2["latency_us_p50"]
    # reboot from the pack: a fresh store reads the same bytes
    with moet_store.open_store(d, spec, **kw) as st:
        ks = keys[::-1]
        with st.fetch(np.array(ks, dtype=np.int64)) as b:
            check_batch(b, ks, rows)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direct", [False, True])
def test_eviction_storm(pack, engine, direct):
    d, spec, rows = pack
    rng = np.random.default_rng(7)
    with moet_store.open_store(
        d,
        spec,
        arena_bytes=5 * spec.stride,
        stage_bytes=2 * spec.stride,
        engine=engine,
        direct=direct,
    ) as st:
        for _ in range(60):
            n = int(rng.integers(1, 12))
            keys = [(int(rng.integers(0, 4)), int(rng.integers(0, 8))) for _ in range(n)]
            with st.fetch(keys, scan=bool(rng.integers(0, 2))) as b:
                check_batch(b, keys, rows)
        s = st.stats()
        assert s["evictions"] > 0
        assert s["leased_batches"] == 0


def test_overflow_served_from_stage_with_warning(pack, caplog):
    d, spec, rows = pack
    keys = all_keys(spec)[:20]
    with moet_store.open_store(
        d, spec, arena_bytes=4 * spec.stride, stage_bytes=4 * spec.stride
    ) as st:
        with caplog.at_level("WARNING", logger="moet_store"):
            with st.fetch(keys) as b:
                check_batch(b, keys, rows)
                assert sum(b.in_arena) == 4
        assert "overflowed the arena" in caplog.text
        s = st.stats()
        assert s["overflow_rows"] == 16
        assert s["temp_rows"] == 12  # stage of 4 rows, the rest from temporary buffers


def test_scan_resistance(pack):
    d, spec, rows = pack
    hot = [(0, e) for e in range(4)]
    with moet_store.open_store(d, spec, arena_bytes=4 * spec.stride) as st:
        st.fetch(hot).release()
        scan = [(layer, e) for layer in range(1, 4) for e in range(8)]
        with st.fetch(scan, scan=True) as b:  # a long prefill scan
            check_batch(b, scan, rows)
        with st.fetch(hot) as b:
            assert all(b.hits), "a scan evicted the hot set"
        assert st.stats()["evictions"] == 0


def test_scan_fills_free_slots(pack):
    d, spec, rows = pack
    with moet_store.open_store(d, spec, arena_bytes=8 * spec.stride) as st:
        keys = [(1, e) for e in range(8)]
        st.fetch(keys, scan=True).release()
        with st.fetch(keys) as b:
            assert all(b.hits)


def test_batch_slots_never_evicted(pack):
    d, spec, rows = pack
    with moet_store.open_store(d, spec, arena_bytes=3 * spec.stride) as st:
        held = st.fetch([(0, 0), (0, 1), (0, 2)])
        before = [bytes(v) for v in held.views]
        with st.fetch([(3, e) for e in range(8)]) as b:  # would evict everything if it could
            check_batch(b, [(3, e) for e in range(8)], rows)
        assert [bytes(v) for v in held.views] == before
        check_batch(held, [(0, 0), (0, 1), (0, 2)], rows)
        held.release()


@pytest.mark.parametrize("engine", ENGINES)
def test_preheat_hits_only_after_reboot(pack, engine):
    d, spec, rows = pack
    hot = [(2, 5), (1, 1), (3, 7), (0, 2)]
    with moet_store.open_store(d, spec, arena_bytes=8 * spec.stride, engine=engine) as st:
        st.fetch(hot).release()
        st.fetch([(0, 0)]).release()
        st.save_heat()
    assert spec.paths(d).heat.exists()
    with moet_store.open_store(
        d, spec, arena_bytes=8 * spec.stride, engine=engine, preheat=False
    ) as st:
        with st.fetch(hot) as b:
            assert not any(b.hits)
    with moet_store.open_store(d, spec, arena_bytes=8 * spec.stride, engine=engine) as st:
        assert st.runtime_info()["heat"]["preheated"] == 5
        s0 = st.stats()
        with st.fetch(hot) as b:
            assert all(b.hits)
            check_batch(b, hot, rows)
        assert st.stats()["reads"] == s0["reads"]
    # preheat truncated to a smaller arena, keeping the most recent first
    with moet_store.open_store(d, spec, arena_bytes=2 * spec.stride, engine=engine) as st:
        assert st.runtime_info()["heat"]["loaded"] == 2
        assert st.is_resident(0, 0)  # the most recent key comes first
        assert sum(st.is_resident(*k) for k in hot) == 1


def test_short_reads_same_bytes(pack):
    d, spec, rows = pack
    keys = all_keys(spec)
    for direct in (False, True):
        with inject(short_read_every=2):
            st = moet_store.open_store(d, spec, direct=direct)
        with st, st.fetch(keys) as b:
            check_batch(b, keys, rows)


def test_stall_still_correct(pack):
    d, spec, rows = pack
    with inject(stall_us=2000):
        st = moet_store.open_store(d, spec)
    with st:
        with st.fetch([(1, 2)]) as b:
            check_batch(b, [(1, 2)], rows)
        assert st.stats()["latency_us_p99"] >= 2000


def test_auto_engine_for_buffered_only_stores_is_the_pread_pool(tmp_path):
    """The pagecache backend never uses O_DIRECT: auto takes the pread pool (it scales with
    readers where io_uring's buffered reads did not, bench/results/store/h200-2026-11-29.json)."""
    spec = moet_store.PackSpec("w2", 0, 0, 1, 4, 4096, {"ckpt": "engine-choice"})
    with moet_store.open_pack_for_write(tmp_path, spec) as w:
        w.write_layer(0, np.zeros((4, 4096), np.uint8))
    with moet_store.open_store(tmp_path, spec, backend="pagecache") as st:
        info = st.runtime_info()
        assert info["engine"] == "pread" and "buffered reads only" in info["engine_reason"]


def test_ram_rows_have_fixed_arena_slots_holding_their_bytes(pack):
    """The ram backend's arena holds every row from the open on, where arena_slot says (what
    reading rows in place relies on); other backends' rows have a slot only while resident."""
    import ctypes

    d, spec, rows = pack
    with moet_store.open_store(d, spec, backend="ram", direct=False) as st:
        arena = (ctypes.c_uint8 * st.arena_bytes).from_address(st.arena_address)
        slots = set()
        for layer, expert in all_keys(spec):
            slot = st.arena_slot(layer, expert)
            assert slot >= 0
            slots.add(slot)
            start = slot * spec.stride
            got = bytes(arena[start : start + spec.row_bytes])
            assert got == bytes(rows[layer][expert]), (layer, expert)
        assert len(slots) == spec.n_layers * spec.n_experts
    with moet_store.open_store(d, spec, backend="pagecache") as st:
        assert st.arena_slot(0, 0) == -1
