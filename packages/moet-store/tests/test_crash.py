"""Crash safety: kill -9 writers at random points; a reopened pack never serves a partial row and
the writer rebuilds what is missing."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import numpy as np
import pytest
from conftest import expected_rows, make_spec

import moet_store
from moet_store import StoreError

TRIALS = 240


def _child_write(directory, spec, seed, order):
    try:
        rows = expected_rows(spec, seed)
        with moet_store.open_pack_for_write(directory, spec, min_free_bytes=0) as w:
            for layer in order:
                w.write_layer(layer, rows[layer])
        os._exit(0)
    except BaseException:
        os._exit(3)


def _verify(directory, spec, rows) -> list[int]:
    """Every row the reader serves must be exact; unwritten layers must raise. Returns written."""
    with moet_store.open_store(directory, spec, engine="pread", arena_bytes=spec.file_bytes) as st:
        written = st.layers_written
        for layer in range(spec.n_layers):
            keys = [(layer, e) for e in range(spec.n_experts)]
            if layer in written:
                with st.fetch(keys) as b:
                    for v, (l_, e) in zip(b.views, keys):
                        assert bytes(v) == rows[l_, e].tobytes(), f"partial/wrong row ({l_}, {e})"
            else:
                with pytest.raises(StoreError):
                    st.fetch(keys[:1])
        return written


def test_kill_minus_9_writers(tmp_path):
    rnd = random.Random(1234)
    spec_base = dict(n_layers=6, n_experts=4, row_bytes=3000)
    t0 = time.monotonic()
    killed_mid = 0
    for trial in range(TRIALS):
        kind = trial % 3
        d = tmp_path / f"g{trial // 12}"  # packs shared by a group of trials: resume + rebuild
        spec = make_spec(**spec_base, identity={"ckpt_id": f"c{trial // 12}"})
        rows = expected_rows(spec, seed=trial // 12)
        p = spec.paths(d)
        if kind == 2 and p.pack.exists():
            # a stale pack (size mismatch) forces the writer through its rebuild path
            os.truncate(p.pack, 4096)
        order = list(range(spec.n_layers))
        rnd.shuffle(order)
        pid = os.fork()
        if pid == 0:
            _child_write(d, spec, trial // 12, order)
        time.sleep(rnd.uniform(0, 0.012))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            killed_mid += 1
        else:
            assert os.WEXITSTATUS(status) == 0
        if p.pack.exists():
            _verify(d, spec, rows)
        if trial % 4 == 3:  # rebuild what is missing, then everything is served
            with moet_store.open_pack_for_write(d, spec, min_free_bytes=0) as w:
                for layer in w.missing_layers():
                    w.write_layer(layer, rows[layer])
            assert _verify(d, spec, rows) == list(range(spec.n_layers))
            side = json.loads(p.sidecar.read_text())
            assert len(side["layers"]) == spec.n_layers
    elapsed = time.monotonic() - t0
    assert killed_mid >= TRIALS // 4, "kills should land mid-write"
    assert elapsed < 90


def test_sidecar_replace_is_atomic_under_failure(tmp_path, monkeypatch):
    spec = make_spec()
    rows = expected_rows(spec)
    w = moet_store.open_pack_for_write(tmp_path, spec, min_free_bytes=0)
    w.write_layer(0, rows[0])

    def boom(*a, **k):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(StoreError, match="stays unlisted"):
        w.write_layer(1, rows[1])
    monkeypatch.undo()
    assert w.layers_written() == [0]
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]  # no stray temp sidecar
    w.write_layer(1, rows[1])
    assert w.layers_written() == [0, 1]
    w.close()
    assert np.array_equal(expected_rows(spec), rows)
