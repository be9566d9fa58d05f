"""Several processes reading and writing one pack directory."""

from __future__ import annotations

import multiprocessing as mp
import random

from conftest import expected_rows, make_spec

import moet_store
from moet_store import StoreError

N_LAYERS = 12


def _writer(directory, seed, out):
    try:
        spec = make_spec(n_layers=N_LAYERS, n_experts=4, row_bytes=3000)
        rows = expected_rows(spec)
        order = list(range(N_LAYERS))
        random.Random(seed).shuffle(order)
        w = moet_store.open_pack_for_write(directory, spec, min_free_bytes=0)
        for layer in order:
            w.write_layer(layer, rows[layer])
        w.close()
        # a second pack of another rank in the same directory
        spec2 = make_spec(n_layers=2, n_experts=4, row_bytes=3000, tp=1 + seed % 2)
        r2 = expected_rows(spec2, seed=9)
        with moet_store.open_pack_for_write(directory, spec2, min_free_bytes=0) as w2:
            for layer in range(2):
                w2.write_layer(layer, r2[layer])
        out.put(("ok", seed))
    except BaseException as e:  # noqa: BLE001
        out.put(("error", repr(e)))


def _reader(directory, seed, out):
    try:
        spec = make_spec(n_layers=N_LAYERS, n_experts=4, row_bytes=3000)
        rows = expected_rows(spec)
        rnd = random.Random(seed)
        served = 0
        for _ in range(40):
            try:
                st = moet_store.open_store(
                    directory, spec, arena_bytes=8 * spec.stride, engine="pread"
                )
            except StoreError:
                continue  # the pack does not exist yet
            with st:
                for layer in st.layers_written:
                    keys = [(layer, rnd.randrange(4)) for _ in range(3)]
                    with st.fetch(keys) as b:
                        for v, (lay, e) in zip(b.views, keys):
                            assert bytes(v) == rows[lay, e].tobytes()
                            served += 1
        out.put(("ok", served))
    except BaseException as e:  # noqa: BLE001
        out.put(("error", repr(e)))


def test_processes_share_a_pack_directory(tmp_path):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(tmp_path, s, q)) for s in range(3)]
    procs += [ctx.Process(target=_reader, args=(tmp_path, 10 + s, q)) for s in range(3)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(r[0] == "ok" for r in results), results
    spec = make_spec(n_layers=N_LAYERS, n_experts=4, row_bytes=3000)
    rows = expected_rows(spec)
    with moet_store.open_store(tmp_path, spec) as st:
        assert st.layers_written == list(range(N_LAYERS))  # the writers' layer lists merged
        keys = [(layer, e) for layer in range(N_LAYERS) for e in range(4)]
        with st.fetch(keys) as b:
            for v, (lay, e) in zip(b.views, keys):
                assert bytes(v) == rows[lay, e].tobytes()
