"""The policy variants tried against the 1.5x-of-Belady target (bench/residency.py --tune;
docs/residency-design.md, "What was tried"). None of them is served: they stay here, measured.

- ``decay+pf``: decayed frequency that also prefetches on replay steps (simulate.py).
- ``thresh``: a key routed at least twice lately (decayed count >= 1.5 at half-life 32) ranks
  by that count, every other key by its long-run rate (half-life 2048): a first routing of a rare
  expert no longer outranks a steady one.
- ``sum``: decayed count (half-life 32) plus the long-run rate (half-life 2048) in the same unit.
- ``mix``: a mixture of the rates at half-lives 4, 32, 256 and 2048 steps whose weights are
  learned online (EM on the next step's routings: the mixture that predicted them best).
- ``oracle`` (synthetic traces only): knows the generator's hidden state, so each key's chance of
  being routed by the next step's tokens; evicts the least likely. Not an online policy one can
  build: what learning the routing perfectly would give.

The ``+pf`` forms prefetch on replay steps (``PREFETCH`` rows) in their own order.
"""

from __future__ import annotations

import numpy as np

from moet_vllm.planning import simulate as sim
from moet_vllm.planning import traces
from moet_vllm.residency.policy import ResidencyPolicy, lowest

PREFETCH = 16
SEED = 0


class Scored(sim.PrefetchOnReplay, ResidencyPolicy):
    """A victim order by ``self.rank_score`` (lowest first), then recency; prefetch in it."""

    def __init__(self, n_slots, moe_layers, n_experts, prefetch=0):
        super().__init__(n_slots, moe_layers, n_experts, predict_threshold=0.0)
        self.prefetch = prefetch
        self.rank_score = np.zeros(self.n_keys)

    def _victims(self, cands, n):
        return lowest(cands, n, self.rank_score, self.last_use)

    def _rank(self):
        return (self.rank_score, self.last_use)

    def _prefetchable(self):
        return self.rank_score > 0


class Combo(Scored):
    def __init__(self, n_slots, moe_layers, n_experts, mode, prefetch=0, slow_hl=2048.0):
        super().__init__(n_slots, moe_layers, n_experts, prefetch)
        self.mode = mode
        self.slow = np.zeros(self.n_keys)
        self.sdecay = 2.0 ** (-1.0 / slow_hl)

    def observe(self, routed):
        routed = np.asarray(routed, dtype=np.int64).ravel()
        self.slow *= self.sdecay
        self.slow += np.bincount(routed, minlength=self.n_keys)
        super().observe(routed)
        # the long-run rate in the unit of the fast score (its steady state: rate / (1 - decay))
        slow = self.slow * (1 - self.sdecay) / (1 - self.decay)
        if self.mode == "thresh":
            self.rank_score = np.where(self.score >= 1.5, self.score + 1e6, slow)
        else:
            self.rank_score = self.score + slow


class Mix(Scored):
    def __init__(self, n_slots, moe_layers, n_experts, prefetch=0, eta=0.01):
        super().__init__(n_slots, moe_layers, n_experts, prefetch)
        self.hls = np.array([4.0, 32.0, 256.0, 2048.0])
        self.d = 2.0 ** (-1.0 / self.hls)
        self.f = np.zeros((len(self.hls), self.n_keys))
        self.w = np.full(len(self.hls) + 1, 1.0 / (len(self.hls) + 1))
        self.eta = eta
        self.floor = 1e-3 / self.n_keys
        self.t = 0

    def rates(self):
        norm = (1 - self.d) / np.maximum(1 - self.d ** max(self.t, 1), 1e-12)
        return self.f * norm[:, None]

    def observe(self, routed):
        routed = np.asarray(routed, dtype=np.int64).ravel()
        u = np.unique(routed)
        if self.t > 0:  # EM on the mixture weights: how well each rate predicted this step
            comp = np.vstack([self.rates()[:, u], np.full((1, len(u)), self.floor)])
            comp *= self.w[:, None]
            self.w = (1 - self.eta) * self.w + self.eta * (comp / comp.sum(0)).mean(1)
        self.f *= self.d[:, None]
        self.f[:, u] += 1.0
        self.t += 1
        super().observe(routed)
        self.rank_score = self.w[:-1] @ self.rates() + self.w[-1] * self.floor


class Oracle(Scored):
    def __init__(self, n_slots, moe_layers, n_experts, state, top_k, step_tokens, prefetch=0):
        super().__init__(n_slots, moe_layers, n_experts, prefetch)
        self.state, self.top_k, self.step_tokens = state, top_k, step_tokens

    def plan(self, routed, scan=None):
        # the chance that the step's tokens route each key (the state of the current step's
        # tokens: a phrase or topic may end before the next step, which only the draw shows)
        miss = np.ones(self.n_keys)
        for tok in self.step_tokens[self.steps]:
            w = self.state.weights(int(tok)).astype(np.float64)
            q = (w / w.sum(axis=1, keepdims=True)).ravel()
            miss *= (1 - q) ** self.top_k
        self.rank_score = 1 - miss
        return super().plan(routed, scan)


def run_all(name: str, tr: dict, steps: np.ndarray, n_slots: int, kw: dict, batch: int) -> dict:
    E, L = tr["E"], tr["layers"]

    def run(pol, label):
        return sim.simulate(pol, steps, name=label, **kw).as_dict()

    out = {
        "decay+pf": run(
            sim.DecayPrefetchPolicy(n_slots, L, E, prefetch=PREFETCH, predict_threshold=0.0),
            "decay+pf",
        ),
    }
    for mode in ("thresh", "sum"):
        out[mode] = run(Combo(n_slots, L, E, mode), mode)
    out["mix"] = run(Mix(n_slots, L, E), "mix")
    out["mix+pf"] = run(Mix(n_slots, L, E, PREFETCH), "mix+pf")
    if tr["tokens"] is None:  # a synthetic trace: its hidden state is known
        out.update(oracles(name, tr, steps, n_slots, kw, batch))
    return out


def oracles(name: str, tr: dict, steps: np.ndarray, n_slots: int, kw: dict, batch: int) -> dict:
    """``oracle`` and ``oracle+pf`` on a synthetic trace: what an online policy that learned the
    routing perfectly (the generator's hidden state) would replay."""
    prof = traces.PROFILES[name]
    state = traces.synthetic_state(prof, len(tr["ids"]), SEED)
    n = len(tr["ids"]) // batch
    tok = np.arange(n)[:, None] + np.arange(batch)[None, :] * n
    E, L = tr["E"], tr["layers"]
    return {
        label: sim.simulate(Oracle(n_slots, L, E, state, prof.top_k, tok, pf), steps, name=label,
                            **kw).as_dict()
        for label, pf in (("oracle", 0), ("oracle+pf", PREFETCH))
    }  # fmt: skip
