"""Tiered residency at the torch level: the serving ResidencyManager, a moet-store host tier and
moet-kernels' W2 MoE op in a captured CUDA graph, driven by a routing trace (issue 7).

    python bench/residency_gpu.py [--device cuda] [--layers 8] [--experts 256] [--hidden 6144]
        [--inter 2048] [--top-k 8] [--steps 384] [--coverages 1.0 0.9 0.8 ...] [--out DIR]
        [--host-tier ram|tiered|pagecache] [--arena-gib G] [--warm-start trace|past]
        [--trace glm-5.2|fixture] [--policies decay predict]

The model is a stack of MoE layers, x <- x + moe(rms_norm(x)), decoding one token per step; the
routing of step t, layer l is the trace's, its weights fixed random. The trace is synthetic
(GLM-5.2-shaped, moet_vllm.planning.traces, on the stack's geometry) or the fixture model's real
one (`--trace fixture`: bench/out/fixture, built by bench/fixture/evaluate.py; its 3 MoE layers x
64 experts, top-4, and the input token of each step, with --hidden/--inter's expert rows). One
forward pass is one CUDA graph (on the CPU: eager, the reference op).

Policies: `decay` fetches on demand; `predict` (fixture trace: it needs the tokens) also fetches,
before a step's forward, what its input token is predicted to route, learning from the routing
that the captured graph copies into the manager's `route_ids`.

- all-resident: every expert in the pool; a first such run, not reported, warms the process up
  and gives each step's reference output;
- per coverage c: a pool of c of the experts, the serving policy, the batched fetch from a
  moet-store host tier (`ram` by default; `tiered`: a pinned arena over the pack files), replays.
  Every step's output must be bit-identical to the all-resident run's; reported: replay % of
  steps, missing pairs per step, step time vs all-resident, fetch bandwidth vs a plain pinned H2D
  copy of the same rows measured in the same run, and the simulator's replay % for the same trace,
  pool, policy and warm start; once, the fetch's cost by batch size (`fetch_costs`).

The first quarter of the steps warms the policy and is not counted (as in bench/residency.py).
Writes <machine>-<date>.json to --out (default bench/results/residency_gpu/), with the run's
provenance (bench/provenance.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for pkg in ("moet-kernels", "moet-quant", "moet-vllm"):  # pure Python; moet-store is built
    sys.path.insert(0, str(ROOT / "packages" / pkg / "src"))

from kernels import build_cubin, random_scales  # noqa: E402  (bench/, the script's folder)
from provenance import machine, provenance  # noqa: E402
from residency import load_fixture  # noqa: E402  (bench/residency.py: the fixture's trace)
from results_io import write_result  # noqa: E402

import moet_store  # noqa: E402
from moet_kernels.layout import NativeRowLayout, RowLayout  # noqa: E402
from moet_kernels.ops import w2_moe_slots  # noqa: E402
from moet_vllm.planning import simulate, traces  # noqa: E402
from moet_vllm.residency.manager import ResidencyManager  # noqa: E402


def write_packs(directory: Path, lay: NativeRowLayout, n_layers, n_experts, seed, dev):
    """Random W2 experts, native rows, one pack layer at a time (made on `dev`: packing 2.7 GB
    layers on the host would take minutes). Scale bytes are shaped like trained weights'
    (bench/kernels.py `random_scales`): scales drawn independently per block would put most row
    tiles on the kernels' slow path, which trained weights almost never take."""
    spec = moet_store.PackSpec("w2", 0, 0, n_layers, n_experts, lay.row_bytes, {"bench": seed})
    logical = RowLayout(lay.hidden, lay.inter)
    gen = torch.Generator(device=dev).manual_seed(seed)

    def draw(name, shape):
        if "scales" in name:
            return random_scales(shape, "trained", gen, dev)
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen, device=dev)

    with moet_store.open_pack_for_write(directory, spec) as writer:
        for layer in range(n_layers):
            sections = {
                name: draw(name, (n_experts, *shape))
                for name, (_, shape) in logical.sections.items()
            }
            rows = lay.pack(**sections).cpu().numpy()
            if layer == 0:  # what the kernels' slow path will see (trained weights: ~0)
                slow = lay.slow_tile_fractions(rows[0])
            writer.write_layer(layer, rows)
            print(f"  pack layer {layer + 1}/{n_layers} written", flush=True)
    return spec, slow


class Stack:
    """The MoE stack over a manager's pool: static inputs, one forward pass (a graph on CUDA)."""

    def __init__(self, mgr: ResidencyManager, lay, n_layers, top_k, dev):
        self.mgr, self.lay, self.dev = mgr, lay, dev
        self.x = torch.zeros(1, lay.hidden, dtype=torch.bfloat16, device=dev)
        self.ids = torch.zeros(n_layers, 1, top_k, dtype=torch.int32, device=dev)
        self.w = torch.zeros(n_layers, 1, top_k, dtype=torch.float32, device=dev)
        self.n_real = torch.ones(1, dtype=torch.int32, device=dev)
        self.out = None
        self.graph = None

    def _forward(self):
        h = self.x
        for layer in range(self.ids.shape[0]):
            table, routed = self.mgr.layer_tables(layer, self.ids[layer].view(1, -1))
            normed = torch.nn.functional.rms_norm(h.float(), (h.shape[1],)).to(h.dtype)
            moe = w2_moe_slots(
                normed, self.ids[layer], self.w[layer], self.mgr.pool, table,
                self.lay.hidden, self.lay.inter, self.n_real, self.mgr.miss_count, routed,
            )  # fmt: skip
            h = h + moe
        return h

    def capture(self) -> None:
        """Warm up (allocates the op's buffers) and, on CUDA, capture the forward as a graph."""
        self._forward()
        if self.dev != "cuda":
            return
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._forward()

    def forward(self, eager: bool = False):
        if self.graph is None or eager:
            self.out = self._forward()
        else:
            self.graph.replay()
        return self.out

    def set_step(self, x, ids, w) -> None:
        self.x.copy_(x)
        self.ids.copy_(ids)
        self.w.copy_(w)


def run(mgr, stack, inputs, ids, weights, warmup, dev, tokens=None):
    """Decode every step through the manager (`tokens` int [steps]: each step's input token, for
    the predictor); -> outputs, per-step seconds and whether the step replayed (measured steps)."""
    outs, seconds, replayed = [], [], []
    for t in range(len(inputs)):
        if t == warmup:
            mgr.counters.__init__()  # count the measured steps only
        stack.set_step(inputs[t], ids[t], weights[t])
        t0 = time.perf_counter()
        before = mgr.counters.replayed_steps
        token = None if tokens is None else tokens[t : t + 1]
        out = mgr.run_forward(stack.forward, n_real=1, token_ids=token)
        if dev == "cuda":
            torch.cuda.synchronize()
        if t >= warmup:
            seconds.append(time.perf_counter() - t0)
            replayed.append(mgr.counters.replayed_steps > before)
        outs.append(out.clone())
    return outs, np.array(seconds), np.array(replayed)


def graph_seconds(stack: Stack, dev: str) -> float:
    """One forward pass alone (no manager): median of 50 graph replays of the same routing, back
    to back, so part of its expert rows stay in L2: a lower bound of the forward, not a baseline."""
    if dev != "cuda":
        return float("nan")
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        stack.forward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def pinned_h2d_gbps(row_bytes: int, rows: int, dev: str) -> float:
    """A plain pinned host -> device copy of `rows` rows (median of 20)."""
    if dev != "cuda":
        return float("nan")
    src = torch.empty(rows, row_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(rows, row_bytes, dtype=torch.uint8, device=dev)
    times = []
    for _ in range(25):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return rows * row_bytes / sorted(times[5:])[10] / 1e9


def fetch_costs(mgr: ResidencyManager, lay, dev: str) -> list[dict]:
    """Where a fetch's time goes, by batch size: the manager's fetch (wall clock) against a plain
    pinned copy of as many rows, timed by CUDA events (the DMA alone) and by the wall clock
    (DMA + launch + wait)."""
    if dev != "cuda":
        return []
    rows = []
    for n in (1, 2, 4, 8, 16):
        keys, slots = [(0, e) for e in range(n)], list(range(n))
        src = torch.empty(n, lay.row_bytes, dtype=torch.uint8).pin_memory()
        fetch, dma, wall = [], [], []
        for _ in range(12):
            t0 = time.perf_counter()
            mgr._copy_rows(keys, slots)
            fetch.append(time.perf_counter() - t0)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            for i in range(n):
                mgr.pool[i].copy_(src[i], non_blocking=True)
            b.record()
            b.synchronize()
            wall.append(time.perf_counter() - t0)
            dma.append(a.elapsed_time(b) / 1e3)
        med = {name: 1e6 * float(np.median(v[2:])) for name, v in
               (("fetch_us", fetch), ("pinned_dma_us", dma), ("pinned_wall_us", wall))}  # fmt: skip
        rows.append(
            {"rows": n, **med, "fetch_share_of_dma": med["pinned_dma_us"] / med["fetch_us"]}
        )
        print(f"fetch of {n:2d} rows: {med['fetch_us']:7.1f} us; pinned copy "
              f"{med['pinned_wall_us']:7.1f} us wall, {med['pinned_dma_us']:7.1f} us DMA", flush=True)  # fmt: skip
    return rows


def load_trace(args) -> tuple[np.ndarray, np.ndarray | None, int, str]:
    """(routing uint16 [steps, layers, top_k], input token of each step or None, experts per
    layer, trace name)."""
    if args.trace == "fixture":
        fixture = load_fixture(args.steps)
        if fixture is None:
            sys.exit("the fixture's trace is missing: build it with bench/fixture/evaluate.py")
        return fixture["ids"], fixture["tokens"], fixture["E"], "fixture (test split)"
    # GLM-5.2's routing statistics (calibrated coverage) on this stack's geometry
    profile = dataclasses.replace(
        traces.GLM_5_2, moe_layers=args.layers, n_experts=args.experts, top_k=args.top_k,
        hidden=args.hidden, moe_intermediate=args.inter,
        topic_experts=min(traces.GLM_5_2.topic_experts, args.experts // 2),
        phrase_experts=min(traces.GLM_5_2.phrase_experts, args.experts // 4),
    )  # fmt: skip
    trace = traces.synthetic_trace(profile, args.steps, args.seed)
    return trace, None, args.experts, profile.model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=384)
    ap.add_argument("--coverages", type=float, nargs="+",
                    default=[1.0, 0.95, 0.9, 0.88, 0.86, 0.84, 0.82, 0.8, 0.7, 0.6, 0.5])  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--packs", help="pack directory (default: a temporary one)")
    ap.add_argument(
        "--host-tier",
        choices=("ram", "tiered", "pagecache"),
        default="ram",
        help="moet-store backend of the host tier (tiered: a pinned arena over the "
        "pack files, read with O_DIRECT where the file system allows)",
    )
    ap.add_argument("--warm-start", choices=("trace", "past"), default="trace",
                    help="preloaded experts: the whole trace's hottest (steady state) or the "
                    "warm-up quarter's (cold)")  # fmt: skip
    ap.add_argument("--arena-gib", type=float, default=None,
                    help="host_tier=tiered: the arena's size (default: moet-store's)")  # fmt: skip
    ap.add_argument("--trace", choices=("glm-5.2", "fixture"), default="glm-5.2",
                    help="synthetic GLM-5.2-shaped routing on --layers/--experts/--top-k, or "
                    "the fixture's real routing and tokens (its own geometry)")  # fmt: skip
    ap.add_argument("--policies", nargs="+", choices=("decay", "predict"), default=["decay"],
                    help="run each pool with each (predict: --trace fixture)")  # fmt: skip
    ap.add_argument("--out", help="result folder (default bench/results/residency_gpu/)")
    args = ap.parse_args()
    trace, tokens, n_experts, name = load_trace(args)
    if "predict" in args.policies and tokens is None:
        ap.error("--policies predict needs a trace with tokens (--trace fixture)")
    dev, (n_steps, n_layers, k) = args.device, trace.shape
    lay = NativeRowLayout(args.hidden, args.inter)
    if dev == "cuda":
        build_cubin()  # for this GPU, unless MOET_KERNELS_CUBIN_DIR names built ones
    steps = simulate.decode_steps(trace, n_experts)
    token_keys = None if tokens is None else simulate.step_tokens(trace, tokens, n_experts)
    warmup = n_steps // 4
    gen = torch.Generator().manual_seed(args.seed + 1)
    inputs = torch.randn(n_steps, 1, args.hidden, generator=gen).to(torch.bfloat16).to(dev)
    ids = torch.from_numpy(trace.astype(np.int32)).view(n_steps, n_layers, 1, k).to(dev)
    w = torch.rand(n_steps, n_layers, 1, k, generator=gen)
    weights = (w / w.sum(-1, keepdim=True)).to(dev)
    report = {
        "environment": {**provenance([sys.executable, *sys.argv]), "device": dev},
        "host_tier": args.host_tier,
        "warm_start": args.warm_start,
        "model": {"layers": n_layers, "experts": n_experts, "hidden": args.hidden,
                  "inter": args.inter, "top_k": k, "row_bytes": lay.row_bytes,
                  "trace": name, "steps": n_steps, "warmup_steps": warmup},
        "runs": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="moet-residency-gpu-") as tmp:
        directory = Path(args.packs or tmp)
        t0 = time.time()
        spec, slow = write_packs(directory, lay, n_layers, n_experts, args.seed, dev)
        report["model"]["slow_tile_fraction"] = slow  # of the first expert row
        print(f"packs written in {time.time() - t0:.1f} s", flush=True)
        n_keys = n_layers * n_experts
        # the warm start: "trace", the whole trace's hottest (the hot set a long run would have
        # persisted; a steady state, so the all-resident run never misses); "past", the warm-up
        # quarter's (a cold server: experts first routed later miss at every pool)
        hot = simulate.hottest(steps if args.warm_start == "trace" else steps[:warmup], n_keys)
        reference = None
        resident_step = None
        # first an all-resident run that is not reported, whose outputs are the reference: a
        # process's first run pays one-off costs (fixture trace: 479 against 349 us per step);
        # all-resident once more at the end: the run-to-run noise of the baseline
        runs = [*sorted(set(args.coverages), reverse=True), 1.0]
        plan = [(1.0, args.policies[0], True)]
        plan += [(cov, policy, False) for cov in runs for policy in args.policies]
        for cov, policy, warm_up in plan:
            n_slots = max(1, int(round(cov * n_keys)))
            arena = {} if args.arena_gib is None else {"arena_bytes": int(args.arena_gib * 2**30)}
            store = moet_store.open_store(directory, spec, backend=args.host_tier, **arena)
            mgr = ResidencyManager(
                lay, list(range(n_layers)), n_experts, n_slots, store, kpi_every=0,
                predict=policy == "predict", device=dev, reduce_max=int,  # one rank: no TP
            )  # fmt: skip
            mgr.preload(hot)
            stack = Stack(mgr, lay, n_layers, k, dev)
            stack.capture()
            graph_us = 1e6 * graph_seconds(stack, dev)  # this run's forward pass alone
            outs, seconds, replayed = run(mgr, stack, inputs, ids, weights, warmup, dev, tokens)
            c = mgr.counters
            if warm_up:
                reference = outs
                mgr.close()
                del stack, mgr
                continue
            if resident_step is None:  # the first (largest) pool reported is all-resident
                if cov < 1.0:
                    raise SystemExit("the coverages must include 1.0 (the all-resident run)")
                resident_step = float(seconds.mean())
            identical = all(torch.equal(a, b) for a, b in zip(outs, reference))
            knobs = (
                {} if token_keys is None else {"tokens": token_keys[0], "token_keys": token_keys[1]}
            )
            sim = simulate.run_policy(
                policy, steps, n_slots, n_layers, n_experts, warmup=warmup, initial=hot, **knobs
            )
            fetch_gbps = c.fetched_bytes / c.fetch_seconds / 1e9 if c.fetch_seconds else None
            row = {
                "coverage": cov,
                "policy": policy,
                "slots": n_slots,
                "bit_identical_to_resident": identical,
                "replay_steps_equal_simulator": c.replayed_steps == sim.replay_steps,
                "replay_pct": 100.0 * c.replayed_steps / max(c.steps, 1),
                "missing_pairs_per_step": c.missing_pairs / max(c.steps, 1),
                "second_order_replays": c.second_order,
                "step_us_mean": 1e6 * float(seconds.mean()),
                "step_us_median": 1e6 * float(np.median(seconds)),
                "speed_vs_resident": resident_step / float(seconds.mean()),  # throughput
                # the same run's steps that did not replay: a baseline free of run-to-run drift
                "speed_vs_own_unreplayed_steps": float(seconds[~replayed].mean() / seconds.mean())
                if (~replayed).any()
                else None,
                "graph_replay_us": graph_us,
                "fetch_us_per_replay": 1e6 * c.fetch_seconds / max(c.replays, 1),
                "step_us": [round(1e6 * x, 1) for x in seconds],
                "step_replayed": replayed.astype(int).tolist(),
                "fetched_rows": c.fetched_rows,
                "predicted_steps": c.predicted_steps,
                "predicted_rows": c.predicted_rows,
                "fetch_GBps": fetch_gbps,
                "simulated_replay_pct": sim.replay_pct,
            }
            if c.fetched_rows:
                per_batch = max(1, round(c.fetched_rows / max(c.replays, 1)))
                pinned = pinned_h2d_gbps(lay.row_bytes, per_batch, dev)
                row["pinned_h2d_GBps_same_rows"] = pinned
                if fetch_gbps:
                    row["fetch_share_of_pinned_h2d"] = fetch_gbps / pinned
            report["runs"].append(row)
            print(
                f"coverage {cov:4.2f} {policy}: identical={identical} replay "
                f"{row['replay_pct']:5.1f}% "
                f"(simulated {sim.replay_pct:5.1f}%), missing/step "
                f"{row['missing_pairs_per_step']:.2f}, step {row['step_us_mean']:8.1f} us = "
                f"{row['speed_vs_resident']:.2f}x resident, fetch "
                f"{fetch_gbps or 0:.1f} GB/s (pinned {row.get('pinned_h2d_GBps_same_rows', 0):.1f})",
                flush=True,
            )
            if len(report["runs"]) == 1:  # the fetch's cost model, once, on the resident pool
                report["fetch_costs"] = fetch_costs(mgr, lay, dev)
            mgr.close()
            del stack, mgr
    ok = all(
        r["bit_identical_to_resident"] and r["replay_steps_equal_simulator"] for r in report["runs"]
    )
    write_result("residency_gpu", report, machine() if dev == "cuda" else "cpu", args.out)
    print(f"every step bit-identical to all-resident, replays as simulated: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
