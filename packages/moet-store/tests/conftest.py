from __future__ import annotations

import numpy as np
import pytest

import moet_store
from moet_store import _core


@pytest.fixture(autouse=True)
def _cache_home(tmp_path, monkeypatch):
    # never write outside tmp dirs: the default cache dir points into tmp_path
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def uring_ok() -> bool:
    return bool(_core.probe_uring()["ok"])


ENGINES = [
    "pread",
    pytest.param("io_uring", marks=pytest.mark.skipif(not uring_ok(), reason="no io_uring")),
]


def make_spec(n_layers=4, n_experts=8, row_bytes=5000, tag="w2", identity=None, tp=0, pp=0):
    return moet_store.PackSpec(
        tag=tag,
        tp_rank=tp,
        pp_rank=pp,
        n_layers=n_layers,
        n_experts=n_experts,
        row_bytes=row_bytes,
        identity=identity if identity is not None else {"ckpt_id": "A", "abi": "w2-v1"},
    )


def expected_rows(spec, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(
        0, 256, size=(spec.n_layers, spec.n_experts, spec.row_bytes), dtype=np.uint8
    )


def write_pack(directory, spec, seed=0, layers=None, **kw) -> np.ndarray:
    rows = expected_rows(spec, seed)
    with moet_store.open_pack_for_write(directory, spec, min_free_bytes=0, **kw) as w:
        for layer in range(spec.n_layers) if layers is None else layers:
            w.write_layer(layer, rows[layer])
    return rows


def check_batch(batch, keys, rows) -> None:
    views = batch.views
    assert len(views) == len(keys)
    for v, (layer, expert) in zip(views, keys):
        got = np.frombuffer(v, dtype=np.uint8)
        assert got.shape == (rows.shape[2],)
        assert np.array_equal(got, rows[layer, expert]), f"row ({layer}, {expert}) differs"
