"""Engine probe and fallbacks: io_uring blocked/absent (seccomp), tiny RLIMIT_MEMLOCK, O_DIRECT
refused, misaligned requests, EIO (transactional publish)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
from conftest import check_batch, expected_rows, make_spec, uring_ok, write_pack

import moet_store
from moet_store import StoreError, _core
from moet_store._faults import inject

CHILD = textwrap.dedent(
    """
    import json, os, resource, sys
    import numpy as np
    args = json.loads(sys.argv[1])
    rng = np.random.default_rng(0)  # before any privilege drop: imports need the full stdlib
    import moet_store
    from moet_store import _core
    spec = moet_store.PackSpec(**args["spec"])
    rows = rng.integers(0, 256, size=(spec.n_layers, spec.n_experts, spec.row_bytes), dtype=np.uint8)
    if args.get("block") is not None:
        _core.block_io_uring(args["block"])
    if args.get("memlock") is not None:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (args["memlock"], args["memlock"]))
        if os.getuid() == 0:  # drop root (and CAP_IPC_LOCK) so the limit applies
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
    with moet_store.open_store(args["dir"], spec, engine=args.get("engine", "auto"),
                               arena_bytes=spec.file_bytes, preheat=False) as st:
        keys = [(l, e) for l in range(spec.n_layers) for e in range(spec.n_experts)]
        ok = True
        for _ in range(2):
            with st.fetch(keys) as b:
                for v, (l, e) in zip(b.views, keys):
                    ok = ok and bytes(v) == rows[l, e].tobytes()
        print(json.dumps({"info": st.runtime_info(), "ok": ok, "doctor": moet_store.doctor(args["dir"])}))
    """
)


def run_child(args: dict) -> dict:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def spec_args(spec):
    return dict(
        tag=spec.tag,
        tp_rank=spec.tp_rank,
        pp_rank=spec.pp_rank,
        n_layers=spec.n_layers,
        n_experts=spec.n_experts,
        row_bytes=spec.row_bytes,
        identity=spec.identity,
    )


@pytest.mark.skipif(not _core.liburing_built(), reason="built without liburing")
@pytest.mark.parametrize(
    "err,state", [(errno.EPERM, "blocked"), (errno.EACCES, "blocked"), (errno.ENOSYS, "absent")]
)
def test_io_uring_blocked_or_absent_falls_back_to_pread(tmp_path, err, state):
    spec = make_spec()
    write_pack(tmp_path, spec)
    out = run_child({"block": err, "dir": str(tmp_path), "spec": spec_args(spec)})
    assert out["ok"]
    assert out["info"]["engine"] == "pread"
    assert f"io_uring {state}" in out["info"]["engine_reason"]
    assert out["doctor"]["io_uring"] == state and out["doctor"]["engine"] == "pread"


@pytest.mark.skipif(not uring_ok(), reason="no io_uring here")
def test_io_uring_requested_but_blocked_is_a_clear_error(tmp_path):
    spec = make_spec()
    write_pack(tmp_path, spec)
    code = (
        "from moet_store import _core; _core.block_io_uring(1); import moet_store, sys, json\n"
        f"spec = moet_store.PackSpec(**json.loads(sys.argv[1]))\n"
        f"try:\n    moet_store.open_store({str(tmp_path)!r}, spec, engine='io_uring')\n"
        "except moet_store.StoreError as e:\n    print('ERR', e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec_args(spec))], capture_output=True, text=True
    )
    assert "ERR" in r.stdout and "io_uring requested but" in r.stdout, r.stderr


@pytest.mark.skipif(not uring_ok(), reason="no io_uring here")
def test_tiny_memlock_gives_unregistered_buffers_same_bytes():
    spec = make_spec(n_layers=4, n_experts=16, row_bytes=8192)  # 512 KiB arena >> 64 KiB limit
    d = tempfile.mkdtemp(prefix="moet-store-memlock-")
    try:
        os.chmod(d, 0o777)
        write_pack(d, spec)
        for f in os.listdir(d):
            os.chmod(os.path.join(d, f), 0o666)
        with moet_store.open_store(d, spec, engine="io_uring", arena_bytes=spec.file_bytes) as st:
            parent = st.runtime_info()
        out = run_child(
            {"memlock": 64 << 10, "engine": "io_uring", "dir": d, "spec": spec_args(spec)}
        )
    finally:
        shutil.rmtree(d, ignore_errors=True)
    assert out["ok"]
    info = out["info"]
    assert info["engine"] == "io_uring"  # not demoted to pread
    assert info["registered_buffers"] is False
    assert "RLIMIT_MEMLOCK" in info["register_note"]
    assert out["doctor"]["memlock_soft"] == 64 << 10
    if os.getuid() == 0:
        assert parent["registered_buffers"] is True


def test_odirect_refused_falls_back_buffered_with_logged_reason(tmp_path, caplog):
    spec = make_spec()
    rows = write_pack(tmp_path, spec)
    with caplog.at_level("WARNING", logger="moet_store"), inject(odirect_refused=True):
        st = moet_store.open_store(tmp_path, spec, direct="auto")
    assert "O_DIRECT refused" in caplog.text
    info = st.runtime_info()
    assert info["direct"] is False and "refused" in info["direct_reason"]
    keys = [(1, e) for e in range(8)]
    with st.fetch(keys) as b:
        check_batch(b, keys, rows)
    st.close()
    with (
        pytest.raises(StoreError, match="O_DIRECT requested but refused"),
        inject(odirect_refused=True),
    ):
        moet_store.open_store(tmp_path, spec, direct=True)


def test_misaligned_requests_rejected(tmp_path):
    spec = make_spec()
    write_pack(tmp_path, spec)
    path = str(spec.paths(tmp_path).pack)
    buf = _core.aligned_buffer(3 * 4096)
    assert _core.raw_read(path, 4096, buf[:4096], "pread", True) == 4096
    with pytest.raises(ValueError, match="misaligned O_DIRECT read: offset 100"):
        _core.raw_read(path, 100, buf[:4096], "pread", True)
    with pytest.raises(ValueError, match="multiples of 4096"):
        _core.raw_read(path, 0, buf[8 : 8 + 4096], "pread", True)
    with pytest.raises(ValueError, match="length 1000"):
        _core.raw_read(path, 0, buf[:1000], "pread", True)
    assert _core.raw_read(path, 100, buf[8:1008], "pread", False) == 1000  # buffered: any alignment


@pytest.mark.parametrize("engine", ["pread", "auto"])
def test_eio_never_publishes_a_slot(tmp_path, engine):
    spec = make_spec()
    rows = write_pack(tmp_path, spec)
    with inject(eio_after=3):
        st = moet_store.open_store(tmp_path, spec, engine=engine, direct=False, preheat=False)
    with st.fetch([(0, 0), (0, 1), (0, 2)]) as b:
        check_batch(b, [(0, 0), (0, 1), (0, 2)], rows)
    keys = [(1, e) for e in range(4)]
    with pytest.raises(StoreError, match="nothing from this batch was published") as ei:
        st.fetch(keys)
    assert ei.value.errno == errno.EIO
    assert not any(st.is_resident(*k) for k in keys)
    assert st.stats()["leased_batches"] == 0
    with st.fetch([(0, 1)]) as b:  # earlier rows still served from the arena
        assert b.hits == [True]
        check_batch(b, [(0, 1)], rows)
    st.close()


def test_engine_pread_explicit_and_bad_args(tmp_path):
    spec = make_spec()
    write_pack(tmp_path, spec)
    with moet_store.open_store(tmp_path, spec, engine="pread", readers=3) as st:
        info = st.runtime_info()
        assert info["engine"] == "pread" and info["readers"] == 3 and info["engine_reason"]
    with pytest.raises(ValueError):
        moet_store.open_store(tmp_path, spec, engine="spdk")
    with pytest.raises(ValueError):
        moet_store.open_store(tmp_path, spec, backend="gpu")
    with pytest.raises(ValueError), inject(bogus=1):
        moet_store.open_store(tmp_path, spec)
    with pytest.raises(TypeError):  # not the public API: a private hook
        moet_store.open_store(tmp_path, spec, faults={"eio_after": 0})


def test_expected_rows_helper_is_deterministic():
    spec = make_spec()
    assert np.array_equal(expected_rows(spec), expected_rows(spec))


def test_faults_reach_only_the_stores_opened_inside_the_hook(tmp_path):
    spec = make_spec()
    rows = write_pack(tmp_path, spec)
    with inject(eio_after=0):
        bad = moet_store.open_store(tmp_path, spec, backend="pagecache", preheat=False)
    good = moet_store.open_store(tmp_path, spec, backend="pagecache", preheat=False)
    with pytest.raises(StoreError):
        bad.fetch([(0, 0)])
    with good.fetch([(0, 0)]) as b:  # opened after the context: nothing injected
        check_batch(b, [(0, 0)], rows)
    bad.close()
    good.close()
