"""Zero-copy views (numpy, torch), leases, pinning hooks, keys formats, doctor and the CLI."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import check_batch, make_spec, write_pack

import moet_store
from moet_store import StoreError
from moet_store.cli import main as cli_main


@pytest.fixture
def store(tmp_path):
    spec = make_spec(n_layers=4, n_experts=8, row_bytes=5000)
    rows = write_pack(tmp_path, spec)
    st = moet_store.open_store(tmp_path, spec, arena_bytes=16 * spec.stride)
    yield st, spec, rows
    st.close()


def test_hit_is_zero_copy_pointer_identity(store):
    st, spec, rows = store
    keys = [(1, 2), (3, 4), (0, 0)]
    st.fetch(keys).release()
    assert st.arena_address % 4096 == 0 and st.arena_bytes == 16 * spec.stride
    with st.fetch(keys) as b:
        assert all(b.hits)
        for v, p in zip(b.views, b.ptrs):
            a = np.frombuffer(v, dtype=np.uint8)
            assert a.ctypes.data == p  # the view IS arena memory
            assert st.arena_address <= p < st.arena_address + st.arena_bytes
            assert (p - st.arena_address) % spec.stride == 0
            assert not a.flags.writeable
        first = list(b.ptrs)
    with st.fetch(keys) as b:
        assert b.ptrs == first


def test_torch_frombuffer_no_copy(store):
    torch = pytest.importorskip("torch")
    st, spec, rows = store
    with st.fetch([(2, 2)]) as b:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer warning
            t = torch.frombuffer(b.views[0], dtype=torch.uint8)
        assert t.data_ptr() == b.ptrs[0]
        assert torch.equal(t, torch.from_numpy(rows[2, 2]))


def test_writable_views_option(tmp_path):
    spec = make_spec()
    write_pack(tmp_path, spec)
    with moet_store.open_store(tmp_path, spec, writable_views=True) as st, st.fetch([(0, 0)]) as b:
        assert not b.views[0].readonly


def test_lease_release_and_views_lifetime(store):
    st, spec, rows = store
    b = st.fetch([(1, 1)])
    v = b.views[0]
    assert st.stats()["leased_batches"] == 1
    b.release()
    b.release()  # idempotent
    assert b.released and st.stats()["leased_batches"] == 0
    with pytest.raises(RuntimeError, match="released"):
        _ = b.views
    assert bytes(v) == rows[1, 1].tobytes()  # memory stays mapped while a view exists


def test_views_outlive_a_closed_store(tmp_path):
    spec = make_spec()
    rows = write_pack(tmp_path, spec)
    st = moet_store.open_store(tmp_path, spec)
    b = st.fetch([(3, 3)])
    v = b.views[0]
    st.close()
    del st, b
    assert bytes(v) == rows[3, 3].tobytes()


def test_closed_store_refuses(tmp_path):
    spec = make_spec()
    write_pack(tmp_path, spec)
    st = moet_store.open_store(tmp_path, spec)
    st.close()
    with pytest.raises(StoreError, match="closed"):
        st.fetch([(0, 0)])


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16, np.int16, np.uint8])
def test_key_arrays(store, dtype):
    st, spec, rows = store
    keys = [(3, 1), (0, 7), (2, 2)]
    with st.fetch(np.array(keys, dtype=dtype)) as b:
        check_batch(b, keys, rows)
    with st.fetch([list(k) for k in keys]) as b:
        check_batch(b, keys, rows)
    with st.fetch(tuple(keys)) as b:
        check_batch(b, keys, rows)
    with st.fetch([]) as b:
        assert len(b) == 0 and b.views == []


def test_bad_keys(store):
    st, _, _ = store
    with pytest.raises(TypeError):
        st.fetch([(1, "a")])
    with pytest.raises(TypeError):
        st.fetch([1, 2])
    with pytest.raises(TypeError):
        st.fetch(np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(ValueError, match=r"\[n, 2\]"):
        st.fetch(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(IndexError, match="out of range"):
        st.fetch(np.array([[0, 8]]))
    with pytest.raises(IndexError):
        st.fetch([(2**70, 0)])
    with pytest.raises(IndexError):
        st.fetch(np.array([[2**63 + 5, 0]], dtype=np.uint64))
    assert st.stats()["leased_batches"] == 0


def test_stats_and_runtime_info(store):
    st, spec, rows = store
    st.fetch([(0, 0), (0, 1)]).release()
    st.fetch([(0, 0)]).release()
    s = st.stats()
    assert s["hit_rows"] == 1 and s["miss_rows"] == 2 and s["reads"] == 2
    assert s["bytes"] >= 2 * spec.row_bytes
    assert s["latency_us_p99"] >= s["latency_us_p50"] > 0
    info = st.runtime_info()
    for k in (
        "engine",
        "engine_reason",
        "direct",
        "direct_reason",
        "registered_buffers",
        "readers",
    ):
        assert k in info
    assert st.hot_keys(1) == [(0, 0)]


def test_doctor_and_cli(tmp_path, capsys):
    spec = make_spec()
    write_pack(tmp_path, spec, layers=[0, 1])
    d = moet_store.doctor(tmp_path)
    for k in ("engine", "reason", "o_direct", "memlock_soft", "free_bytes", "registered_buffers"):
        assert k in d
    assert d["packs"] == 1 and d["pack_list"][0]["layers_written"] == 2
    text = moet_store.format_doctor(d)
    assert "engine" in text and "O_DIRECT" in text and "memlock" in text
    assert cli_main(["doctor", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2/4 layers" in out
    assert cli_main(["doctor", str(tmp_path / "nope"), "--json"]) == 0
    assert '"path_exists": false' in capsys.readouterr().out
    assert cli_main(["ls", str(tmp_path)]) == 0
    assert spec.file_name in capsys.readouterr().out
