"""Does the FP4 pool do better when heat is weighted by what W2 costs each expert? (issue 19)

    python bench/probes/fp4_pool_weighting.py --tokens TOKENS.npy [--max-tokens 16384]
        [--pool 0.25] [--tau 0 1] [--out FILE]

Serving's FP4 tier (moet_vllm.residency.fp4tier) fills its pool by heat: each routing of a pair
adds 1 to its decayed count. Here each routing adds the pair's W2 damage instead, normalized to a
mean of 1 over the pairs: ||W2 - bf16||_F over its gate, up and down weights (what its FP4 row
would win back, nearly: fp4r's own error is ~4x smaller), so a pair routed as often but quantized
worse holds its FP4 row first. Both rules run through `gate_eval.evaluate_gate` (the harness
`moet eval-gate` is; teacher-forced, exact mode) on the same tokens at each tau (margin, serving's
metric), and the report gives the loss against bf16, agreement with all-FP4 and gate replays of
each. The weighting is patched into the harness's Fp4Tier here; serving is unchanged.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def damage(model_dir) -> np.ndarray:
    """||W2 - bf16||_F per (MoE layer, expert), layer-major, normalized to a mean of 1."""
    import torch
    from transformers import AutoModelForCausalLM

    from moet_quant.quality import expert_modules, quantized_copy

    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    w2, _ = quantized_copy(ref, "w2-reference")
    rows = []
    for (_, a), (_, b) in zip(expert_modules(ref), expert_modules(w2), strict=True):
        d = (a.gate_up_proj - b.gate_up_proj).flatten(1).pow(2).sum(1)
        d += (a.down_proj - b.down_proj).flatten(1).pow(2).sum(1)
        rows.append(d.detach().sqrt().double().numpy())
    w = np.concatenate(rows)
    return w / w.mean()


def weighted_tier(weights: np.ndarray):
    """An Fp4Tier factory whose policy adds `weights[key]` per routing instead of 1."""
    from moet_vllm.residency.fp4tier import Fp4Tier

    def make(*args, **kwargs):
        tier = Fp4Tier(*args, **kwargs)
        pol, plain = tier.policy, tier.policy.observe

        def observe(routed):  # the policy's own step (decay, +1 a routing), then the weight - 1
            plain(routed)
            routed = np.asarray(routed, dtype=np.int64).ravel()
            pol.score += np.bincount(routed, weights=weights[routed] - 1, minlength=pol.n_keys)

        pol.observe = observe
        return tier

    return make


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the trained fixture")
    ap.add_argument("--tokens", required=True, type=Path)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--pool", type=float, default=0.25)
    ap.add_argument("--tau", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--token-label", default="", help="what --tokens holds, for the report")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from moet_vllm import gate_eval

    model = args.model
    if model is None:
        from moet.models import fixture

        model = fixture()
    tokens = np.load(args.tokens)
    configs = [gate_eval.GateConfig(args.pool, t, "margin") for t in args.tau]
    extra = {"token_file": args.token_label or args.tokens.name}
    opts = gate_eval.SimOptions(max_tokens=args.max_tokens, progress=False, extra=extra)
    w = damage(model)
    report = {"heat": gate_eval.evaluate_gate(model, tokens, configs, opts)}
    plain = gate_eval.Fp4Tier
    gate_eval.Fp4Tier = weighted_tier(w)
    try:
        report["weighted"] = gate_eval.evaluate_gate(model, tokens, configs, opts)
    finally:
        gate_eval.Fp4Tier = plain
    report["damage_spread"] = {"min": float(w.min()), "max": float(w.max()), "sd": float(w.std())}
    root = Path(__file__).resolve().parents[2]
    for rule in ("heat", "weighted"):  # the model as the reports name it: no machine path
        r = report[rule]
        r["model"] = str(
            Path(model).relative_to(root) if Path(model).is_relative_to(root) else model
        )
        for name, row in r["configs"].items():
            print(f"{rule:8s} {name:32s} loss vs bf16 {row['vs_bf16']['mean']:+.4f} "
                  f"agree all-FP4 {row['agreement_fp4']:.3f} gated {row['gated_pct']:.1f}% "
                  f"promotions/step {row['promotions_per_step']:.2f}")  # fmt: skip
    print(f"damage weights: {report['damage_spread']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    main()
