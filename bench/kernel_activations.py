"""How far the kernels' activation quantization moves an MoE layer's output, on real weights and
real hidden states (CPU; an input to the sm_90a wgmma plan of docs/kernels.md).

    python bench/kernel_activations.py [--out DIR] [--tokens N]

The trained fixture (bench/fixture/glm-moe-fixture, run by transformers) reads a stretch of this
repository's Python; each MoE layer's input hidden states are captured and pushed through that
layer's W2 experts (its moet checkpoint, which `bash ci/main.sh` writes) with a random top-k routing, three
ways: exact (float64 activations, the `exact` reference), int8 activations with a scale per token
and 128-chunk (today's kernels, the `kernel` reference), and e4m3 activations with one scale per
token (what a wgmma path with the whole K in one float32 accumulator would use). Reported: each
quantized output's relative distance to the exact one. Writes cpu-<date>.json under --out
(default bench/results/kernel_activations/).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _pkg in ("moet-kernels", "moet-quant"):
    sys.path.insert(0, str(ROOT / "packages" / _pkg / "src"))

import torch  # noqa: E402
from provenance import provenance  # noqa: E402  (bench/, the script's folder)
from results_io import write_result  # noqa: E402

FIXTURE = ROOT / "bench" / "fixture" / "glm-moe-fixture"
E4M3_MAX = 448.0


def e4m3_per_token(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 with one float scale per token (row), as float64."""
    s = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / E4M3_MAX
    return (x / s).to(torch.float8_e4m3fn).to(torch.float64) * s


def moe_e4m3(x, ids, w, inter, experts):
    """The kernel-mode MoE with e4m3 per-token activations at both projections (exact weights)."""
    from moet_kernels import reference as r

    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        c13, s13, c2, s2 = experts(e)
        gate_up = e4m3_per_token(x[tok].double()) @ r._kernel_weights(c13, s13).T
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(
            0,
            tok,
            w[tok, slot, None].double() * (e4m3_per_token(act) @ r._kernel_weights(c2, s2).T),
        )
    return out


def main() -> int:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moet_kernels import reference as r

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="result folder (default bench/results/kernel_activations/)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--checkpoint", default=str(Path.home() / ".cache/moet/main-job/glm-moe-fixture-moet"),
                    help="the fixture's moet checkpoint (bash ci/main.sh writes it)")  # fmt: skip
    args = ap.parse_args()
    ckpt = Path(args.checkpoint) / "model.safetensors"
    if not ckpt.is_file():
        sys.exit(
            f"no moet checkpoint at {ckpt}: run `bash ci/main.sh` once (it converts the fixture)"
        )
    tok = AutoTokenizer.from_pretrained(FIXTURE)
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    text = (ROOT / "packages/moet-kernels/src/moet_kernels/layout.py").read_text()
    ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens]
    caps = {}
    for name, mod in model.named_modules():
        if name.endswith("mlp.experts"):
            mod.register_forward_hook(
                lambda m, inp, out, name=name: caps.__setitem__(
                    name, inp[0].reshape(-1, inp[0].shape[-1])
                )
            )
    with torch.no_grad():
        model(ids)
    weights = load_file(str(ckpt))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for pre, x in caps.items():
        n_exp = model.config.n_routed_experts
        top_k = model.config.num_experts_per_tok

        def part(e, proj, what, pre=pre):
            return weights[f"{pre}.{e}.{proj}_proj.w2_{what}"]

        def experts(e, part=part):
            c13 = torch.cat([part(e, "gate", "codes"), part(e, "up", "codes")])
            s13 = torch.cat([part(e, "gate", "scales"), part(e, "up", "scales")])
            return c13, s13, part(e, "down", "codes"), part(e, "down", "scales")

        inter = part(0, "down", "codes").shape[1] * 4
        t = x.shape[0]
        route = torch.stack([torch.randperm(n_exp, generator=gen)[:top_k] for _ in range(t)])
        w = torch.rand(t, top_k, generator=gen)
        x = x.detach()
        exact = r._moe(x.double(), route, w, inter, experts, mode="exact").double()
        int8 = r._moe(x, route, w, inter, experts, mode="kernel").double()
        e4m3 = moe_e4m3(x, route, w, inter, experts)

        def rel(a, exact=exact):
            return float((a - exact).norm() / exact.norm())

        rows.append(
            {"layer": pre, "tokens": t, "int8_per_128": rel(int8), "e4m3_per_token": rel(e4m3)}
        )
        print(f"{pre}: {t} tokens, int8 per 128 {rel(int8):.4f}, e4m3 per token {rel(e4m3):.4f}")
    report = {
        "what": __doc__.split("\n\n")[0],
        "environment": provenance([sys.executable, *sys.argv]),
    }
    write_result("kernel_activations", {**report, "layers": rows}, "cpu", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
