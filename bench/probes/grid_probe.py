"""How many CTAs the persistent GEMM kernels should run (GLM-5.2 W2 layer, H200).

    python3 bench/probes/grid_probe.py --out DIR

The op launches moet_w13 / moet_w2 with as many CTAs as fit (3 per SM: 396 on the H200). At
batch 1 w13 has 512 work items, so 116 CTAs take a second round while the rest idle. This times
the layer (bench/kernels.py's graph over 8 layers) with the grids of w13 and w2 capped per
kernel, in one run, to see whether fewer CTAs per SM (each with more of the SM) finish sooner.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels as kb  # noqa: E402  (bench/kernels.py)
import torch  # noqa: E402
from provenance import provenance  # noqa: E402

from moet_kernels import loader  # noqa: E402

CONFIGS = [  # per-kernel grid caps; {} = the op's own grid
    {},
    {"moet_w13": 264},
    {"moet_w13": 264, "moet_w2": 264},
    {"moet_w2": 264},
    {"moet_w13": 330},
    {"moet_w13": 198},
    {"moet_w13": 132},
    {},
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    kb.build_cubin()
    gen = torch.Generator(device="cuda").manual_seed(1)
    layers = kb.glm_layers(gen)
    bw = kb.copy_bandwidth()
    own = loader.Module.persistent_grid
    caps: dict[str, int] = {}

    def capped(self, name, block, work):
        return min(own(self, name, block, work), caps.get(name, 1 << 30))

    loader.Module.persistent_grid = capped
    rows = []
    for n_tok in args.batches:
        for config in CONFIGS:
            caps.clear()
            caps.update(config)
            print(f"caps {config or 'none'}:", end=" ")
            row = kb.time_batch(layers, n_tok, gen, bw)
            rows.append({"tokens": n_tok, "caps": config, **row})
    report = {"environment": provenance([sys.executable, *sys.argv]), "copy_GBps": bw / 1e9,
              "rows": rows}  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "grid_probe.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
