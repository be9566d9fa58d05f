"""Where a decode step's MoE op spends its time: the launch chain cut after each stage.

    python3 bench/probes/chain_probe.py [--shape glm-4.5-air] [--batches 1 8 32] [--pdl both|on]
        [--out FILE]
    MOET_NVCC_FLAGS=-DGEMM_BLOCKS=4 python3 bench/probes/chain_probe.py ...  # a build variant

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
    launch, attrs = type(mod).launch, mod._pdl

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
    if not pdl:
        mod.__dict__["_pdl"] = _no_pdl()
    try:
        _, seconds = kb.graph_seconds(step, rounds=7)
    finally:
        type(mod).launch = launch
        mod.__dict__["_pdl"] = attrs
    return seconds * 1e6 / len(layers)


def _no_pdl():
    from cuda.bindings import driver

    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 0
    return attr


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
    ap.add_argument("--out")
    args = ap.parse_args()
    kb.build_cubin()
    from moet_kernels import ops
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
        for pdl in (True, False) if args.pdl == "both" else (True,):
            prev = None
            for i in range(len(STAGES) + 1):
                keep = set(STAGES[:i])
                us = timed(layers, logits, xs, routes, keep, pdl, routing)
                stage = STAGES[i - 1] if i else "(empty graph)"
                rows.append({"batch": n_tok, "pdl": pdl, "through": stage, "us_per_layer": us,
                             "adds_us": None if prev is None else us - prev})  # fmt: skip
                prev = us
                print(
                    f"T={n_tok:3d} pdl={int(pdl)} through {stage:14s} {us:7.2f} us/layer"
                    + ("" if i == 0 else f"  (+{rows[-1]['adds_us']:.2f})"),
                    flush=True,
                )
    result = {"shape": args.shape, "layers_in_graph": len(layers), "rows": rows,
              "nvcc_flags": os.environ.get("MOET_NVCC_FLAGS", ""),  # an A/B variant's -D flags
              "provenance": kb.provenance([sys.executable, *sys.argv])}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
