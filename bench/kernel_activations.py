"""How far the kernels' activation quantization moves the trained fixture (CPU; an input to the
sm_90a wgmma plan of docs/kernels-design.md).

    python bench/kernel_activations.py [--out DIR] [--tokens N] [--ppl-tokens N]

The fixture (moet.models.fixture(), run by transformers in float32) with its routed experts
replaced by its W2 checkpoint (the one `bash ci/main.sh` writes), computed three ways by the
moet-kernels references: exact (unquantized activations), int8 activations with a scale per token
and 128-chunk (today's kernels: `kernel` mode), and e4m3 activations with one scale per token
(what a wgmma path with all of K in one float32 accumulator would use), at both projections.
Reported: (1) each MoE layer's output distance to exact on hidden states captured from a stretch of
this repository's Python, with a random routing; (2) perplexity on the fixture's test split
(bench/out/fixture/corpus/test.npy: `nox -s fixture` builds it), with the per-token NLL change
against exact and its 95% interval over windows, and the bf16 checkpoint's own experts for scale. Writes cpu-<date>.json under --out (default
bench/results/kernel_activations/).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _pkg in ("moet-kernels", "moet-quant"):
    sys.path.insert(0, str(ROOT / "packages" / _pkg / "src"))
sys.path.insert(0, str(ROOT / "bench" / "fixture"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from provenance import provenance  # noqa: E402  (bench/, the script's folder)
from results_io import write_result  # noqa: E402

import moet.models  # noqa: E402

FIXTURE = moet.models.fixture()
TEST = ROOT / "bench" / "out" / "fixture" / "corpus" / "test.npy"
MODES = ("exact", "int8_per_128", "e4m3_per_token")
E4M3_MAX = 448.0


def e4m3_per_token(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 with one float scale per token (row), as float64."""
    s = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / E4M3_MAX
    return (x / s).to(torch.float8_e4m3fn).to(torch.float64) * s


def moe(mode: str, x, ids, w, inter, experts) -> torch.Tensor:
    """One MoE layer's routed experts in `mode` (MODES), float64 [T, H]."""
    from moet_kernels import reference as r

    if mode == "exact":
        return r._moe(x.double(), ids, w, inter, experts, mode="exact").double()
    if mode == "int8_per_128":
        return r._moe(x.float(), ids, w, inter, experts, mode="kernel").double()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        c13, s13, c2, s2 = experts(e)
        gate_up = e4m3_per_token(x[tok].double()) @ r._kernel_weights(c13, s13).T
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down = e4m3_per_token(act) @ r._kernel_weights(c2, s2).T
        out.index_add_(0, tok, w[tok, slot, None].double() * down)
    return out


def layer_experts(weights: dict, prefix: str):
    """`experts(e)` -> (w13 codes, w13 scales, w2 codes, w2 scales) of one layer, and its I."""

    def part(e, proj, what):
        return weights[f"{prefix}.{e}.{proj}_proj.w2_{what}"]

    def experts(e):
        c13 = torch.cat([part(e, "gate", "codes"), part(e, "up", "codes")])
        s13 = torch.cat([part(e, "gate", "scales"), part(e, "up", "scales")])
        return c13, s13, part(e, "down", "codes"), part(e, "down", "scales")

    return experts, part(0, "down", "codes").shape[1] * 4


def layer_distances(model, tok, weights, n_tokens: int) -> list[dict]:
    text = (ROOT / "packages/moet-kernels/src/moet_kernels/layout.py").read_text()
    ids = tok(text, return_tensors="pt").input_ids[:, :n_tokens]
    caps = {}
    hooks = [
        mod.register_forward_hook(
            lambda m, inp, out, name=name: caps.__setitem__(name, inp[0].detach())
        )
        for name, mod in model.named_modules()
        if name.endswith("mlp.experts")
    ]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    gen = torch.Generator().manual_seed(0)
    n_exp, top_k = model.config.n_routed_experts, model.config.num_experts_per_tok
    rows = []
    for prefix, x in caps.items():
        experts, inter = layer_experts(weights, prefix)
        x = x.reshape(-1, x.shape[-1])
        route = torch.stack([torch.randperm(n_exp, generator=gen)[:top_k] for _ in x])
        w = torch.rand(x.shape[0], top_k, generator=gen)
        out = {m: moe(m, x, route, w, inter, experts) for m in MODES}
        row = {"layer": prefix, "tokens": x.shape[0]}
        for m in MODES[1:]:
            row[m] = float((out[m] - out["exact"]).norm() / out["exact"].norm())
        rows.append(row)
        print(f"{prefix}: {row['tokens']} tokens, distance to exact: " + ", ".join(
            f"{m} {row[m]:.4f}" for m in MODES[1:]))  # fmt: skip
    return rows


def perplexities(model, weights, n_tokens: int) -> dict:
    import evaluate  # bench/fixture/evaluate.py: windows of 1024, per-token NLL

    if not TEST.is_file():
        sys.exit(f"no test split at {TEST}: build it with `nox -s fixture` (corpus, tokenizer)")
    tokens = np.load(TEST)[: n_tokens + 1]
    modules = {n: m for n, m in model.named_modules() if n.endswith("mlp.experts")}
    nll = {"bf16": evaluate.score(model, tokens)[0]}  # the checkpoint's own experts, for scale
    print(f"bf16: perplexity {math.exp(nll['bf16'].mean()):.4f} on {nll['bf16'].size} tokens")
    for mode in MODES:
        for prefix, mod in modules.items():
            experts, inter = layer_experts(weights, prefix)

            def forward(x, ids, w, experts=experts, inter=inter, mode=mode):
                return moe(mode, x, ids.long(), w, inter, experts).to(x.dtype)

            mod.forward = forward
        nll[mode], _ = evaluate.score(model, tokens)
        print(f"{mode}: perplexity {math.exp(nll[mode].mean()):.4f} on {nll[mode].size} tokens")
    windows = [n for _, n in evaluate.windows_of(tokens)]
    edges = np.cumsum([0, *windows])
    out = {}
    for mode in ("bf16", *MODES):
        row = {"perplexity": math.exp(nll[mode].mean()), "tokens": int(nll[mode].size)}
        if mode != "exact":
            d = nll[mode] - nll["exact"]
            per_window = np.array([d[a:b].mean() for a, b in zip(edges[:-1], edges[1:])])
            half = 1.96 * per_window.std(ddof=1) / math.sqrt(per_window.size)
            row["nll_change_vs_exact"] = {"mean": float(d.mean()), "ci95_half": float(half)}
        out[mode] = row
    return out


def main() -> int:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", help="result folder (default bench/results/kernel_activations/)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens for the layer distances")
    ap.add_argument("--ppl-tokens", type=int, default=32768, help="test-split tokens (0: skip)")
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
    weights = load_file(str(ckpt))
    report = {
        "what": __doc__.split("\n\n")[0],
        "environment": provenance([sys.executable, *sys.argv]),
        "layers": layer_distances(model, tok, weights, args.tokens),
    }
    if args.ppl_tokens:
        report["perplexity"] = perplexities(model, weights, args.ppl_tokens)
    write_result("kernel_activations", report, "cpu", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
