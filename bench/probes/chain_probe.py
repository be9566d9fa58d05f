"""Where a decode step's MoE op spends its time: the launch chain cut after each stage.

    python3 bench/probes/chain_probe.py [--shape glm-4.5-air] [--batches 1 8 32] [--pdl both|on]
        [--out FILE]
    MOET_NVCC_FLAGS=-DGEMM_BLOCKS=4 python3 bench/probes/chain_probe.py ...  # a build variant
    python3 bench/probes/chain_probe.py --variant base= --variant b4=-DGEMM_BLOCKS=4 [--rounds 3]
        # an A/B: every variant built here (nvcc side by side), timed in turn on the same layers,
        # in rounds of alternating order; the JSON's `variants` has each one's median per stage
    git show REV:packages/moet-kernels/csrc/w2_moe.cu > old.cu  # another version of the source
    python3 bench/probes/chain_probe.py --variant old=@old.cu --variant new=
        # `@FILE [FLAGS]` builds FILE instead of this checkout's w2_moe.cu (same kernel ABI)

The op (select -> route -> w13 -> requant -> w2 -> combine) is captured in one CUDA graph over 8
layers of distinct pools (L2 defeated, as bench/kernels.py times it) and replayed, once per prefix
of the chain: the time a prefix adds over the one before is what its last stage costs on the
chain's critical path (its own latency plus its launch boundary, with PDL as the loader launches
it), which the profiler's per-kernel spans cannot say (a PDL-launched kernel's span includes its
wait). Each prefix is also timed with PDL off; the empty graph (the replay's own cost) is the first
row. What the runs say of issue 18's targets: docs/kernels-design.md, "The decode chain, stage by
stage".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels as kb  # bench/kernels.py  # noqa: E402
import torch  # noqa: E402

STAGES = ("select", "route", "w13", "requant", "w2", "combine")


def stage_of(kernel: str) -> str:
    return next(s for s in STAGES if kernel.startswith(f"moet_{s}"))


def timed(layers, logits, xs, routes, keep: set, pdl: bool, routing) -> float:
    """Median µs per layer of one graph over `layers`, launching only the kernels of `keep`;
    `routes`: each layer's (weights, ids), selected once, so every stage reads real routes."""
    from moet_kernels import loader, ops

    mod = loader.load(torch.device("cuda"))
    launch = type(mod).launch

    def only(self, name, grid, block, args):
        if stage_of(name) in keep:
            launch(self, name, grid, block, args)

    n_tok = xs[0].shape[0]
    nr = torch.tensor([n_tok], dtype=torch.int32, device="cuda")
    miss = torch.zeros(1, dtype=torch.int32, device="cuda")
    routed = torch.zeros(layers[0].n_experts, dtype=torch.uint8, device="cuda")

    def step():
        for layer, lg, x, (w, ids) in zip(layers, logits, xs, routes):
            if "select" in keep:
                ops.select_experts(lg, routing)
            kb.run_op(layer, x, ids, w, nr, miss, routed)

    type(mod).launch = only
    try:
        with pdl_as(mod, pdl):
            _, seconds = kb.graph_seconds(step, rounds=7)
    finally:
        type(mod).launch = launch
    return seconds * 1e6 / len(layers)


@contextlib.contextmanager
def pdl_as(mod, on: bool):
    """The loader's launches inside with PDL as it sets it (on) or without it (off)."""
    from cuda.bindings import driver

    attrs = mod._pdl
    if not on:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 0
        mod.__dict__["_pdl"] = attr
    try:
        yield
    finally:
        mod.__dict__["_pdl"] = attrs


def medians(rows: list[dict]) -> dict:
    """(variant, batch, pdl) -> each stage's median over the rounds: the prefix through it (µs a
    layer; 'combine' is the whole op) and what it adds ('<stage> adds')."""
    from statistics import median

    out: dict[tuple, dict] = {}
    for r in rows:
        if r["adds_us"] is None:
            continue
        key = (r["variant"], r["batch"], r["pdl"])
        out.setdefault(key, {}).setdefault(r["through"], []).append(r["us_per_layer"])
        out[key].setdefault(f"{r['through']} adds", []).append(r["adds_us"])
    return {k: {s: median(v) for s, v in stages.items()} for k, stages in out.items()}


def build_of(spec: str) -> tuple[str, Path | None]:
    """A variant's (nvcc flags, source): `-D...` builds this checkout's w2_moe.cu, `@FILE -D...`
    builds FILE."""
    if not spec.startswith("@"):
        return spec, None
    source, _, flags = spec[1:].partition(" ")
    return flags, Path(source).resolve()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="glm-4.5-air", choices=sorted(kb.SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument(
        "--pdl",
        default="both",
        choices=["both", "on"],
        help="on: time the chain with PDL only (half the run, for an A/B of builds)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="a build of this checkout with nvcc FLAGS (-D ...), or of another version of "
        "w2_moe.cu (FLAGS `@FILE [-D ...]`), for an A/B in one process",
    )
    ap.add_argument("--rounds", type=int, default=2, help="--variant: rounds over the variants")
    ap.add_argument("--out")
    args = ap.parse_args()
    variants = dict(v.partition("=")[::2] for v in args.variant)
    if variants:  # built side by side; each round times them all, the order alternating
        jobs = {name: kb.nvcc_cubin(*build_of(flags)) for name, flags in variants.items()}
        folders = {name: kb.wait_cubin(job) for name, job in jobs.items()}
        os.environ["MOET_KERNELS_CUBIN_DIR"] = str(next(iter(folders.values())))
        names = list(variants)
        plan = [(r, v) for r in range(args.rounds) for v in (names if r % 2 == 0 else names[::-1])]
    else:
        kb.build_cubin()
        plan = [(0, None)]
    from moet_kernels import loader, ops
    from moet_kernels.reference import Routing

    gen = torch.Generator(device="cuda").manual_seed(0)
    h, _, e, k = kb.SHAPES[args.shape]
    layers = kb.glm_layers(gen, shape=args.shape)
    routing = Routing(k, "sigmoid", True)  # GLM-4.5's rules: sigmoid, renormalized
    rows = []
    for n_tok in args.batches:
        ops._workspaces.clear()
        logits = [torch.randn(n_tok, e, device="cuda", generator=gen) for _ in layers]
        xs = [torch.randn(n_tok, h, device="cuda", generator=gen).bfloat16() for _ in layers]
        routes = [ops.select_experts(lg, routing) for lg in logits]
        for rnd, variant in plan:
            if variant is not None:  # the loader loads this variant's cubin at its next use
                os.environ["MOET_KERNELS_CUBIN_DIR"] = str(folders[variant])
                loader._modules.clear()
            tag = {} if variant is None else {"variant": variant, "round": rnd}
            for pdl in (True, False) if args.pdl == "both" else (True,):
                prev = None
                for i in range(len(STAGES) + 1):
                    keep = set(STAGES[:i])
                    us = timed(layers, logits, xs, routes, keep, pdl, routing)
                    stage = STAGES[i - 1] if i else "(empty graph)"
                    rows.append({**tag, "batch": n_tok, "pdl": pdl, "through": stage,
                                 "us_per_layer": us,
                                 "adds_us": None if prev is None else us - prev})  # fmt: skip
                    prev = us
                    print(
                        ("" if variant is None else f"{variant} r{rnd} ")
                        + f"T={n_tok:3d} pdl={int(pdl)} through {stage:14s} {us:7.2f} us/layer"
                        + ("" if i == 0 else f"  (+{rows[-1]['adds_us']:.2f})"),
                        flush=True,
                    )
    result = {"shape": args.shape, "layers_in_graph": len(layers), "rows": rows,
              # the build's -D flags: one build's ($MOET_NVCC_FLAGS) or each variant's
              "nvcc_flags": variants or os.environ.get("MOET_NVCC_FLAGS", ""),
              "provenance": kb.provenance([sys.executable, *sys.argv])}  # fmt: skip
    if variants:
        per = medians(rows)
        for (name, batch, pdl), st in per.items():
            print(
                f"{name} T={batch} pdl={int(pdl)}: op {st['combine']:.2f} us/layer; adds "
                + ", ".join(f"{s} {st[s + ' adds']:.2f}" for s in STAGES),
                flush=True,
            )
        result["variants"] = [{"variant": n, "batch": b, "pdl": p, **v}
                              for (n, b, p), v in per.items()]  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
