import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moet_quant import study, synth, w2

QUARTERS = [x / 4 for x in range(-36, 37)]  # ties at every candidate midpoint, beyond ±6 too


def direct_cost(u, levels):
    u = np.ravel(np.asarray(u, dtype=np.float64))
    return float((np.min(np.abs(u[:, None] - np.asarray(levels)[None, :]), axis=1) ** 2).sum())


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(QUARTERS), st.floats(-9, 9, allow_nan=False, allow_subnormal=False)
        ),
        min_size=1,
        max_size=24,
    )
)
def test_dp_matches_brute_force(values):
    u = np.array(values, dtype=np.float64)
    levels, cost = study.fit_levels(u)
    _, best = study.brute_force_levels(u)
    tol = 1e-9 * (1.0 + float(u @ u))
    assert abs(cost - best) <= tol
    assert len(set(levels.tolist())) == 4 and np.all(np.diff(levels) > 0)
    assert set(levels.tolist()) <= set(study.CANDIDATES.tolist())
    assert abs(direct_cost(u, levels) - best) <= tol  # the returned set really is optimal
    q = study.assign_levels(u, levels)  # nearest level, ties to the lower one
    assert abs(float(((u - q) ** 2).sum()) - best) <= tol
    mids = (levels[1:] + levels[:-1]) / 2
    for x, y in zip(u, q):
        if x in mids:
            assert y == levels[np.searchsorted(mids, x)]


def test_candidates_and_brute_force_count():
    assert study.CANDIDATES.tolist() == [-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6]


def _sym_data(rng, n=64, k=128):
    """u in {±1, ±4} with one anchor ±4.25 per block (so that e is exactly the block's exponent:
    no block made only of ±1, ±4 can have it, amax / 2**e lies in [6/√2, 6√2])."""
    nb = k // 32
    e = np.repeat(rng.integers(-12, -2, size=(n, nb // 2)), 2, axis=1)  # block pairs share e
    u = rng.choice([-4.0, -1.0, 1.0, 4.0], size=(n, nb, 32))
    pos = rng.integers(0, 32, size=(n, nb))
    sign = np.where(np.arange(nb) % 2 == 0, 1.0, -1.0)[None, :]  # anchors cancel in pairs
    np.put_along_axis(u, pos[..., None], (4.25 * sign)[..., None] * np.ones((n, 1, 1)), axis=2)
    w = (u * np.exp2(e)[..., None]).reshape(n, k)
    anchor = np.zeros((n, nb, 32), dtype=bool)
    np.put_along_axis(anchor, pos[..., None], True, axis=2)
    return w, anchor.reshape(n, k), np.repeat(np.exp2(e), 32, axis=1)


def test_symmetric_data_gives_symmetric_levels_and_gate_passes():
    w, anchor, scale = _sym_data(np.random.default_rng(1))
    sym = w2.quantize_f64(w).dequant()
    assert np.array_equal(sym[~anchor], w[~anchor])  # the codebook is exact off the anchors
    r = study.study_tensor(w, name="sym")
    assert r["levels_l2opt"] == [-4.0, -1.0, 1.0, 4.0] and r["l2opt_is_symmetric"]
    expected = np.sqrt(((0.25 * scale[anchor]) ** 2).sum() / (w * w).sum())
    assert r["rel_rms_sym"] == pytest.approx(expected, rel=1e-12)
    assert r["rel_rms_sym"] < 0.05
    assert r["rel_rms_l2"] == pytest.approx(r["rel_rms_sym"], rel=1e-12)
    assert r["bias_sym"] == 0.0 and r["bias_l2"] == 0.0
    assert r["winner"] == "symmetric"
    g = study.gate(study.summarize([r]))
    assert g["passed"] and len(g["checks"]) == 4
    ratio = next(c for c in g["checks"] if c["name"] == "l2opt_bias_ratio")
    assert ratio["passed"] and "no such tensors" in ratio["note"]


def _asym_data(rng, n=32, k=256):
    e = rng.integers(-10, -4, size=(n, k // 32))
    u = rng.choice([0.0, 1.5, 3.0, 6.0], size=(n, k // 32, 32), p=[0.3, 0.4, 0.2, 0.1])
    u[:, :, 0] = 6.0  # every block's amax is 6 * 2**e
    return (u * np.exp2(e)[..., None]).reshape(n, k)


def test_asymmetric_data_finds_asymmetric_levels_and_gate_fails():
    w = _asym_data(np.random.default_rng(2))
    r = study.study_tensor(w)
    assert r["levels_l2opt"] == [0.0, 1.5, 3.0, 6.0] and not r["l2opt_is_symmetric"]
    assert r["rel_rms_l2"] == 0.0 and r["bias_l2"] == 0.0  # zeros stay 0: 0 is a level
    assert r["rel_rms_sym"] > 0.1 and abs(r["bias_sym"]) > 0.01
    assert r["winner"] == "l2opt"
    s = study.summarize([r])
    assert s["n_l2opt_differs"] == 1 and s["sym_share"] == 0.0
    g = study.gate(s)
    assert not g["passed"]
    failed = {c["name"] for c in g["checks"] if not c["passed"]}
    assert {"sym_mean_abs_bias", "l2opt_bias_ratio", "sym_share"} <= failed


def test_bias_and_rel_rms_hand_computed():
    w = np.array([[6.0, 1.5] + [1.0] * 30])  # amax 6: e = 0, u = w
    r = study.study_tensor(w)
    # symmetric: 6 -> 4 (err -2), 1.5 -> 1 (err -0.5), 1 -> 1; Σw² = 36 + 2.25 + 30
    rms = np.sqrt(68.25 / 32)
    assert r["bias_sym"] == pytest.approx((-2.5 / 32) / rms, rel=1e-14)
    assert r["rel_rms_sym"] == pytest.approx(np.sqrt(4.25 / 68.25), rel=1e-14)
    assert r["bias_l2"] == 0.0 and r["rel_rms_l2"] == 0.0  # {1, 1.5, 6} are e2m1 levels
    assert {1.0, 1.5, 6.0} <= set(r["levels_l2opt"])
    assert r["winner"] == "l2opt"


def test_asymmetric_zero_assignment():
    u = np.zeros((1, 4))
    zero = np.ones((1, 4), dtype=bool)
    # ±1 equidistant from 0: k-parity, odd k negative
    assert study.assign_levels(u, [-4.0, -1.0, 1.0, 4.0], zero).tolist() == [[1, -1, 1, -1]]
    assert study.assign_levels(u, [-4.0, -1.0, 1.0, 4.0]).tolist() == [[-1] * 4]  # ties to lower
    assert study.assign_levels(u, [-1.0, 0.0, 1.0, 4.0], zero).tolist() == [[0] * 4]
    assert study.assign_levels(u, [-1.5, -0.5, 1.0, 3.0], zero).tolist() == [[-0.5] * 4]


def test_zero_balancing_reduces_bias():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 256)) * 0.02
    w[rng.random(w.shape) < 0.3] = 0.0  # +0 only, as in a +0-only export
    assert not np.signbit(w[w == 0]).any()
    auto = study.study_tensor(w, zero_mode="auto")
    sign = study.study_tensor(w, zero_mode="sign")
    assert sign["bias_sym"] > 0.05
    assert abs(auto["bias_sym"]) < abs(sign["bias_sym"]) / 10
    assert auto["levels_l2opt"] == sign["levels_l2opt"]  # the asymmetric side ignores zero_mode
    assert auto["bias_l2"] == sign["bias_l2"]


def test_all_zero_tensor_is_skipped():
    r = study.study_tensor(np.zeros((4, 64)), name="z")
    assert r == {"name": "z", "shape": [4, 64], "skipped": True}
    s = study.summarize([], n_skipped=1)
    g = study.gate(s)
    assert s["n_tensors"] == 0 and s["n_skipped"] == 1 and not g["passed"]


def test_chunking_does_not_change_results(monkeypatch):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((48, 128)) * rng.uniform(0.001, 1.0, size=(48, 1))
    w[rng.random(w.shape) < 0.05] = 0.0
    whole = study.study_tensor(w)
    monkeypatch.setattr(study, "_CHUNK", 300)  # 2 rows per chunk
    chunked = study.study_tensor(w)
    assert chunked["levels_l2opt"] == whole["levels_l2opt"]
    for key in ("rel_rms_sym", "rel_rms_l2", "bias_sym", "bias_l2"):
        assert chunked[key] == pytest.approx(whole[key], rel=1e-9, abs=1e-15)


def test_study_checkpoint_on_synth(tmp_path):
    ckpt = synth.write_checkpoint(tmp_path, "qwen3-moe", "bf16", hidden=64, inter=32, n_experts=4)
    rep = study.study_checkpoint(ckpt, progress=False)
    assert rep["checkpoint"] == str(ckpt) and rep["zero_mode"] == "auto"
    assert len(rep["tensors"]) == 2 * 4 * 3 and rep["skipped"] == []
    names = [t["name"] for t in rep["tensors"]]
    assert len(set(names)) == len(names)
    assert {tuple(t["shape"]) for t in rep["tensors"]} == {(32, 64), (64, 32)}
    assert rep["summary"]["n_tensors"] == 24
    g = rep["gate"]
    assert isinstance(g["passed"], bool) and len(g["checks"]) == 4
    assert [c["name"] for c in g["checks"]] == [
        "sym_mean_abs_bias",
        "l2opt_bias_ratio",
        "sym_share",
        "rel_rms_penalty",
    ]
    for c in g["checks"]:
        assert {"name", "value", "threshold", "passed"} <= set(c)
    assert g["passed"] == all(c["passed"] for c in g["checks"])
    json.dumps(rep, allow_nan=False)
    text = study.format_report(rep)
    assert "GATE: PASS" in text or "GATE: FAIL" in text
    assert text.count("PASS") + text.count("FAIL") == 5
    # the driver studies exactly what study_tensor sees on each source
    from moet_quant.checkpoint import open_checkpoint

    src = open_checkpoint(ckpt).sources[5]
    assert rep["tensors"][5] == study.study_tensor(src.dequant(), name=src.name)
    assert len(study.study_checkpoint(ckpt, limit=5, progress=False)["tensors"]) == 5


def test_speed_large_tensor():
    import time

    w = np.random.default_rng(5).standard_normal((2048, 7168)).astype(np.float32) * 0.02
    t = time.perf_counter()
    r = study.study_tensor(w.astype(np.float64))
    assert time.perf_counter() - t < 10.0  # ~2 s on one core
    assert abs(r["bias_sym"]) < 0.005


def test_symmetric_set_reported_when_it_ties_for_optimal():
    u = np.array([-4.0, 1.0, 4.0, 1.0])  # any set holding {-4, 1, 4} is exact
    levels, cost = study.fit_levels(u)
    assert cost == 0.0 and levels.tolist() == [-4.0, -1.0, 1.0, 4.0]
    levels, _ = study.fit_levels(np.array([-4.0, 1.5, 4.0]))  # the symmetric set is not exact
    assert levels.tolist() != [-4.0, -1.0, 1.0, 4.0]


@pytest.mark.parametrize("progress, shown", [(True, True), (None, True), (False, False)])
def test_progress_bar_only_on_a_tty(tmp_path, monkeypatch, capsys, progress, shown):
    import sys

    ckpt = synth.write_checkpoint(tmp_path, "qwen3-moe", "bf16", n_layers=1, n_experts=2)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    study.study_checkpoint(ckpt, limit=2, progress=progress)
    assert ("codebook study" in capsys.readouterr().err) == shown
