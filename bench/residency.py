"""The expert-pool cache policy vs Belady, on synthetic and real routing traces (issue 7's simulator).

Run through nox: `nox -s bench -- residency-policy` (`residency-tune`, its `--tune`, adds the decay half-life sweep and the
variants tried, docs/residency-design.md "What was tried"). Traces: two synthetic ones
(DeepSeek-V4-Flash- and GLM-5.2-shaped, moet_vllm.planning.traces, seed 0) and the fixture
model's real one (bench/fixture: the routing of its test split, written by
bench/fixture/evaluate.py; its first FIXTURE_TOKENS tokens, with their token ids). For each
trace, decode at batch 1 and 8, and each pool size (a share of all moe_layers x E experts), the
same run replays the trace through LRU, LFU, decayed frequency, the serving policy (decayed
frequency plus the fetch of the experts a step's tokens are predicted to route: traces with
tokens only), Belady's MIN and Belady for replay steps, MIN with prefetch on replay steps, on the
synthetic traces the oracle told the generator's hidden state (with and without prefetch on
replay steps: bench/probes/residency_variants.py), and computes the lower bounds (simulate.py explains
them all). Every policy starts from the same warm
pool, the experts most routed in the first quarter of the steps (the hot set a server would have
persisted from past traffic; the whole trace's hottest would tell every policy, Belady most, what
the measured steps route), and that first quarter, which lets the online policies' scores
settle, is not counted. Pools
smaller than 1.15x the largest step (the boot floor's margin) are skipped. Target: the serving
policy's replay % within 1.5x of Belady's.

Writes bench/results/residency/cpu-<date>.json (through the recipe: a run under
bench/results/residency-policy/) and prints the results table. `render` (that table, inside
docs/residency.md) and `svg` (docs/residency-replay.svg: replay % vs pool size per policy, and the
traces' coverage curves) make the page's parts from a result alone (numpy only: no vLLM, no
model); `nox -s report` writes them from the newest committed run of the recipe (bench/report.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

if __name__ == "__main__":  # the simulator's workers: one BLAS thread each (not when imported)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_TRACE = ROOT / "bench" / "out" / "fixture" / "traces" / "test.npy"
FIXTURE_TOKENS_FILE = ROOT / "bench" / "out" / "fixture" / "corpus" / "test.npy"
FIXTURE_TOKENS = 16384
FIXTURE = "fixture"
TARGET = 1.5
# pool sizes (share of all experts) where the curves move: with the warm start, DeepSeek-V4-Flash
# replays nothing from 40% on (the trace routes fewer distinct experts); GLM-5.2 needs ~95%; the
# fixture (3 MoE layers x 64 experts, routing spread almost evenly) needs ~95% too
FRACTIONS = {
    "deepseek-v4-flash": [0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4],
    "glm-5.2": [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98],
    FIXTURE: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95],
}
BATCHES = [1, 8]
HALF_LIVES = [8.0, 32.0, 128.0, 512.0, 2048.0, math.inf]
PREDICT_THRESHOLDS = [0.05, 0.1, 0.2, 0.3]
SEED = 0
# the demand-only policies, then the others
DEMAND = ("lru", "lfu", "decay", "min", "belady")

_TRACES: dict[str, dict] = {}  # filled before the worker pool forks


def load_fixture(tokens: int) -> dict | None:
    """The fixture's routing trace of its test split and the input token of each row (row t
    routes token t of the split), or None when the trace has not been built."""
    import moet.models
    from moet_vllm.planning import traces

    if not FIXTURE_TRACE.exists() or not FIXTURE_TOKENS_FILE.exists():
        return None
    ids, meta = traces.load_trace(FIXTURE_TRACE)
    toks = np.load(FIXTURE_TOKENS_FILE)
    if len(toks) < len(ids):
        sys.exit(f"{FIXTURE_TOKENS_FILE} has {len(toks)} tokens, the trace {len(ids)} rows")
    ids, toks = ids[:tokens], toks[:tokens].astype(np.int64)
    cfg = json.loads((moet.models.fixture() / "config.json").read_text())
    weights = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
    return {
        "ids": ids,
        "tokens": toks,
        "E": meta["E"],
        "layers": ids.shape[1],
        "top_k": meta["top_k"],
        "slot_bytes": weights // 4 + weights // 32,  # the W2 row, as TraceProfile.slot_bytes
        "meta": meta,
        "sha1": hashlib.sha1(ids.tobytes()).hexdigest(),
    }


def token_predictability(ids: np.ndarray, tokens: np.ndarray, n_experts: int) -> dict:
    """Per MoE layer, over the last three quarters of the tokens: the share of a token's routed
    experts among the top-k experts that its token id routed most often before (counted from the
    first token on), and among the previous token's experts."""
    T, L, k = ids.shape
    ids = ids.astype(np.int64)
    counts = np.zeros((int(tokens.max()) + 1, L, n_experts))
    layer = np.repeat(np.arange(L), k)
    same = np.zeros(L)
    prev = np.zeros(L)
    for t in range(T):
        x = int(tokens[t])
        if t >= T // 4:
            guess = np.argsort(-counts[x], axis=1, kind="stable")[:, :k]
            same += (guess[:, :, None] == ids[t][:, None, :]).any(axis=2).sum(axis=1)
            prev += (ids[t - 1][:, :, None] == ids[t][:, None, :]).any(axis=2).sum(axis=1)
        np.add.at(counts[x], (layer, ids[t].ravel()), 1)
    n = (T - T // 4) * k
    return {"same_token_id": (same / n).tolist(), "previous_token": (prev / n).tolist()}


def job(args: tuple) -> dict:
    from moet_vllm.planning import simulate as sim

    name, batch, frac, extra = args
    tr = _TRACES[name]
    E, L = tr["E"], tr["layers"]
    steps = sim.decode_steps(tr["ids"], E, batch)
    warm = len(steps) // 4
    n_slots = int(round(frac * L * E))
    row = {"trace": name, "batch": batch, "pool_fraction": frac, "n_slots": n_slots}
    widest = max(len(u) for u in sim.unique_steps(steps))
    if n_slots < 1.15 * widest:
        row["skipped"] = f"pool below 1.15 x the widest step ({widest} pairs)"
        return row
    t0 = time.perf_counter()
    # the persisted hot set of a warm start, from the past only: the warm-up quarter (the hottest
    # keys of the whole trace would tell every policy, and Belady most, what the future routes)
    init = sim.hottest(steps[:warm], n_slots)
    kw = {"warmup": warm, "initial": init, "slot_bytes": tr["slot_bytes"]}
    toks = sim.step_tokens(tr["ids"], tr["tokens"], E, batch) if tr["tokens"] is not None else None

    def run(name_, **knobs):
        return sim.run_policy(name_, steps, n_slots, L, E, **kw, **knobs).as_dict()

    if extra:  # --tune: the half-life sweep and the variants tried, next to the offline policies
        from probes import residency_variants as variants

        row["half_life"] = {str(h): run("decay", half_life_steps=h) for h in HALF_LIVES}
        for name_ in sim.OFFLINE:
            row[name_] = run(name_)
        row["variants"] = variants.run_all(name, tr, steps, n_slots, kw, batch)
        if toks is not None:
            row["predict_threshold"] = {
                str(th): run("predict", tokens=toks[0], token_keys=toks[1], predict_threshold=th)
                for th in PREDICT_THRESHOLDS
            }
        row["wall_s"] = time.perf_counter() - t0
        return row
    for name_ in DEMAND:
        row[name_] = run(name_)
    row["min+pf"] = run("min+pf", prefetch=sim.DEFAULT_PREFETCH)
    if toks is not None:
        row["predict"] = run("predict", tokens=toks[0], token_keys=toks[1])
    else:  # a synthetic trace: the policy that learned its routing perfectly, for reference
        from probes import residency_variants as variants

        row.update(variants.oracles(name, tr, steps, n_slots, kw, batch))
    n = len(steps) - warm
    lb = sim.replay_lower_bound(
        steps, n_slots, warmup=warm, upper=n - row["belady"]["replay_steps"]
    )
    row["lower_bound"] = {"replay_steps": lb, "replay_pct": 100.0 * lb / n}
    pb = sim.prefetch_lower_bound(steps, n_slots, warmup=warm)
    row["prefetch_bound"] = {"replay_steps": pb, "replay_pct": 100.0 * pb / n}
    row["serving"] = "predict" if "predict" in row else "decay"
    bel = row["belady"]["replay_pct"]
    row["serving_vs_belady"] = ratio(row[row["serving"]]["replay_pct"], bel)
    row["decay_vs_belady"] = ratio(row["decay"]["replay_pct"], bel)
    row["decay_vs_min"] = ratio(row["decay"]["replay_pct"], row["min"]["replay_pct"])
    row["wall_s"] = time.perf_counter() - t0
    return row


def bound_job(args: tuple) -> dict:
    """The online bound of a synthetic trace at one batch, for all its pools at once."""
    from moet_vllm.planning import simulate as sim
    from moet_vllm.planning import traces

    name, batch = args
    tr = _TRACES[name]
    prof = traces.PROFILES[name]
    t0 = time.perf_counter()
    state = traces.synthetic_state(prof, len(tr["ids"]), SEED)
    n = len(tr["ids"]) // batch
    warm = n // 4
    tok = (np.arange(n)[:, None] + np.arange(batch)[None, :] * n)[warm:]
    pools = [int(round(f * prof.moe_layers * prof.n_experts)) for f in FRACTIONS[name]]
    exp = sim.online_clean_bound(state.weights, tok, prof.top_k, pools)
    return {
        "trace": name,
        "batch": batch,
        "pct": {str(f): 100.0 * e / (n - warm) for f, e in zip(FRACTIONS[name], exp)},
        "wall_s": time.perf_counter() - t0,
    }


def ratio(a: float, b: float) -> float | None:
    if b > 0:
        return a / b
    return None if a > 0 else 1.0  # 0 / 0: both replay-free


def summarize(rows: list[dict]) -> dict:
    """The target over the pools where a policy can differ (0 < Belady's replay % < 100), and
    over the pools one would size for (Belady's replay % <= 50), per trace and in all."""
    measured = [r for r in rows if "decay" in r]
    out = {"target": f"serving replay % <= {TARGET} x Belady's at the same pool"}
    for trace in [None, *_TRACES]:
        sel_t = [r for r in measured if trace is None or r["trace"] == trace]
        moving = [r for r in sel_t if 0 < r["belady"]["replay_pct"] < 100]
        sized = [r for r in moving if r["belady"]["replay_pct"] <= 50]
        res = {}
        for tag, sel in (("moving", moving), ("sized", sized)):
            ratios = [r["serving_vs_belady"] for r in sel]
            res[tag] = {
                "pools": len(sel),
                "within_target": sum(1 for x in ratios if x is not None and x <= TARGET),
                "geomean_serving_vs_belady": geomean(ratios),
                "worst_serving_vs_belady": max((x for x in ratios if x), default=None),
                "geomean_decay_vs_belady": geomean(r["decay_vs_belady"] for r in sel),
                "geomean_decay_vs_min": geomean(r["decay_vs_min"] for r in sel),
            }
        out[trace or "all"] = res
    return out


def geomean(xs) -> float | None:
    xs = [x for x in xs if x]
    return float(np.exp(np.mean(np.log(xs)))) if xs else None


# -- outputs --------------------------------------------------------------------------------------


def fmt_ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def online_bounds(result: dict) -> dict:
    """(trace, batch) -> {pool fraction: the online bound's replay %} of a result."""
    return {(b["trace"], b["batch"]): b["pct"] for b in result["online_bounds"]}


def render(result: dict) -> str:
    """The results table of docs/residency.md (between its markers) from a result of this bench."""
    info, policy = result["traces"], result["policy"]
    # a synthetic trace records its profile
    synthetic = [d for d in info.values() if "profile" in d]
    fixture_note = (
        f", fixture: the first {info[FIXTURE]['tokens']} tokens of its test split"
        if FIXTURE in info
        else ", no fixture trace"
    )
    head = (
        f"Measured {result['date'][:10]} (commit {result['commit']}, "
        f"{synthetic[0]['tokens']} tokens per synthetic trace, seed {synthetic[0]['seed']}"
        f"{fixture_note}; half-life {policy['half_life_steps']:g} steps, predict threshold "
        f"{policy['predict_threshold']:g}, MIN+pf {policy['prefetch_on_replay (min+pf)']} rows per "
        "replay step; bench/results/residency-policy/):\n"
    )
    return head + table(result["rows"], online_bounds(result), info) + coverage_table(info)


def table(rows: list[dict], bounds: dict, info: dict) -> str:
    out = []
    for name in info:
        for batch in BATCHES:
            sel = [r for r in rows if r["trace"] == name and r["batch"] == batch and "decay" in r]
            if not sel:
                continue
            tokens = "predict" in sel[0]
            synthetic = "profile" in info[name]
            out.append(
                f"\n**{name}, batch {batch}** — replay % of steps (missing pairs per step; "
                + ("for predict and " if tokens else "for ")
                + "MIN+pf: rows fetched per step)\n"
            )
            head = ["pool", "LRU", "LFU", "decay"]
            head += ["predict", "early fetch"] if tokens else []
            head += ["MIN", "Belady", "bound", "MIN+pf", "pf bound"]
            head += ["oracle", "oracle+pf", "online bound"] if synthetic else []
            head += ["serving / Belady", "decay / MIN"]
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "---|" * len(head))
            for r in sel:
                cells = [f"{100 * r['pool_fraction']:.0f}%"]
                for p in ("lru", "lfu", "decay"):
                    cells.append(f"{r[p]['replay_pct']:.1f} ({r[p]['missing_per_step']:.2f})")
                if tokens:
                    p = r["predict"]
                    cells.append(f"{p['replay_pct']:.1f} ({p['rows_per_step']:.2f})")
                    cells.append(f"{p['early_fetch_pct']:.0f}%")
                for p in ("min", "belady"):
                    cells.append(f"{r[p]['replay_pct']:.1f} ({r[p]['missing_per_step']:.2f})")
                cells.append(f"{r['lower_bound']['replay_pct']:.1f}")
                p = r["min+pf"]
                cells.append(f"{p['replay_pct']:.1f} ({p['rows_per_step']:.2f})")
                cells.append(f"{r['prefetch_bound']['replay_pct']:.1f}")
                if synthetic:
                    for p in ("oracle", "oracle+pf"):
                        cells.append(f"{r[p]['replay_pct']:.1f}")
                    b = bounds.get((name, batch), {}).get(str(r["pool_fraction"]))
                    cells.append("—" if b is None else f"{b:.1f}")
                cells.append(fmt_ratio(r["serving_vs_belady"]))
                cells.append(fmt_ratio(r["decay_vs_min"]))
                out.append("| " + " | ".join(cells) + " |")
            skipped = [
                r for r in rows if r["trace"] == name and r["batch"] == batch and "skipped" in r
            ]
            if skipped:
                pools = ", ".join(f"{100 * r['pool_fraction']:.0f}%" for r in skipped)
                out.append(f"\nSkipped (below 1.15x the widest step): {pools}.")
    return "\n".join(out) + "\n"


def coverage_table(info: dict) -> str:
    xs = ["0.05", "0.1", "0.19", "0.3", "0.51", "0.7", "0.9"]
    out = [
        "\nCoverage: share of routings served by the hottest share of all (MoE layer, expert) "
        "pairs of the trace (ranked across layers; published points: 19% -> 96% for "
        "DeepSeek-V4-Flash, 51% -> 91% for GLM-5.2)\n",
        "| trace | tokens | " + " | ".join(f"{float(x):.0%}" for x in xs) + " |",
        "|" + "---|" * (len(xs) + 2),
    ]
    for name, d in info.items():
        cov = d["coverage"]
        out.append(
            f"| {name} | {d['tokens']} | " + " | ".join(f"{100 * cov[x]:.1f}%" for x in xs) + " |"
        )
    return "\n".join(out) + "\n"


COLORS = {
    "lru": "#1f77b4",
    "lfu": "#ff7f0e",
    "decay": "#d62728",
    "predict": "#9467bd",
    "min": "#7f7f7f",
    "belady": "#2ca02c",
    "bound": "#000000",
    "min+pf": "#17becf",
    "online": "#8c564b",
}
LABELS = {
    "lru": "LRU",
    "lfu": "LFU",
    "decay": "decay",
    "predict": "predict (serving)",
    "min": "MIN",
    "belady": "Belady",
    "bound": "lower bound",
    "min+pf": "MIN+pf",
    "online": "online bound",
}
DASHED = ("bound", "min", "min+pf", "online")


def svg(result: dict) -> str:
    """Replay % vs pool size per policy, one panel per (trace, batch), and the coverage curves, of
    a result of this bench. Hand-made SVG."""
    rows, bounds, info = result["rows"], online_bounds(result), result["traces"]
    pw, ph, ml, mt, gap = 300, 210, 50, 30, 40
    panels = [(n, b) for n in info for b in BATCHES] + [("coverage", 0)]
    cols = 2
    w = ml + cols * (pw + gap)
    h = mt + ((len(panels) + cols - 1) // cols) * (ph + 70) + 60
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
    ]

    def frame(x0, y0, title, xmax, xlabel, ylabel):
        parts.append(
            f'<text x="{x0 + pw / 2}" y="{y0 - 10}" text-anchor="middle" font-size="12">{title}</text>'
        )
        parts.append(
            f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>'
        )
        for v in range(0, 101, 20):
            yy = y0 + ph - ph * v / 100
            parts.append(f'<line x1="{x0}" y1="{yy}" x2="{x0 + pw}" y2="{yy}" stroke="#ddd"/>')
            parts.append(f'<text x="{x0 - 5}" y="{yy + 4}" text-anchor="end">{v}</text>')
        for v in range(0, xmax + 1, xmax // 5):
            xx = x0 + pw * v / xmax
            parts.append(f'<line x1="{xx}" y1="{y0}" x2="{xx}" y2="{y0 + ph}" stroke="#eee"/>')
            parts.append(f'<text x="{xx}" y="{y0 + ph + 14}" text-anchor="middle">{v}</text>')
        parts.append(
            f'<text x="{x0 + pw / 2}" y="{y0 + ph + 30}" text-anchor="middle">{xlabel}</text>'
        )
        parts.append(
            f'<text x="{x0 - 35}" y="{y0 + ph / 2}" text-anchor="middle" '
            f'transform="rotate(-90 {x0 - 35} {y0 + ph / 2})">{ylabel}</text>'
        )

    def line(pts, color, width=1.5, dash=False):
        d = ' stroke-dasharray="4 3"' if dash else ""
        parts.append(
            f'<polyline points="{" ".join(pts)}" fill="none" stroke="{color}" '
            f'stroke-width="{width}"{d}/>'
        )

    for i, (name, batch) in enumerate(panels):
        x0 = ml + (i % cols) * (pw + gap)
        y0 = mt + (i // cols) * (ph + 70)
        if name == "coverage":
            frame(x0, y0, "coverage curves", 100, "hottest experts, %", "routings served, %")
            for j, (tname, d) in enumerate(info.items()):
                curve = d["curve"]
                pts = [
                    f"{x0 + pw * k / (len(curve) - 1):.1f},{y0 + ph - ph * c:.1f}"
                    for k, c in enumerate(curve)
                ]
                color = ["#d62728", "#1f77b4", "#2ca02c"][j % 3]
                line(pts, color, 2)
                parts.append(
                    f'<text x="{x0 + pw - 5}" y="{y0 + ph - 10 - 14 * j}" text-anchor="end" '
                    f'fill="{color}">{tname}</text>'
                )
            for d in info.values():  # the published points of the synthetic traces
                if "target" in d:
                    px_, py_ = d["target"]
                    parts.append(
                        f'<circle cx="{x0 + pw * px_:.1f}" cy="{y0 + ph - ph * py_:.1f}" r="3" '
                        'fill="black"/>'
                    )
            continue
        sel = [r for r in rows if r["trace"] == name and r["batch"] == batch and "decay" in r]
        xmax = 50 if max(FRACTIONS[name]) <= 0.5 else 100  # pool % at the right edge
        frame(x0, y0, f"{name}, batch {batch}", xmax, "pool, % of all experts", "replay % of steps")
        for key in COLORS:
            pts = []
            for r in sel:
                if key == "bound":
                    y = r["lower_bound"]["replay_pct"]
                elif key == "online":
                    y = bounds.get((name, batch), {}).get(str(r["pool_fraction"]))
                else:
                    y = r[key]["replay_pct"] if key in r else None
                if y is None:
                    continue
                xx = x0 + pw * 100 * r["pool_fraction"] / xmax
                pts.append(f"{xx:.1f},{y0 + ph - ph * y / 100:.1f}")
            if pts:
                line(pts, COLORS[key], 2.5 if key in ("decay", "predict") else 1.5, key in DASHED)
    ly = h - 35
    for j, key in enumerate(COLORS):
        lx = ml + (j % 5) * 130
        yy = ly + (j // 5) * 18
        d = ' stroke-dasharray="4 3"' if key in DASHED else ""
        parts.append(
            f'<line x1="{lx}" y1="{yy}" x2="{lx + 20}" y2="{yy}" stroke="{COLORS[key]}" stroke-width="2"{d}/>'
        )
        parts.append(f'<text x="{lx + 24}" y="{yy + 4}">{LABELS[key]}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    except OSError:
        return "unknown"


def tune_summary(tune_rows: list[dict]) -> dict:
    """Geometric means of each tried variant's replay % over Belady's (the pools where Belady's is
    strictly between 0 and 100, and the sized ones, Belady <= 50%), and of its missing pairs
    over MIN's."""
    rs = [r for r in tune_rows if "belady" in r and 0 < r["belady"]["replay_pct"] < 100]
    series: dict[str, list] = {}
    for r in rs:
        cands = {f"decay h={h}": v for h, v in r["half_life"].items()}
        cands |= {k: v for k, v in r["variants"].items()}
        cands |= {f"predict {t}": v for t, v in r.get("predict_threshold", {}).items()}
        for k, v in cands.items():
            series.setdefault(k, []).append((r, v))
    out = {}
    for k, pairs in series.items():
        vs = [ratio(v["replay_pct"], r["belady"]["replay_pct"]) for r, v in pairs]
        sized = [x for x, (r, _) in zip(vs, pairs) if r["belady"]["replay_pct"] <= 50]
        rows_ = [
            ratio(v["rows_per_step"], r["min"]["missing_per_step"])
            for r, v in pairs
            if r["min"]["missing_per_step"] > 0
        ]
        out[k] = {
            "pools": len(pairs),
            "traces": sorted({r["trace"] for r, _ in pairs}),
            "geomean_vs_belady": geomean(vs),
            "geomean_vs_belady_sized": geomean(sized),
            "sized_pools": len(sized),
            "within_target_sized": sum(1 for x in sized if x is not None and x <= TARGET),
            "geomean_rows_vs_min": geomean(rows_),
        }
    return out


def main() -> None:
    from results_io import write_result

    from moet_vllm import __version__
    from moet_vllm.planning import simulate as sim
    from moet_vllm.planning import traces
    from moet_vllm.residency import policy as pol

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tokens",
        type=int,
        default=8192,
        help="tokens per synthetic trace (the profiles are calibrated at 8192)",
    )
    ap.add_argument("--fixture-tokens", type=int, default=FIXTURE_TOKENS)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument(
        "--tune", action="store_true", help="also the half-life sweep and the variants (slow)"
    )
    args = ap.parse_args()
    t0 = time.perf_counter()

    xs = [0.05, 0.1, 0.19, 0.3, 0.51, 0.7, 0.9]
    info = {}
    for name, prof in traces.PROFILES.items():
        tg = time.perf_counter()
        ids = traces.synthetic_trace(prof, args.tokens, SEED)
        _TRACES[name] = {
            "ids": ids,
            "tokens": None,
            "E": prof.n_experts,
            "layers": prof.moe_layers,
            "top_k": prof.top_k,
            "slot_bytes": prof.slot_bytes,
        }
        info[name] = {
            "profile": {k: v for k, v in prof.__dict__.items()},
            "slot_bytes": prof.slot_bytes,
            "tokens": args.tokens,
            "seed": SEED,
            "target": list(prof.target),
            "gen_s": time.perf_counter() - tg,
        }
    fx = load_fixture(args.fixture_tokens)
    if fx is None:
        print(
            f"no fixture trace ({FIXTURE_TRACE.relative_to(ROOT)}): build it with `python "
            "bench/fixture/evaluate.py` (its corpus first: `nox -s fixture`, or corpus.py and "
            "tokenizer.py); skipping the fixture"
        )
    else:
        _TRACES[FIXTURE] = fx
        info[FIXTURE] = {
            "model": fx["meta"]["model"],
            "source": fx["meta"]["source"],
            "trace_rows": int(fx["meta"].get("tokens", 0)),
            "tokens": len(fx["ids"]),
            "sha1_of_rows_used": fx["sha1"],
            "slot_bytes": fx["slot_bytes"],
            "moe_layers": fx["layers"],
            "E": fx["E"],
            "top_k": fx["top_k"],
            "token_predictability": token_predictability(fx["ids"], fx["tokens"], fx["E"]),
        }
        print(f"fixture: {info[FIXTURE]['token_predictability']}")
    for name, tr in _TRACES.items():
        ids, E = tr["ids"], tr["E"]
        info[name]["coverage"] = {str(x): float(c) for x, c in zip(xs, traces.coverage(ids, E, xs))}
        grid = np.linspace(0, 1, 51)
        info[name]["curve"] = [round(float(c), 5) for c in traces.coverage(ids, E, grid)]
        info[name]["adjacent_overlap"] = traces.adjacent_overlap(ids)
        print(
            f"{name}: {len(ids)} tokens, the hottest 19% of experts serve "
            f"{info[name]['coverage']['0.19']:.1%} of routings, 51%: "
            f"{info[name]['coverage']['0.51']:.1%}"
        )

    grid = [(n, b, f) for n in _TRACES for b in BATCHES for f in FRACTIONS[n]]
    todo = [(n, b, f, False) for n, b, f in grid]
    # longest jobs first: GLM-5.2 batch 1 and the fixture at batch 1 dominate
    todo.sort(key=lambda j: (j[1] != 1, j[0] == "deepseek-v4-flash", -j[2]))
    bound_todo = [(n, b) for n in traces.PROFILES for b in BATCHES]
    ctx = mp.get_context("fork")
    with ctx.Pool(args.jobs) as workers:
        pending_bounds = workers.map_async(bound_job, bound_todo, chunksize=1)
        rows = workers.map(job, todo, chunksize=1)
        bound_rows = pending_bounds.get()
        tune_rows = None
        if args.tune:  # where a policy can differ: 0 < Belady's replay % < 100
            moving = {
                (r["trace"], r["batch"], r["pool_fraction"])
                for r in rows
                if "belady" in r and 0 < r["belady"]["replay_pct"] < 100
            }
            tune = [(n, b, f, True) for n, b, f, _ in todo if (n, b, f) in moving]
            tune_rows = workers.map(job, tune, chunksize=1)
    order = {key: i for i, key in enumerate(grid)}
    rows.sort(key=lambda r: order[(r["trace"], r["batch"], r["pool_fraction"])])
    bounds = {(b["trace"], b["batch"]): b["pct"] for b in bound_rows}
    for r in rows:
        b = bounds.get((r["trace"], r["batch"]), {}).get(str(r["pool_fraction"]))
        if b is not None and "decay" in r:
            r["online_bound"] = {"replay_pct": b}

    summary = summarize(rows)
    result = {
        "bench": "residency",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "jobs": args.jobs,
        "commit": git_commit(),
        "moet_vllm": __version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "policy": {
            "half_life_steps": pol.DEFAULT_HALF_LIFE_STEPS,
            "protected_fraction": pol.DEFAULT_PROTECTED_FRACTION,
            "predict_threshold": pol.DEFAULT_PREDICT_THRESHOLD,
            "prefetch_on_replay (min+pf)": sim.DEFAULT_PREFETCH,
        },
        "protocol": "warm start: every policy preloads the experts most routed in the first "
        "quarter of the steps (the past); that first quarter of the steps is not counted; batch B cuts the trace into B "
        "concurrent sequences; serving = predict where the trace has tokens (the fixture), "
        "else decay (prediction needs tokens)",
        "traces": info,
        "summary": summary,
        "online_bounds": bound_rows,
        "rows": rows,
    }
    if tune_rows is not None:
        tune_rows.sort(key=lambda r: order[(r["trace"], r["batch"], r["pool_fraction"])])
        sweep = tune_summary(tune_rows)
        result["tune"] = {"summary": sweep, "rows": tune_rows}
        for k, s in sweep.items():
            print(
                f"{k:>22}: replay vs Belady {s['geomean_vs_belady']:.3f}x over {s['pools']} pools "
                f"({s['geomean_vs_belady_sized'] or 0:.3f}x over {s['sized_pools']} sized, "
                f"{s['within_target_sized']} within {TARGET}x), rows fetched vs MIN's missing "
                f"pairs {s['geomean_rows_vs_min'] or 0:.3f}x; traces {','.join(s['traces'])}"
            )
    result["wall_s"] = time.perf_counter() - t0
    # the table from the result as written, as `nox -s report` renders it into the page
    print(render(json.loads(write_result("residency", result).read_text())))
    for k, v in summary.items():
        print(f"summary {k}: {v}")
    print(f"wall {result['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
