"""Does the shared expert run beside moet's routed-expert op? vLLM 0.24 runs a MoE layer's shared
experts on an aux stream (runner/shared_experts.py: MULTI_STREAM_OVERLAPPED, up to 256 tokens),
enqueued after the routed op and joined after it, so in a CUDA graph the two are parallel branches.
Whether they overlap on the GPU is a question of SM resources: moet's persistent GEMMs launch as
many CTAs as fit, and with PDL the next kernel's CTAs hold their slots while they wait.

    python3 bench/probes/overlap_probe.py [--shape glm-4.5-air] [--shared-inter 1408]
        [--batches 1 8 32] [--caps 264 198 132] [--out FILE]

One CUDA graph over 8 layers (distinct pools and shared-expert weights: L2 defeated), replayed;
µs a layer for: the op alone (select to combine), the shared expert alone (bf16 gate_up GEMM,
SiLU-and-mul, down GEMM through torch, as vLLM's unquantized linear calls cuBLAS), both one after
the other on one stream, and both as vLLM enqueues them (the shared expert on an aux stream after
the op), also with the persistent GEMMs' grids capped (`loader.grid_cap`) and with PDL off. Where
"aux" is near "serial", the branches do not overlap; where a cap brings it near max(op, shared),
the op leaves the shared expert the SMs it needs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import chain_probe  # noqa: E402  (bench/probes/)
import kernels as kb  # noqa: E402  (bench/kernels.py)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def shared_expert(x, w13, w2, si: int):
    gu = F.linear(x, w13)
    return F.linear(F.silu(gu[:, :si]) * gu[:, si:], w2)


def step(mode: str, work: list, counters: tuple, routing, aux, si: int):
    """One pass over the layers: the op, the shared expert, both serially, or (aux) as vLLM's
    runner enqueues them: fork before the op, the shared expert on `aux` after it, join
    (aux-first: the shared expert enqueued before the op)."""
    from moet_kernels import ops

    def op(layer, logits, x):
        w, ids = ops.select_experts(logits, routing)
        kb.run_op(layer, x, ids, w, *counters)

    def run():
        main = torch.cuda.current_stream()
        for layer, logits, x, w in work:
            forked = mode.startswith("aux")
            if forked:
                aux.wait_stream(main)
            if mode == "aux-first":
                with torch.cuda.stream(aux):
                    shared_expert(x, *w, si)
            if mode != "shared":
                op(layer, logits, x)
            if mode == "aux":
                with torch.cuda.stream(aux):
                    shared_expert(x, *w, si)
            if forked:
                main.wait_stream(aux)
            elif mode != "op":
                shared_expert(x, *w, si)

    return run


def timed(mod, run, cap: int | None, pdl: bool, n_layers: int) -> float:
    """µs a layer of `run` as a replayed CUDA graph, the persistent GEMMs' grids capped at `cap`
    CTAs (None: as many as fit) and PDL on or off."""
    with chain_probe.pdl_as(mod, pdl):
        with mod.grid_cap(cap) if cap is not None else contextlib.nullcontext():
            _, seconds = kb.graph_seconds(run, rounds=7)
    return seconds * 1e6 / n_layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="glm-4.5-air", choices=sorted(kb.SHAPES))
    ap.add_argument("--shared-inter", type=int, default=1408, help="the shared expert's width")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--caps", type=int, nargs="*", default=[264, 198, 132],
                    help="grid caps (CTAs) of the persistent GEMMs to time 'aux' under")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    kb.build_cubin()
    from moet_kernels import loader, ops
    from moet_kernels.reference import Routing

    gen = torch.Generator(device="cuda").manual_seed(0)
    h, _, e, k = kb.SHAPES[args.shape]
    si = args.shared_inter
    layers = kb.glm_layers(gen, shape=args.shape)
    mk = lambda *s: (torch.randn(*s, device="cuda", generator=gen) * 0.02).bfloat16()  # noqa: E731
    shared = [(mk(2 * si, h), mk(h, si)) for _ in layers]
    routing = Routing(k, "sigmoid", True)
    mod = loader.load(torch.device("cuda"))
    aux = torch.cuda.Stream()

    rows = []
    for n_tok in args.batches:
        ops._workspaces.clear()
        logits = [torch.randn(n_tok, e, device="cuda", generator=gen) for _ in layers]
        xs = [torch.randn(n_tok, h, device="cuda", generator=gen).bfloat16() for _ in layers]
        counters = (
            torch.tensor([n_tok], dtype=torch.int32, device="cuda"),  # real tokens
            torch.zeros(1, dtype=torch.int32, device="cuda"),  # miss count
            torch.zeros(e, dtype=torch.uint8, device="cuda"),  # routed flags
        )
        work = list(zip(layers, logits, xs, shared))
        plan = [("op", None, True), ("shared", None, True), ("serial", None, True),
                ("aux", None, True), ("aux-first", None, True), ("aux", None, False)]  # fmt: skip
        plan += [("aux", c, True) for c in args.caps] + [("op", c, True) for c in args.caps]
        for rnd in range(args.rounds):
            for mode, cap, pdl in plan if rnd % 2 == 0 else plan[::-1]:
                us = timed(mod, step(mode, work, counters, routing, aux, si), cap, pdl, len(layers))
                rows.append({"batch": n_tok, "mode": mode, "grid_cap": cap, "pdl": pdl,
                             "round": rnd, "us_per_layer": us})  # fmt: skip
                print(f"T={n_tok:3d} r{rnd} {mode:6s} cap={cap} pdl={int(pdl)} "
                      f"{us:7.2f} us/layer", flush=True)  # fmt: skip
    from statistics import median

    med: dict = {}
    for r in rows:
        med.setdefault((r["batch"], r["mode"], r["grid_cap"], r["pdl"]), []).append(
            r["us_per_layer"]
        )
    summary = [{"batch": b, "mode": m, "grid_cap": c, "pdl": p, "us_per_layer": median(v)}
               for (b, m, c, p), v in med.items()]  # fmt: skip
    for s in summary:
        print(f"median T={s['batch']} {s['mode']} cap={s['grid_cap']} pdl={int(s['pdl'])}: "
              f"{s['us_per_layer']:.2f} us/layer")  # fmt: skip
    result = {"shape": args.shape, "shared_inter": si, "layers_in_graph": len(layers),
              "persistent_grid_full": {n: mod.persistent_grid(n, 128, 1 << 20)
                                       for n in ("moet_w13", "moet_w2")},
              "rows": rows, "medians": summary,
              "provenance": kb.provenance([sys.executable, *sys.argv])}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
