"""The expert-pool cache policy vs Belady, on synthetic routing traces (issue 7's simulator).

Run through nox: `nox -s "bench(residency)"` (`-- --tune` adds the decay half-life sweep). For
each synthetic trace (DeepSeek-V4-Flash- and GLM-5.2-shaped, moet_vllm.residency.traces, seed 0),
decode at batch 1 and 8, and each pool size (a share of all moe_layers x E experts), the same run
replays the trace through LRU, LFU, decayed frequency (the serving ResidencyPolicy), Belady's MIN
and Belady for replay steps, and computes the lower bound on replay steps (simulate.py explains
the three offline figures). Every policy starts from the same warm pool, the experts most routed
over the whole trace (the hot set a long run would have persisted: without it, experts first seen
in the measured steps miss under every policy alike), and the first quarter of the steps, which
lets the online policies' scores settle, is not counted. Pools smaller than 1.15x the
largest step (the boot floor's margin) are skipped. Target: the serving policy's replay % within
1.5x of Belady's.

Writes bench/results/residency/cpu-<date>.json, docs/residency-replay.svg (replay % vs pool size
per policy) and the results table inside docs/residency.md.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"

import numpy as np  # noqa: E402
from results_io import write_result  # noqa: E402

from moet_vllm import __version__  # noqa: E402
from moet_vllm.residency import policy as pol  # noqa: E402
from moet_vllm.residency import simulate as sim  # noqa: E402
from moet_vllm.residency import traces  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "residency.md"
SVG = ROOT / "docs" / "residency-replay.svg"
TARGET = 1.5
# pool sizes (share of all experts) where the curves move: with the warm start, DeepSeek-V4-Flash
# replays nothing from 40% on (the trace routes fewer distinct experts); GLM-5.2 needs ~95%
FRACTIONS = {
    "deepseek-v4-flash": [0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4],
    "glm-5.2": [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98],
}
BATCHES = [1, 8]
HALF_LIVES = [8.0, 32.0, 128.0, 512.0, 2048.0, math.inf]
SEED = 0
BEGIN, END = "<!-- bench:residency begin -->", "<!-- bench:residency end -->"

_TRACES: dict[str, np.ndarray] = {}  # filled before the worker pool forks


def job(args: tuple) -> dict:
    name, batch, frac, tokens, half_lives = args
    prof = traces.PROFILES[name]
    steps = sim.decode_steps(_TRACES[name], prof.n_experts, batch)
    warm = len(steps) // 4
    n_keys = prof.moe_layers * prof.n_experts
    n_slots = int(round(frac * n_keys))
    row = {"trace": name, "batch": batch, "pool_fraction": frac, "n_slots": n_slots}
    widest = max(len(u) for u in sim.unique_steps(steps))
    if n_slots < 1.15 * widest:
        row["skipped"] = f"pool below 1.15 x the widest step ({widest} pairs)"
        return row
    t0 = time.perf_counter()
    init = sim.hottest(steps, n_slots)  # the hot set a long run would have persisted
    kw = {"warmup": warm, "initial": init, "slot_bytes": prof.slot_bytes}
    if half_lives:  # the tuning sweep: the serving policy alone, one run per half-life
        row["half_life"] = {}
        for h in half_lives:
            r = sim.run_policy(
                "decay", steps, n_slots, prof.moe_layers, prof.n_experts, **kw, half_life_steps=h
            )
            row["half_life"][str(h)] = r.as_dict()
        for name_ in sim.OFFLINE:
            r = sim.run_policy(name_, steps, n_slots, prof.moe_layers, prof.n_experts, **kw)
            row[name_] = r.as_dict()
        row["wall_s"] = time.perf_counter() - t0
        return row
    for name_ in sim.POLICIES:
        r = sim.run_policy(name_, steps, n_slots, prof.moe_layers, prof.n_experts, **kw)
        row[name_] = r.as_dict()
    n = len(steps) - warm
    lb = sim.replay_lower_bound(
        steps, n_slots, warmup=warm, upper=n - row["belady"]["replay_steps"]
    )
    row["lower_bound"] = {"replay_steps": lb, "replay_pct": 100.0 * lb / n}
    row["decay_vs_belady"] = ratio(row["decay"]["replay_pct"], row["belady"]["replay_pct"])
    row["decay_vs_min"] = ratio(row["decay"]["replay_pct"], row["min"]["replay_pct"])
    row["wall_s"] = time.perf_counter() - t0
    return row


def ratio(a: float, b: float) -> float | None:
    if b > 0:
        return a / b
    return None if a > 0 else 1.0  # 0 / 0: both replay-free


def summarize(rows: list[dict]) -> dict:
    """The target over the pools where a policy can differ (0 < Belady's replay % < 100), and
    over the pools one would size for (Belady's replay % <= 50)."""
    measured = [r for r in rows if "decay" in r]
    moving = [r for r in measured if 0 < r["belady"]["replay_pct"] < 100]
    sized = [r for r in moving if r["belady"]["replay_pct"] <= 50]
    out = {"target": f"decay replay % <= {TARGET} x Belady's at the same pool"}
    for tag, sel in (("moving", moving), ("sized", sized)):
        ratios = [r["decay_vs_belady"] for r in sel]
        out[tag] = {
            "pools": len(sel),
            "within_target": sum(1 for x in ratios if x is not None and x <= TARGET),
            "geomean_decay_vs_belady": geomean(ratios),
            "worst_decay_vs_belady": max((x for x in ratios if x), default=None),
            "geomean_decay_vs_min": geomean(r["decay_vs_min"] for r in sel),
        }
    return out


def geomean(xs) -> float | None:
    xs = [x for x in xs if x]
    return float(np.exp(np.mean(np.log(xs)))) if xs else None


# -- outputs --------------------------------------------------------------------------------------


def fmt_ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def table(rows: list[dict]) -> str:
    out = []
    for name in traces.PROFILES:
        for batch in BATCHES:
            sel = [r for r in rows if r["trace"] == name and r["batch"] == batch and "decay" in r]
            if not sel:
                continue
            out.append(
                f"\n**{name}, batch {batch}** — replay % of steps (missing pairs per step)\n"
            )
            out.append(
                "| pool | LRU | LFU | decay | MIN | Belady | bound | decay / Belady | decay / MIN |"
            )
            out.append("|---|---|---|---|---|---|---|---|---|")
            for r in sel:
                cells = [f"{100 * r['pool_fraction']:.0f}%"]
                for p in sim.POLICIES:
                    cells.append(f"{r[p]['replay_pct']:.1f} ({r[p]['missing_per_step']:.2f})")
                cells.append(f"{r['lower_bound']['replay_pct']:.1f}")
                cells.append(fmt_ratio(r["decay_vs_belady"]))
                cells.append(fmt_ratio(r["decay_vs_min"]))
                out.append("| " + " | ".join(cells) + " |")
            skipped = [
                r for r in rows if r["trace"] == name and r["batch"] == batch and "skipped" in r
            ]
            if skipped:
                pools = ", ".join(f"{100 * r['pool_fraction']:.0f}%" for r in skipped)
                out.append(f"\nSkipped (below 1.15x the widest step): {pools}.")
    return "\n".join(out) + "\n"


COLORS = {
    "lru": "#1f77b4",
    "lfu": "#ff7f0e",
    "decay": "#d62728",
    "min": "#7f7f7f",
    "belady": "#2ca02c",
    "bound": "#000000",
}


def svg(rows: list[dict]) -> str:
    """Replay % vs pool size per policy: one panel per (trace, batch). Hand-made SVG."""
    pw, ph, ml, mt, gap = 300, 210, 50, 30, 40
    panels = [(n, b) for n in traces.PROFILES for b in BATCHES]
    cols = 2
    w = ml + cols * (pw + gap)
    h = mt + ((len(panels) + cols - 1) // cols) * (ph + 70) + 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
    ]
    for i, (name, batch) in enumerate(panels):
        x0 = ml + (i % cols) * (pw + gap)
        y0 = mt + (i // cols) * (ph + 70)
        parts.append(
            f'<text x="{x0 + pw / 2}" y="{y0 - 10}" text-anchor="middle" font-size="12">{name}, batch {batch}</text>'
        )
        parts.append(
            f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>'
        )
        xmax = 50 if max(FRACTIONS[name]) <= 0.5 else 100  # pool % at the right edge
        for v in range(0, 101, 20):
            yy = y0 + ph - ph * v / 100
            parts.append(f'<line x1="{x0}" y1="{yy}" x2="{x0 + pw}" y2="{yy}" stroke="#ddd"/>')
            parts.append(f'<text x="{x0 - 5}" y="{yy + 4}" text-anchor="end">{v}</text>')
        for v in range(0, xmax + 1, xmax // 5):
            xx = x0 + pw * v / xmax
            parts.append(f'<line x1="{xx}" y1="{y0}" x2="{xx}" y2="{y0 + ph}" stroke="#eee"/>')
            parts.append(f'<text x="{xx}" y="{y0 + ph + 14}" text-anchor="middle">{v}</text>')
        parts.append(
            f'<text x="{x0 + pw / 2}" y="{y0 + ph + 30}" text-anchor="middle">pool, % of all experts</text>'
        )
        parts.append(
            f'<text x="{x0 - 35}" y="{y0 + ph / 2}" text-anchor="middle" '
            f'transform="rotate(-90 {x0 - 35} {y0 + ph / 2})">replay % of steps</text>'
        )
        sel = [r for r in rows if r["trace"] == name and r["batch"] == batch and "decay" in r]
        for key in [*sim.POLICIES, "bound"]:
            pts = []
            for r in sel:
                y = r["lower_bound"]["replay_pct"] if key == "bound" else r[key]["replay_pct"]
                xx = x0 + pw * 100 * r["pool_fraction"] / xmax
                pts.append(f"{xx:.1f},{y0 + ph - ph * y / 100:.1f}")
            if not pts:
                continue
            dash = ' stroke-dasharray="4 3"' if key in ("bound", "min") else ""
            width = 2.5 if key == "decay" else 1.5
            parts.append(
                f'<polyline points="{" ".join(pts)}" fill="none" stroke="{COLORS[key]}" '
                f'stroke-width="{width}"{dash}/>'
            )
    ly = h - 20
    for j, key in enumerate([*sim.POLICIES, "bound"]):
        lx = ml + j * 95
        label = {"decay": "decay (serving)", "bound": "lower bound"}.get(
            key, key.upper() if key in ("lru", "lfu", "min") else "Belady"
        )
        dash = ' stroke-dasharray="4 3"' if key in ("bound", "min") else ""
        parts.append(
            f'<line x1="{lx}" y1="{ly}" x2="{lx + 20}" y2="{ly}" stroke="{COLORS[key]}" stroke-width="2"{dash}/>'
        )
        parts.append(f'<text x="{lx + 24}" y="{ly + 4}">{label}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_doc_table(text: str) -> None:
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        sys.exit(f"{DOC} lacks the {BEGIN} ... {END} markers")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(head + BEGIN + "\n" + text + END + tail)
    print(f"wrote the table into {DOC}")


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tokens",
        type=int,
        default=8192,
        help="tokens per trace (the profiles are calibrated at 8192)",
    )
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--tune", action="store_true", help="also sweep the decay half-life (slow)")
    ap.add_argument("--no-docs", action="store_true", help="write the JSON only")
    args = ap.parse_args()
    t0 = time.perf_counter()

    info = {}
    for name, prof in traces.PROFILES.items():
        tg = time.perf_counter()
        ids = traces.synthetic_trace(prof, args.tokens, SEED)
        _TRACES[name] = ids
        xs = [0.05, 0.1, prof.target[0], 0.3, 0.5, 0.7, 0.9]
        info[name] = {
            "profile": {k: v for k, v in prof.__dict__.items()},
            "slot_bytes": prof.slot_bytes,
            "tokens": args.tokens,
            "seed": SEED,
            "coverage": {
                f"{x:g}": float(c) for x, c in zip(xs, traces.coverage(ids, prof.n_experts, xs))
            },
            "target": list(prof.target),
            "adjacent_overlap": traces.adjacent_overlap(ids),
            "gen_s": time.perf_counter() - tg,
        }
        cov = info[name]["coverage"][f"{prof.target[0]:g}"]
        print(
            f"{name}: {args.tokens} tokens, the hottest {prof.target[0]:.0%} of experts serve {cov:.1%} of routings (target {prof.target[1]:.0%})"
        )

    grid = [(n, b, f) for n in traces.PROFILES for b in BATCHES for f in FRACTIONS[n]]
    todo = [(n, b, f, args.tokens, None) for n, b, f in grid]
    # longest jobs first: GLM-5.2 batch 1 dominates
    todo.sort(key=lambda j: (j[0] != "glm-5.2", j[1] != 1, -j[2]))
    ctx = mp.get_context("fork")
    with ctx.Pool(args.jobs) as workers:
        rows = workers.map(job, todo, chunksize=1)
        tune_rows = None
        if args.tune:
            tune = [(n, b, f, args.tokens, HALF_LIVES) for n, b, f, _, _ in todo]
            tune_rows = workers.map(job, tune, chunksize=1)
    order = {key: i for i, key in enumerate(grid)}
    rows.sort(key=lambda r: order[(r["trace"], r["batch"], r["pool_fraction"])])

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
        },
        "protocol": "warm start: every policy preloads the experts most routed over the whole "
        "trace; the first quarter of the steps is not counted; batch B cuts the trace into B "
        "concurrent sequences",
        "traces": info,
        "summary": summary,
        "rows": rows,
    }
    if tune_rows is not None:
        tune_rows.sort(key=lambda r: order[(r["trace"], r["batch"], r["pool_fraction"])])
        sweep = {}
        rs = [r for r in tune_rows if "half_life" in r and 0 < r["belady"]["replay_pct"] < 100]
        for h in HALF_LIVES:
            vs = [
                ratio(r["half_life"][str(h)]["replay_pct"], r["belady"]["replay_pct"]) for r in rs
            ]
            sized = [x for x, r in zip(vs, rs) if r["belady"]["replay_pct"] <= 50]
            pairs = [
                ratio(r["half_life"][str(h)]["missing_per_step"], r["min"]["missing_per_step"])
                for r in rs
            ]
            sweep[str(h)] = {
                "geomean_vs_belady": geomean(vs),
                "geomean_vs_belady_sized": geomean(sized),
                "worst_vs_belady_sized": max((x for x in sized if x), default=None),
                "geomean_pairs_vs_min": geomean(pairs),
            }
        result["half_life_sweep"] = {"summary": sweep, "rows": tune_rows}
        for h, s in sweep.items():
            print(
                f"half-life {h:>6}: replay vs Belady {s['geomean_vs_belady']:.3f}x "
                f"({s['geomean_vs_belady_sized']:.3f}x, worst {s['worst_vs_belady_sized']:.2f}x "
                f"where Belady <= 50%), missing pairs vs MIN {s['geomean_pairs_vs_min']:.3f}x"
            )
    result["wall_s"] = time.perf_counter() - t0
    write_result("residency", result)
    text = table(rows)
    print(text)
    print(f"summary: {summary}")
    if not args.no_docs:
        SVG.write_text(svg(rows))
        print(f"wrote {SVG}")
        write_doc_table(
            f"Measured {datetime.now(timezone.utc):%Y-%m-%d} (commit {result['commit']}, "
            f"{args.tokens} tokens per trace, seed {SEED}, half-life "
            f"{pol.DEFAULT_HALF_LIFE_STEPS:g} steps; bench/results/residency/):\n" + text
        )
    print(f"wall {result['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
