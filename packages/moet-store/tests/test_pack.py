"""Pack files: writer, sidecar, identity, stale rebuild, cache dir, pruning, free space, disk full."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import uuid

import numpy as np
import pytest
from conftest import check_batch, expected_rows, make_spec, write_pack

import moet_store
from moet_store import StoreError
from moet_store._faults import inject


def test_layout_and_sidecar(tmp_path):
    spec = make_spec(n_layers=3, n_experts=4, row_bytes=5000)
    rows = write_pack(tmp_path, spec, layers=[0, 2])
    p = spec.paths(tmp_path)
    assert p.pack.name == f"w2-tp0-pp0-{spec.identity_hash}.pack"
    assert spec.stride == 8192
    assert p.pack.stat().st_size == 3 * 4 * 8192  # pre-sized
    side = json.loads(p.sidecar.read_text())
    assert side["stride"] == 8192 and side["n_experts"] == 4 and side["checksum"] == "crc32c"
    assert sorted(side["layers"]) == ["0", "2"]
    assert side["identity"] == spec.identity
    raw = p.pack.read_bytes()
    for layer in (0, 2):
        for e in range(4):
            off = (layer * 4 + e) * 8192
            assert raw[off : off + 5000] == rows[layer, e].tobytes()
            assert raw[off + 5000 : off + 8192] == bytes(3192)
            assert side["layers"][str(layer)][e] == moet_store._core.crc32c(rows[layer, e])
    assert raw[4 * 8192 : 8 * 8192] == bytes(4 * 8192)  # layer 1 is a hole


def test_layers_written_missing_and_idempotent(tmp_path):
    spec = make_spec()
    rows = expected_rows(spec)
    with moet_store.open_pack_for_write(tmp_path, spec, min_free_bytes=0) as w:
        assert w.missing_layers() == [0, 1, 2, 3]
        assert w.write_layer(1, rows[1]) is True
        assert w.write_layer(1, rows[1]) is False  # same bytes: nothing to do
        assert w.layers_written() == [1]
        with pytest.raises(StoreError, match="already written with different bytes") as ei:
            w.write_layer(1, rows[2])
        assert ei.value.errno == errno.EEXIST
        with pytest.raises(ValueError, match="expected n_experts"):
            w.write_layer(0, np.ascontiguousarray(rows[0][:, :10]))
        with pytest.raises(IndexError):
            w.write_layer(9, rows[0])
        with pytest.raises(ValueError, match="C-contiguous"):
            w.write_layer(0, np.asfortranarray(rows[0]))


def test_unwritten_layer_is_never_served(tmp_path):
    spec = make_spec()
    rows = write_pack(tmp_path, spec, layers=[0])
    with moet_store.open_store(tmp_path, spec) as st:
        assert st.missing_layers() == [1, 2, 3]
        with st.fetch([(0, 3)]) as b:
            check_batch(b, [(0, 3)], rows)
        with pytest.raises(StoreError, match="never written") as ei:
            st.fetch([(1, 0)])
        assert ei.value.errno == errno.ENODATA
        with pytest.raises(IndexError, match="out of range"):
            st.fetch([(4, 0)])


def test_identity_a_never_served_for_b(tmp_path):
    a = make_spec(identity={"ckpt_id": "A"})
    b = make_spec(identity={"ckpt_id": "B"})
    assert a.file_name != b.file_name
    write_pack(tmp_path, a, seed=1)
    with pytest.raises(StoreError, match="no pack") as ei:
        moet_store.open_store(tmp_path, b)
    assert ei.value.errno == errno.ENOENT
    # even renamed onto B's name, A's pack is detected by the identity in its sidecar
    pa, pb = a.paths(tmp_path), b.paths(tmp_path)
    os.rename(pa.pack, pb.pack)
    os.rename(pa.sidecar, pb.sidecar)
    with moet_store.open_store(tmp_path, b) as st:
        assert "identity" in st.stale_reason
        assert st.layers_written == []
        with pytest.raises(StoreError):
            st.fetch([(0, 0)])
    rows_b = write_pack(tmp_path, b, seed=2)  # the writer rebuilds it
    with moet_store.open_store(tmp_path, b) as st, st.fetch([(2, 3)]) as batch:
        check_batch(batch, [(2, 3)], rows_b)


@pytest.mark.parametrize("damage", ["truncate_pack", "delete_pack", "geometry", "corrupt_json"])
def test_stale_detected_and_rebuilt(tmp_path, damage, caplog):
    spec = make_spec()
    write_pack(tmp_path, spec)
    p = spec.paths(tmp_path)
    if damage == "truncate_pack":
        os.truncate(p.pack, 1000)
    elif damage == "delete_pack":
        p.pack.unlink()
    elif damage == "geometry":
        side = json.loads(p.sidecar.read_text())
        side["row_bytes"] = 4000
        p.sidecar.write_text(json.dumps(side))
    else:
        p.sidecar.write_bytes(p.sidecar.read_bytes()[:50])
    if damage != "delete_pack":
        with moet_store.open_store(tmp_path, spec) as st:
            assert st.stale_reason and st.layers_written == []
    with caplog.at_level("WARNING", logger="moet_store"):
        w = moet_store.open_pack_for_write(tmp_path, spec, min_free_bytes=0)
    assert "rebuilding stale pack" in caplog.text
    assert w.missing_layers() == [0, 1, 2, 3]
    w.close()
    rows = write_pack(tmp_path, spec, seed=3)
    with moet_store.open_store(tmp_path, spec) as st, st.fetch([(3, 7)]) as b:
        check_batch(b, [(3, 7)], rows)


def test_corrupted_row_is_never_served(tmp_path):
    spec = make_spec()
    write_pack(tmp_path, spec)
    p = spec.paths(tmp_path)
    with open(p.pack, "r+b") as f:
        f.seek((1 * 8 + 2) * spec.stride + 17)
        f.write(b"\xff\x00\xee")
    with moet_store.open_store(tmp_path, spec) as st:
        with pytest.raises(StoreError, match="checksum") as ei:
            st.fetch([(1, 2)])
        assert ei.value.errno == errno.EBADMSG
        assert not st.is_resident(1, 2)
        assert st.stats()["leased_batches"] == 0


def test_per_rank_files_and_default_dir(tmp_path):
    specs = [
        make_spec(tp=t, pp=p, tag=tag) for t in (0, 1) for p in (0, 1) for tag in ("w2", "fp4r")
    ]
    for i, s in enumerate(specs):
        write_pack(None, s, seed=i, layers=[0])
    d = moet_store.default_cache_dir()
    assert d == tmp_path / "xdg-cache" / "moet"
    names = sorted(x.name for x in d.glob("*.pack"))
    assert len(names) == len(specs) == len(set(names))
    for i, s in enumerate(specs):
        with moet_store.open_store(None, s) as st, st.fetch([(0, 1)]) as b:
            check_batch(b, [(0, 1)], expected_rows(s, seed=i))


def test_default_dir_without_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert moet_store.default_cache_dir() == tmp_path / ".cache" / "moet"


def test_bad_specs():
    for bad in [
        dict(tag="../x"),
        dict(tag="a/b"),
        dict(tag=""),
        dict(n_layers=0),
        dict(row_bytes=-1),
    ]:
        with pytest.raises(ValueError):
            make_spec(**bad)
    with pytest.raises((TypeError, ValueError)):
        make_spec(identity={"x": object()})


def test_prune_stale_packs_to_cap(tmp_path):
    old = [make_spec(identity={"ckpt_id": f"old{i}"}) for i in range(3)]
    for i, s in enumerate(old):
        write_pack(tmp_path, s, seed=i)
        t = 1_000_000 + i
        for f in tmp_path.glob(f"*{s.identity_hash}*"):
            os.utime(f, (t, t))
    cur = make_spec(identity={"ckpt_id": "current"})
    each = sum(p["bytes"] for p in moet_store.list_packs(tmp_path)) // 3
    w = moet_store.open_pack_for_write(
        tmp_path, cur, cap_bytes=2 * each + each // 2, min_free_bytes=0
    )
    w.close()
    left = {p["identity_hash"] for p in moet_store.list_packs(tmp_path)}
    assert old[0].identity_hash not in left  # least recently used stale pack went first
    assert old[2].identity_hash in left and cur.identity_hash in left
    removed = moet_store.prune(tmp_path, 0, keep_identities=[cur.identity_hash])
    assert len(removed) == 2
    assert {p["identity_hash"] for p in moet_store.list_packs(tmp_path)} == {cur.identity_hash}


def test_free_space_check_before_writing(tmp_path):
    spec = make_spec()
    with pytest.raises(StoreError, match="not enough free space") as ei:
        moet_store.open_pack_for_write(tmp_path, spec, min_free_bytes=1 << 62)
    assert ei.value.errno == errno.ENOSPC


def test_disk_full_injected_keeps_earlier_layers(tmp_path):
    spec = make_spec()
    rows = expected_rows(spec)
    with inject(enospc_after_bytes=int(2.5 * spec.layer_bytes)):
        w = moet_store.open_pack_for_write(tmp_path, spec, min_free_bytes=0)
    w.write_layer(0, rows[0])
    w.write_layer(1, rows[1])
    with pytest.raises(StoreError, match=r"layers \[0, 1\] are\s+intact") as ei:
        w.write_layer(2, rows[2])
    assert ei.value.errno == errno.ENOSPC
    assert str(spec.paths(tmp_path).pack) in str(ei.value)
    w.close()
    with moet_store.open_store(tmp_path, spec) as st:
        assert st.layers_written == [0, 1]
        keys = [(0, e) for e in range(8)] + [(1, e) for e in range(8)]
        with st.fetch(keys) as b:
            check_batch(b, keys, rows)
    write_pack(tmp_path, spec, layers=[2, 3])  # a later writer completes the pack
    with moet_store.open_store(tmp_path, spec) as st:
        assert st.layers_written == [0, 1, 2, 3]


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        import time

        for _ in range(50):  # io_uring drops its file references asynchronously
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0:
                break
            time.sleep(0.05)
        else:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_real_filesystem(small_fs):
    spec = make_spec(n_layers=8, n_experts=4, row_bytes=60000)  # 256 KiB per layer, 2 MiB pack
    with pytest.raises(StoreError, match="not enough free space"):
        moet_store.open_pack_for_write(small_fs, spec, min_free_bytes=0)
    spec = make_spec(n_layers=3, n_experts=4, row_bytes=60000)  # 768 KiB: fits at open time
    rows = expected_rows(spec)
    w = moet_store.open_pack_for_write(small_fs, spec, min_free_bytes=0)
    w.write_layer(0, rows[0])
    (small_fs / "filler").write_bytes(b"x" * (600 << 10))  # someone else fills the disk
    w.min_free_bytes = -(1 << 40)  # skip the pre-check to hit the kernel's ENOSPC itself
    with pytest.raises(StoreError) as ei:
        w.write_layer(1, rows[1])
    assert ei.value.errno == errno.ENOSPC
    assert "layers [0] are" in str(ei.value)
    w.close()
    with moet_store.open_store(small_fs, spec) as st:
        assert st.layers_written == [0]
        with st.fetch([(0, 3)]) as b:
            check_batch(b, [(0, 3)], rows)
