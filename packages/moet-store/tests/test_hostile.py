"""Sidecar and heat JSON that is corrupt, hostile or truncated is rejected cleanly (hypothesis)."""

from __future__ import annotations

import errno  # noqa: F401
import json
import logging

import pytest
from conftest import check_batch, make_spec, write_pack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moet_store
from moet_store._jsonio import InvalidJSON
from moet_store.pack import read_sidecar
from moet_store.store import load_heat

logging.getLogger("moet_store").setLevel(logging.ERROR)

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([2**63, 2**64 + 1, -1, -(2**63), 10**300]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(["../../etc/passwd", "/dev/zero", "..", "~root/.ssh", "C:\\x", "\x00"]),
)
json_any = st.recursive(
    json_leaf,
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5),
    max_leaves=30,
)
SIDE_KEYS = [
    "format",
    "version",
    "tag",
    "tp_rank",
    "pp_rank",
    "n_layers",
    "n_experts",
    "row_bytes",
    "slot_bytes",
    "stride",
    "file_bytes",
    "identity",
    "identity_hash",
    "checksum",
    "layers",
]
HYP = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def packdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    spec = make_spec(n_layers=2, n_experts=3, row_bytes=4096)
    rows = write_pack(d, spec)
    return d, spec, rows, spec.paths(d).sidecar.read_bytes()


def _assert_clean(d, spec, rows, original):
    """Either the sidecar is rejected (nothing served) or it is the original; never wrong bytes."""
    try:
        layers = read_sidecar(d, spec)
    except InvalidJSON:
        layers = None
    with moet_store.open_store(d, spec, preheat=False) as s:
        if layers is None:
            assert s.layers_written == [] and s.stale_reason
        for layer in s.layers_written:
            try:
                b = s.fetch([(layer, 0), (layer, 2)])
            except moet_store.StoreError as e:  # e.g. forged checksums: refused, not served
                assert e.errno == 74  # EBADMSG
                continue
            with b:
                check_batch(b, [(layer, 0), (layer, 2)], rows)


@HYP
@given(key=st.sampled_from(SIDE_KEYS), value=json_any)
def test_sidecar_field_replaced(packdir, key, value):
    d, spec, rows, original = packdir
    obj = json.loads(original)
    obj[key] = value
    spec.paths(d).sidecar.write_text(json.dumps(obj))
    try:
        _assert_clean(d, spec, rows, original)
    finally:
        spec.paths(d).sidecar.write_bytes(original)


@HYP
@given(
    layer_key=st.one_of(
        st.text(max_size=8), st.sampled_from(["-1", "01", "2", "99999999", "1e3", "²", "٣"])
    ),
    value=json_any,
)
def test_sidecar_layer_entries(packdir, layer_key, value):
    d, spec, rows, original = packdir
    obj = json.loads(original)
    obj["layers"][layer_key] = value
    spec.paths(d).sidecar.write_text(json.dumps(obj))
    try:
        _assert_clean(d, spec, rows, original)
    finally:
        spec.paths(d).sidecar.write_bytes(original)


@HYP
@given(cut=st.integers(min_value=0, max_value=10_000), junk=st.binary(max_size=40))
def test_sidecar_truncated_or_garbage(packdir, cut, junk):
    d, spec, rows, original = packdir
    spec.paths(d).sidecar.write_bytes(original[: cut % max(1, len(original))] + junk)
    try:
        _assert_clean(d, spec, rows, original)
    finally:
        spec.paths(d).sidecar.write_bytes(original)


@pytest.mark.parametrize(
    "payload",
    [
        b"[" * 200_000 + b"]" * 200_000,
        b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        b'{"version": ' + b"9" * 50_000 + b"}",
        b"NaN",
        b'{"version": Infinity}',
        b"\xff\xfe\x00",
        b"",
    ],
)
def test_sidecar_deep_huge_nonfinite(packdir, payload):
    d, spec, rows, original = packdir
    spec.paths(d).sidecar.write_bytes(payload)
    try:
        with pytest.raises(InvalidJSON):
            read_sidecar(d, spec)
        _assert_clean(d, spec, rows, original)
    finally:
        spec.paths(d).sidecar.write_bytes(original)


def _heat_obj(spec, keys):
    return {
        "format": "moet-heat",
        "version": 1,
        "identity_hash": spec.identity_hash,
        "tag": spec.tag,
        "n_layers": spec.n_layers,
        "n_experts": spec.n_experts,
        "keys": keys,
    }


@HYP
@given(keys=st.lists(json_any, max_size=30), limit=st.integers(min_value=0, max_value=8))
def test_heat_entries_validated(tmp_path, keys, limit):
    spec = make_spec(n_layers=2, n_experts=3)
    p = tmp_path / "h.heat.json"
    p.write_text(json.dumps(_heat_obj(spec, keys)))
    rows, report = load_heat(p, spec, limit)
    assert len(rows) <= limit
    assert len(set(rows)) == len(rows)
    assert all(0 <= r < spec.n_rows for r in rows)
    assert report["rejected"] is None


@HYP
@given(obj=json_any)
def test_heat_whole_file_hostile(tmp_path, obj):
    spec = make_spec(n_layers=2, n_experts=3)
    p = tmp_path / "h.heat.json"
    p.write_text(json.dumps(obj))
    rows, report = load_heat(p, spec, 6)
    assert rows == [] or report["rejected"] is None
    assert all(0 <= r < spec.n_rows for r in rows)


def test_heat_examples(tmp_path):
    spec = make_spec(n_layers=2, n_experts=3)
    p = tmp_path / "h.heat.json"
    keys = [
        [1, 2],
        [1, 2],
        [-1, 0],
        [0, 3],
        [True, 1],
        [0, 1],
        "0/1",
        [0, 0, 0],
        [2**70, 1],
        [0, 2],
    ]
    p.write_text(json.dumps(_heat_obj(spec, keys)))
    rows, report = load_heat(p, spec, 2)
    assert rows == [5, 1]
    other = _heat_obj(spec, [[0, 1]])
    other["identity_hash"] = "0" * 16
    p.write_text(json.dumps(other))
    assert load_heat(p, spec, 4)[1]["rejected"] == "written for another identity"
    p.write_bytes(b"[" * 100_000)
    assert "nested too deeply" in load_heat(p, spec, 4)[1]["rejected"]
    p.write_text(json.dumps(_heat_obj(spec, [[0, 1]]))[:-7])
    assert "not valid JSON" in load_heat(p, spec, 4)[1]["rejected"]


def test_hostile_heat_at_open_is_ignored(tmp_path):
    spec = make_spec()
    rows = write_pack(tmp_path, spec)
    spec.paths(tmp_path).heat.write_bytes(b'{"format": "moet-heat", "version": 1, "keys": [[0,' * 3)
    with moet_store.open_store(tmp_path, spec) as s:
        assert s.runtime_info()["heat"]["rejected"]
        with s.fetch([(0, 1)]) as b:
            check_batch(b, [(0, 1)], rows)
