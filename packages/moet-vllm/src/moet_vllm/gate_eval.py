"""The FP4 tier and confidence gate, simulated as serving decides them (`moet eval-gate`; issue 19).

moet_quant.quality judges formats with every expert in one format. Serving mixes them: each
routed expert runs from its FP4 row where the FP4 pool holds it, else from its W2 row, and the
pool's content follows the decisions of moet_vllm.residency.fp4tier (heat after each step; the
gate promoting a step's routed experts and replaying it when the token's confidence is below tau).
Those decisions depend on every step before, and each step's KV comes from whichever pass was
final, so the simulation decodes token by token, teacher-forced, as batch 1 would:

* transformers, float32, the checkpoint's own dense weights; two copies of the routed experts,
  W2 (moet's reference quantizer) and fp4r (the FP4 tier's values), the pool's pairs served from
  the second; windows of the token file are consecutive requests (a fresh KV cache each, the pool
  kept);
* a step: one token through the model with the KV cache; its confidence from the logits; gated
  (confidence < tau x the share of its routed pairs at W2, `Fp4Tier.gates`): the routed pairs
  enter the pool, the cache drops the step, the step runs again and its logits are final; then
  the tier observes the final routing and promotes by heat.

Reported per configuration (pool share, tau): next-token loss and its paired-bootstrap difference
from bf16 (moet_quant.quality.bootstrap over windows), greedy agreement with bf16 and with
all-FP4 (every expert fp4r, teacher-forced over the same windows), gate replay % of steps,
promotions and evictions per step, confidence statistics of the ungated pass.

The `oracle` metric is the simulation's alone: its confidence is 0 where the first pass's greedy
token differs from all-FP4's (teacher-forced, the same position) and 1 elsewhere, so at tau 1 it
replays exactly the steps that disagree. No confidence signal can choose better steps to replay;
what the oracle row misses, no replay reaches (the W2 experts of earlier steps in the KV
cache, pairs the replay routes anew outside the pool).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from .residency.fp4tier import DEFAULT_MAX_PROMOTIONS, DEFAULT_SWAP_SIGMAS, Fp4Tier, confidence

ORACLE = "oracle"


@dataclass(frozen=True)
class GateConfig:
    pool_share: float  # the FP4 pool's share of the (MoE layer, expert) pairs, 0..1
    tau: float  # gate threshold (0: never gates)
    metric: str = "prob"
    max_promotions: int = DEFAULT_MAX_PROMOTIONS
    swap_sigmas: float = DEFAULT_SWAP_SIGMAS

    @property
    def name(self) -> str:
        swap = "" if self.swap_sigmas == DEFAULT_SWAP_SIGMAS else f", swap {self.swap_sigmas:g} sd"
        if self.metric == ORACLE:
            return f"pool {100 * self.pool_share:g}% oracle{swap}"
        return f"pool {100 * self.pool_share:g}% tau {self.tau:g} ({self.metric}{swap})"


DEFAULT_POOLS = (0.1, 0.25)  # the FP4 pool's share of the experts (the issue allows <= 25%)
DEFAULT_TAUS = (0.0, 0.3, 0.5, 0.7)


def curve(
    pools=DEFAULT_POOLS,
    taus=DEFAULT_TAUS,
    metric: str = "prob",
    swaps=(DEFAULT_SWAP_SIGMAS,),
    oracle: bool = False,
) -> list[GateConfig]:
    """Bare W2 (the baseline of every row), then every pool share > 0 with every tau and every
    heat-swap margin (`swaps`, Fp4Tier's `swap_sigmas`), then (`oracle`) each pool and margin
    gated by the oracle (see the module doc)."""
    rows = [
        GateConfig(p, t, metric, swap_sigmas=z) for p in pools if p for z in swaps for t in taus
    ]
    if oracle:
        rows += [GateConfig(p, 1.0, ORACLE, swap_sigmas=z) for p in pools if p for z in swaps]
    return [GateConfig(0.0, 0.0, metric)] + rows


@dataclass
class SimOptions:
    window: int = 1024
    max_tokens: int | None = None
    n_boot: int = 2000
    seed: int = 0
    progress: bool | None = None  # None: on a terminal
    extra: dict = field(default_factory=dict)


class _Experts:
    """The routed experts of one model copy, with the W2 and fp4r values of every pair and the
    routing of the last pass (a pre-hook on each fused expert module). `mode` is the experts'
    arithmetic (moet_kernels.reference.MODES): `exact` (transformers' own forward over the
    values) or `kernel` (the GPU kernels' int8 activations, float64 GEMMs: what serving computes
    on a GPU)."""

    def __init__(self, model, w2_model, fp4_model, mode: str = "exact"):
        from moet_quant.quality import expert_modules

        self.mods = [m for _, m in expert_modules(model)]
        if mode == "kernel":
            for m in self.mods:
                m.forward = functools.partial(_kernel_experts, m)
        elif mode != "exact":
            raise ValueError(f"mode must be 'exact' or 'kernel', got {mode!r}")
        self.w2 = [(m.gate_up_proj.detach().clone(), m.down_proj.detach().clone())
                   for _, m in expert_modules(w2_model)]  # fmt: skip
        self.fp4 = [(m.gate_up_proj.detach().clone(), m.down_proj.detach().clone())
                    for _, m in expert_modules(fp4_model)]  # fmt: skip
        self.n_experts = self.mods[0].gate_up_proj.shape[0]
        self.routed: list = [None] * len(self.mods)
        for o, m in enumerate(self.mods):
            m.register_forward_pre_hook(self._hook(o))
        self.set_all(self.w2)

    def _hook(self, o: int):
        def pre(_module, args):
            self.routed[o] = args[1].detach().reshape(-1).numpy().astype(np.int64)

        return pre

    def set_all(self, values) -> None:
        import torch

        with torch.no_grad():
            for m, (gu, down) in zip(self.mods, values, strict=True):
                m.gate_up_proj.copy_(gu)
                m.down_proj.copy_(down)

    def apply(self, plan) -> None:
        """A tier plan: evicted pairs back to W2, fetched pairs to FP4."""
        import torch

        with torch.no_grad():
            for keys, values in ((plan.evict_keys, self.w2), (plan.fetch_keys, self.fp4)):
                for k in np.asarray(keys, dtype=np.int64):
                    o, e = divmod(int(k), self.n_experts)
                    self.mods[o].gate_up_proj[e].copy_(values[o][0][e])
                    self.mods[o].down_proj[e].copy_(values[o][1][e])

    def keys(self) -> np.ndarray:
        """Flat keys (layer-major) of the last pass's routing."""
        return np.concatenate([ids + o * self.n_experts for o, ids in enumerate(self.routed)])


def _kernel_experts(module, hidden, top_k_index, top_k_weights):
    """A fused expert module's forward in the kernels' arithmetic, over its current values."""
    from moet_kernels.reference import dense_moe_reference

    out = dense_moe_reference(hidden, top_k_index, top_k_weights, module.gate_up_proj,
                              module.down_proj, mode="kernel")  # fmt: skip
    return out.to(hidden.dtype)


def _teacher_forced(model, tokens: np.ndarray, wins) -> tuple[np.ndarray, np.ndarray]:
    """(argmax int64 [n], next-token NLL float64 [n]) of a whole-window forward per window."""
    import torch

    n = tokens.size - 1
    top, nll = np.empty(n, np.int64), np.empty(n)
    with torch.no_grad():
        for s, w in wins:
            x = torch.from_numpy(tokens[s : s + w + 1].astype(np.int64))[None]
            lp = torch.log_softmax(model(input_ids=x[:, :-1]).logits[0].double(), -1)
            top[s : s + w] = lp.argmax(-1).numpy()
            nll[s : s + w] = -lp.gather(-1, x[0, 1:, None])[:, 0].numpy()
    return top, nll


class _Decisions:
    """Serving's decisions around each pass of one configuration (fp4tier.Fp4Tier): the
    simulation's and `simulate_generation`'s steps."""

    def __init__(self, model, experts: _Experts, cfg: GateConfig):
        n_keys = len(experts.mods) * experts.n_experts
        self.n_slots = int(cfg.pool_share * n_keys)  # as serving sizes fp4_pool="P%": floor
        self.tier = (
            Fp4Tier(
                self.n_slots, len(experts.mods), experts.n_experts,
                max_promotions=cfg.max_promotions, swap_sigmas=cfg.swap_sigmas,
            )
            if self.n_slots
            else None
        )  # fmt: skip
        self.model, self.experts, self.cfg = model, experts, cfg
        experts.set_all(experts.w2)

    def _apply(self, plan) -> None:
        self.experts.apply(plan)
        self.tier.commit(plan)

    def step(self, ids, cache, decode: bool = True, fp4_top: int | None = None):
        """One pass of token ids [1, n] with the KV cache -> (last row's logits, its
        confidence, gated). A prefill (`decode=False`) is one pass that neither gates nor
        changes the pool; a decode step gates when its confidence is below tau (the routed
        pairs into the pool, the step again from the same context: that pass is final), then
        the tier learns the final pass's routing and promotes by heat. `fp4_top`: all-FP4's
        greedy token here (the oracle's). Runs under no_grad."""
        logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        if not decode:
            return logits, None, False
        if self.cfg.metric == ORACLE:
            c = float(int(logits.argmax()) == fp4_top)
        else:
            c = float(confidence(logits, self.cfg.metric))
        routed = self.experts.keys()  # the pass's routing
        self.w2_share = self.tier.w2_share(routed) if self.tier is not None else 1.0
        gated = self.tier is not None and self.tier.gates(c, routed, self.cfg.tau)
        if gated:
            self._apply(self.tier.gate_plan(routed))
            cache.crop(-ids.shape[1])
            logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            logits = logits[0, -1]
            routed = self.experts.keys()  # the replay's, the final pass
        if self.tier is not None:
            self.tier.observe(routed, gated)
            self._apply(self.tier.heat_plan(routed))
        return logits, c, gated

    def done(self) -> None:
        self.experts.set_all(self.experts.w2)  # the model as it came


def _simulate(model, experts: _Experts, tokens, wins, cfg: GateConfig, progress, fp4_top=None):
    """One configuration, token by token (see the module doc); `fp4_top`: all-FP4's
    teacher-forced greedy tokens (the oracle's)."""
    if cfg.metric == ORACLE and fp4_top is None:
        raise ValueError("the oracle gate needs all-FP4's greedy tokens (fp4_top)")
    import torch
    from transformers import DynamicCache

    sim = _Decisions(model, experts, cfg)
    n = tokens.size - 1
    top, nll, conf, share = np.empty(n, np.int64), np.empty(n), np.empty(n), np.empty(n)
    gated = np.zeros(n, bool)
    with torch.no_grad():
        for s, w in wins:
            cache = DynamicCache()
            for t in range(s, s + w):
                x = torch.tensor([[int(tokens[t])]])
                ref = None if fp4_top is None else int(fp4_top[t])
                logits, conf[t], gated[t] = sim.step(x, cache, fp4_top=ref)
                share[t] = sim.w2_share
                lp = torch.log_softmax(logits.double(), -1)
                top[t] = int(lp.argmax())
                nll[t] = -float(lp[int(tokens[t + 1])])
            progress(w)
    sim.done()
    c = sim.tier.counters if sim.tier is not None else None
    return {
        "top": top,
        "nll": nll,
        "conf": conf,
        "w2_share": share,  # of the first pass's routed pairs, outside the pool
        "gated": gated,
        "slots": sim.n_slots,
        "promotions": c.promotions if c else 0,
        "evictions": c.evictions if c else 0,
    }


def simulate_generation(
    model_dir, prompts, max_tokens: int, cfg: GateConfig, mode: str = "exact"
) -> dict:
    """Greedy generation at batch 1 as serving decides it: each prompt (token ids, one request
    after another, the pool kept) prefilled in one pass, then `max_tokens - 1` decode steps
    (the first token comes from the prefill's logits) -> {"tokens": [[...] per prompt],
    "gated": steps gated, "steps": decode steps}. What serving must reproduce: `mode` `exact`
    what it serves with the torch reference (vLLM on CPU), `kernel` what it serves with
    moet-kernels (a GPU; also `compute="oracle"`)."""
    if cfg.metric == ORACLE:
        raise ValueError("the oracle gate is the teacher-forced simulation's alone")
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from moet_quant.quality import quantized_copy

    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    w2_model, _ = quantized_copy(ref, "w2-reference")
    fp4_model, _ = quantized_copy(ref, "fp4r")
    sim = _Decisions(w2_model, _Experts(w2_model, w2_model, fp4_model, mode), cfg)
    out, gated, steps = [], 0, 0
    with torch.no_grad():
        for p in prompts:
            cache = DynamicCache()
            logits, _, _ = sim.step(torch.tensor([list(p)]), cache, decode=False)
            toks = [int(logits.argmax())]
            for _ in range(max_tokens - 1):
                logits, _, g = sim.step(torch.tensor([[toks[-1]]]), cache)
                toks.append(int(logits.argmax()))
                gated, steps = gated + g, steps + 1
            out.append(toks)
    return {"tokens": out, "gated": gated, "steps": steps}


def evaluate_gate(model_dir, tokens: np.ndarray, configs, opts: SimOptions | None = None) -> dict:
    """Every configuration of `configs` over `tokens` (see the module doc) -> the report."""
    import torch
    from transformers import AutoModelForCausalLM

    from moet_quant.progress import progress_bar
    from moet_quant.quality import bootstrap, quantized_copy, run_header, windows_of

    opts = opts or SimOptions()
    t0 = time.time()
    tokens = np.asarray(tokens)
    if opts.max_tokens:
        tokens = tokens[: opts.max_tokens + 1]
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    w2_model, _ = quantized_copy(ref, "w2-reference")
    fp4_model, _ = quantized_copy(ref, "fp4r")
    wins = windows_of(tokens.size, opts.window)
    n = tokens.size - 1
    ends = np.cumsum([w for _, w in wins])
    window_of = np.searchsorted(ends, np.arange(n), side="right")
    count = np.array([w for _, w in wins], dtype=np.float64)

    def per_window(x: np.ndarray) -> np.ndarray:
        return np.bincount(window_of, weights=x, minlength=len(wins))

    bf16_top, bf16_nll = _teacher_forced(ref, tokens, wins)
    fp4_top, fp4_nll = _teacher_forced(fp4_model, tokens, wins)
    sim_model = w2_model  # its experts are switched pair by pair
    experts = _Experts(sim_model, w2_model, fp4_model)
    rows = {}
    with progress_bar(n * len(configs), "gate simulation", opts.progress, unit="tok") as bar:
        for cfg in configs:
            r = _simulate(sim_model, experts, tokens, wins, cfg, bar.update, fp4_top)
            diff = per_window(r["nll"] - bf16_nll)
            rows[cfg.name] = {
                "pool_share": cfg.pool_share,
                "slots": r["slots"],
                "tau": cfg.tau,
                "metric": cfg.metric,
                "max_promotions": cfg.max_promotions,
                "swap_sigmas": cfg.swap_sigmas,
                "loss": float(r["nll"].mean()),
                "vs_bf16": bootstrap(diff, count, opts.n_boot, opts.seed),
                "agreement_bf16": float(np.mean(r["top"] == bf16_top)),
                "agreement_fp4": float(np.mean(r["top"] == fp4_top)),
                "gated_pct": float(100 * r["gated"].mean()),
                "promotions_per_step": r["promotions"] / n,
                "evictions_per_step": r["evictions"] / n,
                "confidence_median": float(np.median(r["conf"])),
            }
    return {
        **run_header(model_dir, n, len(wins), opts),
        **opts.extra,
        "bf16_loss": float(bf16_nll.mean()),
        "all_fp4": {
            "loss": float(fp4_nll.mean()),
            "vs_bf16": bootstrap(per_window(fp4_nll - bf16_nll), count, opts.n_boot, opts.seed),
            "agreement_bf16": float(np.mean(fp4_top == bf16_top)),
        },
        "configs": rows,
        "seconds": time.time() - t0,
    }


def tau_label(row: dict) -> str:
    """A report row's gate: "0.5 margin", or "oracle"."""
    return ORACLE if row["metric"] == ORACLE else f"{row['tau']:g} {row['metric']}"


def format_table(report: dict) -> str:
    lines = [
        f"{report['tokens']} tokens, {report['windows']} windows of {report['window']}; bf16 loss "
        f"{report['bf16_loss']:.4f} (ppl {math.exp(report['bf16_loss']):.2f}); all-FP4 "
        f"{report['all_fp4']['vs_bf16']['mean']:+.4f} nats, agreement with bf16 "
        f"{report['all_fp4']['agreement_bf16']:.3f}",
        "",
        "| FP4 pool | tau | heat swap margin (sd) | loss vs bf16 [95% CI] | agree bf16 | agree all-FP4 "
        "| gated % of steps | promotions / evictions per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["configs"].values():  # (reports before swap_sigmas swapped at any margin)
        d = r["vs_bf16"]
        lines.append(
            f"| {100 * r['pool_share']:g}% ({r['slots']}) | {tau_label(r)} | "
            f"{r.get('swap_sigmas', 0.0):g} | {d['mean']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}] | "
            f"{r['agreement_bf16']:.3f} | {r['agreement_fp4']:.3f} | {r['gated_pct']:.1f} | "
            f"{r['promotions_per_step']:.2f} / {r['evictions_per_step']:.2f} |"
        )
    return "\n".join(lines)
