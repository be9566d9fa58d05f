"""One MoE layer at a decode batch, for Nsight Compute (bench/h200/kernels.sh NCU=1 runs it).

    python3 bench/probes/kernels_ncu.py [TOKENS] [SHAPE]   # default: 8 tokens, glm-5.2
    ncu --clock-control none -k regex:moet_w -c 2 --set full -o rep \
        python3 bench/probes/kernels_ncu.py 32 glm-4.5-air   # w13 and w2 at batch 32
    ncu --import rep.ncu-rep --page details > details.txt   # the sections, per kernel
    ncu --import rep.ncu-rep --page source --csv --print-source sass > source.csv
        # stall samples per SASS instruction: which loads the GEMMs' stalls wait on
    python3 bench/probes/ncu_stalls.py source.csv   # their summary: by reason, top instructions
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels as kb  # bench/kernels.py  # noqa: E402
import torch  # noqa: E402

n_tok = int(sys.argv[1]) if len(sys.argv) > 1 else 8
shape = sys.argv[2] if len(sys.argv) > 2 else "glm-5.2"
kb.build_cubin()
gen = torch.Generator(device="cuda").manual_seed(0)
h, i, e, k = kb.SHAPES[shape]
layer = kb.Layer(h, i, e, gen, keep_logical=False)
ids, w = kb.routing(n_tok, e, k, gen)
x = torch.randn(n_tok, h, device="cuda", generator=gen).to(torch.bfloat16)
nr = torch.tensor([n_tok], dtype=torch.int32, device="cuda")
miss = torch.zeros(1, dtype=torch.int32, device="cuda")
routed = torch.zeros(e, dtype=torch.uint8, device="cuda")
for _ in range(3):
    kb.run_op(layer, x, ids, w, nr, miss, routed)
torch.cuda.synchronize()
