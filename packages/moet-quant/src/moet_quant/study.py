"""Codebook study (`moet-quant study CKPT`): is the sign-symmetric W2 codebook good enough?

For every tensor (one expert's one projection, float64 [N, K]) two 4-level codebooks are compared:

* **Symmetric**: ŵ_sym is the W2 reference quantizer's dequantized output,
  `w2.quantize_f64(w, zero_mode).dequant()` (levels {-4, -1, +1, +4} x 2**e, zero-sign balancing
  per `zero_mode`, default "auto").
* **L2-optimal asymmetric**: with e the W2 reference block exponent (`w2.block_exponent` over
  blocks of 32 along K) and u = w / 2**e, choose 4 distinct levels among the 15 signed e2m1 values
  {±6, ±4, ±3, ±2, ±1.5, ±1, ±0.5, 0} minimizing Σ (u - nearest level)² over all of the tensor's u.
  Solved exactly by a DP (`fit_levels`): with the candidates sorted c_0 < ... < c_14, dp over
  (number chosen, last chosen level); the cost between consecutive chosen levels a < b covers the
  values in (a, b] split at the midpoint (a value exactly at the midpoint goes to the lower level,
  as in the W2 quantizer's ties-to-lower), plus the tails (-inf, first] and (last, +inf). The costs
  come from a histogram of u whose bin edges are all multiples of 1/4 in [-6, 6]: every candidate
  and every midpoint of two candidates is such a multiple, so each bin lies inside one assignment
  region and the per-bin sums (count, Σd, Σd² with d = u - bin centre) give every region's cost
  exactly (up to float64 rounding). When the symmetric set {-4, -1, 1, 4} reaches the optimum (to
  1e-12 relative), it is reported as the optimum. Then ŵ_l2 = level(u) · 2**e with level(u) the
  nearest level, ties to the lower one. Exact zeros of w: if 0 is a level they stay 0, else they
  take the nearest level, and when two levels are equidistant from 0 they are picked by k-parity
  (0-based k along K; odd k -> the negative level): the W2 balancing idea, regardless of zero_mode.

Per tensor, in float64: rel_rms = sqrt(mean((ŵ - w)²)) / sqrt(mean(w²)),
bias = mean(ŵ - w) / sqrt(mean(w²)); tensors with rms(w) = 0 are skipped (and counted). A tensor
is won by the codebook with the smaller |bias| (tie -> symmetric).

Summary over the studied tensors: mean |bias| and mean rel_rms of each codebook; the share of
tensors where the symmetric codebook is L2-optimal or wins; the rel-RMS penalty
mean rel_rms_sym / mean rel_rms_l2 - 1; and over the tensors where the L2-optimal set is not the
symmetric one, the mean |bias| of each codebook and their ratio (l2opt / symmetric).

GATE (all must pass): symmetric mean |bias| < 0.005; where the L2-optimal set differs, its mean
|bias| >= 5x the symmetric's (vacuous when there are no such tensors); symmetric L2-optimal or
winning on > 90% of tensors; rel-RMS penalty < 5%.
"""

from __future__ import annotations

import itertools
import sys
from collections import Counter

import numpy as np

from . import w2

BLOCK = w2.BLOCK
SYM_LEVELS = np.array([-4.0, -1.0, 1.0, 4.0])
CANDIDATES = np.unique(np.concatenate([-w2.E2M1_GRID, w2.E2M1_GRID]))  # 15 sorted levels
_Q = 4  # histogram bin edges at multiples of 1/_Q
_J = int(_Q * CANDIDATES[-1])  # edges j/_Q for j in -_J.._J
_NBINS = 2 * _J + 2  # bins t = 0..49: (-inf, -6], ((j-1)/4, j/4] for j = -23..24, (6, inf)
_CENTRES = (np.arange(-_J, _J + 2) - 0.5) / _Q  # bin t's centre; the tails' at -6.125, 6.125

THRESHOLDS = {
    "sym_mean_abs_bias": 0.005,
    "l2opt_bias_ratio": 5.0,
    "sym_share": 0.90,
    "rel_rms_penalty": 0.05,
}


# --- the L2-optimal codebook --------------------------------------------------------------------


def _bin_stats(u: np.ndarray) -> np.ndarray:
    """[3, _NBINS] per histogram bin: count, Σd, Σd² with d = u - bin centre."""
    u = np.ravel(u)
    q = np.clip(np.ceil(u * _Q), -_J, _J + 1)  # bin (B[t-1], B[t]] with t = q + _J
    d = u - (q - 0.5) * (1.0 / _Q)
    t = (q + _J).astype(np.uint8)
    return np.stack(
        [
            np.bincount(t, minlength=_NBINS).astype(np.float64),
            np.bincount(t, weights=d, minlength=_NBINS),
            np.bincount(t, weights=d * d, minlength=_NBINS),
        ]
    )


def _bin_costs(stats: np.ndarray) -> np.ndarray:
    """C[i, t] = Σ over the values u in histogram bin t of (u - CANDIDATES[i])²."""
    n, s1, s2 = stats
    r = _CENTRES[None, :] - CANDIDATES[:, None]  # (centre - c)
    return s2[None, :] + 2.0 * r * s1[None, :] + n[None, :] * r * r


def _pos(x: float) -> int:
    """Bin slice position of edge x: values in (x, y] are bins _pos(x):_pos(y)."""
    return int(round(x * _Q)) + _J + 1


def _set_cost(cost: np.ndarray, idx: tuple[int, ...] | list[int]) -> float:
    """Cost of the level set CANDIDATES[idx] (sorted indices) from the bin costs."""
    c = CANDIDATES
    total = cost[idx[0], : _pos(c[idx[0]])].sum() + cost[idx[-1], _pos(c[idx[-1]]) :].sum()
    for a, b in zip(idx[:-1], idx[1:]):
        m = _pos((c[a] + c[b]) / 2)
        total += cost[a, _pos(c[a]) : m].sum() + cost[b, m : _pos(c[b])].sum()
    return float(total)


def fit_levels(
    u: np.ndarray, n_levels: int = 4, stats: np.ndarray | None = None
) -> tuple[np.ndarray, float]:
    """Exact L2-optimal n_levels distinct levels among CANDIDATES for the values u (DP).

    Returns (sorted levels, Σ (u - nearest level)²). Prefers the symmetric set on a tie.
    `stats` (a sum of `_bin_stats` over chunks of u) may be given instead of u (u=None).
    """
    if stats is None:
        stats = _bin_stats(u)
    cost = _bin_costs(stats)
    c = CANDIDATES
    nc = c.size
    pos = [_pos(x) for x in c]
    pair = np.full((nc, nc), np.inf)
    for a in range(nc):
        for b in range(a + 1, nc):
            m = _pos((c[a] + c[b]) / 2)
            pair[a, b] = cost[a, pos[a] : m].sum() + cost[b, m : pos[b]].sum()
    low = np.array([cost[i, : pos[i]].sum() for i in range(nc)])
    high = np.array([cost[i, pos[i] :].sum() for i in range(nc)])
    f = low.copy()  # f[b]: best cost of values <= c_b with c_b the last of j chosen levels
    back = []
    for _ in range(n_levels - 1):
        tot = f[:, None] + pair  # [a, b]
        arg = np.argmin(tot, axis=0)
        f = tot[arg, np.arange(nc)]
        back.append(arg)
    final = f + high
    last = int(np.argmin(final))
    best = float(final[last])
    idx = [last]
    for arg in reversed(back):
        idx.append(int(arg[idx[-1]]))
    idx.reverse()
    if n_levels == 4:
        sym_idx = [int(np.searchsorted(c, x)) for x in SYM_LEVELS]
        sym = _set_cost(cost, sym_idx)
        scale = float(cost[int(np.searchsorted(c, 0.0))].sum())  # Σ u²
        if sym <= best + 1e-12 * scale:
            return SYM_LEVELS.copy(), sym
    return c[idx].copy(), best


def brute_force_levels(u: np.ndarray, n_levels: int = 4) -> tuple[np.ndarray, float]:
    """All C(15, n_levels) level sets, costs computed directly (for the tests)."""
    u = np.ravel(np.asarray(u, dtype=np.float64))
    best, best_set = np.inf, None
    for combo in itertools.combinations(CANDIDATES, n_levels):
        lv = np.array(combo)
        cost = float((np.min(np.abs(u[:, None] - lv[None, :]), axis=1) ** 2).sum())
        if cost < best:
            best, best_set = cost, lv
    return best_set, best


def assign_levels(u: np.ndarray, levels: np.ndarray, zero: np.ndarray | None = None) -> np.ndarray:
    """Nearest level of each u [N, K] (ties to the lower level); `zero` marks exact zeros of w,
    which take a level by k-parity (odd k negative) when two levels are equidistant from 0."""
    levels = np.asarray(levels, dtype=np.float64)
    mids = (levels[1:] + levels[:-1]) / 2
    idx = np.zeros(u.shape, dtype=np.intp)
    for m in mids:
        idx += u > m
    if zero is not None and not np.any(levels == 0) and np.any(mids == 0):
        even_k = (np.arange(u.shape[-1]) & 1) == 0
        idx += zero & even_k  # a zero sits at the tied midpoint: it took the lower (negative) one
    return levels[idx]


# --- per tensor ---------------------------------------------------------------------------------


_CHUNK = 1 << 20  # elements per chunk of the per-weight passes (bounded temporaries)


def study_tensor(w: np.ndarray, zero_mode: str = "auto", name: str = "tensor") -> dict:
    """Compare the symmetric and L2-optimal codebooks on one tensor w [N, K] (see module doc).

    A tensor with rms(w) = 0 returns {"name", "shape", "skipped": True}.
    """
    w = np.asarray(w, dtype=np.float64)
    out = {"name": name, "shape": [int(x) for x in w.shape]}
    sym = w2.quantize_f64(w, zero_mode, name=name).dequant()  # validates geometry and finiteness
    n, k = w.shape
    rows = max(1, _CHUNK // k)
    chunks = [slice(r, min(r + rows, n)) for r in range(0, n, rows)]
    sq = sum(float(np.dot(w[c].ravel(), w[c].ravel())) for c in chunks)
    if sq == 0.0:
        return {**out, "skipped": True}
    rms_w = np.sqrt(sq / w.size)

    def scaled(c: slice) -> tuple[np.ndarray, np.ndarray]:
        blocks = w[c].reshape(-1, k // BLOCK, BLOCK)
        e = w2.block_exponent(np.abs(blocks).max(-1)).astype(np.float64)
        scale = np.exp2(e)[..., None]
        return (blocks / scale).reshape(-1, k), scale

    stats = sum(_bin_stats(scaled(c)[0]) for c in chunks)
    levels, _ = fit_levels(None, stats=stats)
    acc = np.zeros(4)  # Σ err_sym, Σ err_sym², Σ err_l2, Σ err_l2²
    for c in chunks:
        u, scale = scaled(c)
        l2 = (
            assign_levels(u, levels, w[c] == 0).reshape(scale.shape[:2] + (BLOCK,)) * scale
        ).reshape(-1, k)
        for i, err in enumerate((sym[c] - w[c], l2 - w[c])):
            acc[2 * i] += err.sum()
            acc[2 * i + 1] += np.dot(err.ravel(), err.ravel())
    m = acc / w.size
    bias_sym, bias_l2 = float(m[0] / rms_w), float(m[2] / rms_w)
    return {
        **out,
        "levels_l2opt": [float(x) for x in levels],
        "l2opt_is_symmetric": bool(np.array_equal(levels, SYM_LEVELS)),
        "rel_rms_sym": float(np.sqrt(m[1]) / rms_w),
        "rel_rms_l2": float(np.sqrt(m[3]) / rms_w),
        "bias_sym": bias_sym,
        "bias_l2": bias_l2,
        "winner": "symmetric" if abs(bias_sym) <= abs(bias_l2) else "l2opt",
    }


# --- summary and gate ---------------------------------------------------------------------------


def _mean(xs) -> float | None:
    xs = list(xs)
    return float(np.mean(xs)) if xs else None


def summarize(tensors: list[dict], n_skipped: int = 0) -> dict:
    t = [x for x in tensors if not x.get("skipped")]
    diff = [x for x in t if not x["l2opt_is_symmetric"]]
    ok = [x for x in t if x["l2opt_is_symmetric"] or x["winner"] == "symmetric"]
    m_sym, m_l2 = _mean(x["rel_rms_sym"] for x in t), _mean(x["rel_rms_l2"] for x in t)
    d_sym = _mean(abs(x["bias_sym"]) for x in diff)
    d_l2 = _mean(abs(x["bias_l2"]) for x in diff)
    sets = Counter(str(x["levels_l2opt"]) for x in t)
    return {
        "n_tensors": len(t),
        "n_skipped": n_skipped,
        "mean_abs_bias_sym": _mean(abs(x["bias_sym"]) for x in t),
        "mean_abs_bias_l2": _mean(abs(x["bias_l2"]) for x in t),
        "mean_rel_rms_sym": m_sym,
        "mean_rel_rms_l2": m_l2,
        "n_l2opt_symmetric": len(t) - len(diff),
        "n_sym_wins": sum(x["winner"] == "symmetric" for x in t),
        "sym_share": len(ok) / len(t) if t else None,
        "rel_rms_penalty": m_sym / m_l2 - 1.0 if t and m_l2 > 0 else None,
        "n_l2opt_differs": len(diff),
        "differs_mean_abs_bias_l2": d_l2,
        "differs_mean_abs_bias_sym": d_sym,
        "differs_bias_ratio": d_l2 / d_sym if diff and d_sym > 0 else None,
        "l2opt_level_sets": dict(sets.most_common(5)),
    }


def gate(summary: dict) -> dict:
    th = THRESHOLDS
    checks = []
    if not summary["n_tensors"]:
        for name, op in (
            ("sym_mean_abs_bias", "<"),
            ("l2opt_bias_ratio", ">="),
            ("sym_share", ">"),
            ("rel_rms_penalty", "<"),
        ):
            checks.append(
                {
                    "name": name,
                    "value": None,
                    "threshold": th[name],
                    "op": op,
                    "passed": False,
                    "note": "no tensors studied",
                }
            )
        return {"passed": False, "checks": checks}
    v = summary["mean_abs_bias_sym"]
    checks.append(
        {
            "name": "sym_mean_abs_bias",
            "value": v,
            "threshold": th["sym_mean_abs_bias"],
            "op": "<",
            "passed": v < th["sym_mean_abs_bias"],
        }
    )
    ratio = {
        "name": "l2opt_bias_ratio",
        "value": summary["differs_bias_ratio"],
        "threshold": th["l2opt_bias_ratio"],
        "op": ">=",
    }
    if not summary["n_l2opt_differs"]:
        ratio.update(passed=True, note="no such tensors (the L2-optimal set is always symmetric)")
    else:
        d_l2, d_sym = summary["differs_mean_abs_bias_l2"], summary["differs_mean_abs_bias_sym"]
        ratio["passed"] = bool(d_l2 >= th["l2opt_bias_ratio"] * d_sym)
        ratio["note"] = (
            f"over {summary['n_l2opt_differs']} tensors where the L2-optimal set differs"
        )
        if d_sym == 0:
            ratio["note"] += "; symmetric mean |bias| is 0 there"
    checks.append(ratio)
    v = summary["sym_share"]
    checks.append(
        {
            "name": "sym_share",
            "value": v,
            "threshold": th["sym_share"],
            "op": ">",
            "passed": v > th["sym_share"],
        }
    )
    v = summary["rel_rms_penalty"]
    checks.append(
        {
            "name": "rel_rms_penalty",
            "value": v,
            "threshold": th["rel_rms_penalty"],
            "op": "<",
            "passed": v is not None and v < th["rel_rms_penalty"],
        }
    )
    return {"passed": all(c["passed"] for c in checks), "checks": checks}


# --- checkpoint driver and report ---------------------------------------------------------------


def study_checkpoint(
    path, zero_mode: str = "auto", limit: int | None = None, progress: bool | None = True
) -> dict:
    """Study every expert projection of a checkpoint, one tensor at a time (bounded memory).

    A tqdm bar goes to stderr when it is a TTY and progress is True or None (False: never).
    """
    from .checkpoint import open_checkpoint

    ckpt = open_checkpoint(path)
    try:
        sources = ckpt.sources if limit is None else ckpt.sources[: max(limit, 0)]
        tensors, skipped = [], []
        bar = None
        if progress is not False and sys.stderr.isatty():  # None: auto, like True
            from tqdm import tqdm

            bar = tqdm(total=len(sources), desc="codebook study", unit="tensor", file=sys.stderr)
        for src in sources:
            r = study_tensor(src.dequant(), zero_mode, src.name)
            if r.get("skipped"):
                skipped.append(src.name)
            else:
                tensors.append(r)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
    finally:
        ckpt.close()
    summary = summarize(tensors, len(skipped))
    return {
        "checkpoint": str(path),
        "zero_mode": zero_mode,
        "tensors": tensors,
        "skipped": skipped,
        "summary": summary,
        "gate": gate(summary),
    }


def _f(x, spec: str = ".5f") -> str:
    return "n/a" if x is None else format(x, spec)


def format_report(report: dict) -> str:
    s, g = report["summary"], report["gate"]
    n = s["n_tensors"]
    lines = [
        f"codebook study: {report['checkpoint']}  zero_mode={report['zero_mode']}  "
        f"tensors={n}" + (f" (skipped {s['n_skipped']} all-zero)" if s["n_skipped"] else ""),
        f"  {'':22}{'symmetric':>12}{'l2-optimal':>12}",
        f"  {'mean |bias|':22}{_f(s['mean_abs_bias_sym']):>12}{_f(s['mean_abs_bias_l2']):>12}",
        f"  {'mean rel-RMS':22}{_f(s['mean_rel_rms_sym']):>12}{_f(s['mean_rel_rms_l2']):>12}",
    ]
    if n:
        lines.append(
            f"  L2-optimal set is symmetric on {s['n_l2opt_symmetric']}/{n}; symmetric "
            f"wins on |bias| on {s['n_sym_wins']}/{n}; L2-optimal or wins: "
            f"{100 * s['sym_share']:.1f}%"
        )
        sets = ", ".join(f"{k} x{v}" for k, v in s["l2opt_level_sets"].items())
        lines.append(f"  L2-optimal level sets: {sets}")
        if s["n_l2opt_differs"]:
            lines.append(
                f"  where they differ ({s['n_l2opt_differs']}): mean |bias| l2opt "
                f"{_f(s['differs_mean_abs_bias_l2'])} vs symmetric "
                f"{_f(s['differs_mean_abs_bias_sym'])} (ratio "
                f"{_f(s['differs_bias_ratio'], '.2f')}x)"
            )
        lines.append(f"  rel-RMS penalty of symmetric: {_f(s['rel_rms_penalty'], '+.2%')}")
    for c in g["checks"]:
        val = _f(c["value"], ".5g")
        note = f"  ({c['note']})" if c.get("note") else ""
        lines.append(
            f"  {'PASS' if c['passed'] else 'FAIL'}  {c['name']:18} {val} {c['op']} "
            f"{c['threshold']:g}{note}"
        )
    lines.append(f"GATE: {'PASS' if g['passed'] else 'FAIL'}")
    return "\n".join(lines)
