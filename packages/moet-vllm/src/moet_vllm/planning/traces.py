"""Routing traces: the file format, coverage curves and seeded synthetic traces.

A trace (design.md, "Routing traces") is ``.npy`` uint16 ``[tokens, moe_layers, top_k]`` of routed
expert ids with a JSON sidecar ``{model, E, top_k, moe_layer_ids, split, source}`` next to it
(``x.npy`` + ``x.json``).

Synthetic traces (:func:`synthetic_trace`) are shaped to a published coverage point: the share of
routings served by the hottest share of (moe_layer, expert) pairs (:func:`coverage`), ~19% of
experts serving ~96% of routings for DeepSeek-V4-Flash and ~51% serving ~91% for GLM-5.2. The
generative model, per MoE layer ``l`` (every random draw from one ``numpy`` generator and seed):

1. **Popularity.** Expert ranks are a random permutation; the expert of rank ``r`` (0-based) has
   weight ``(r + 1) ** -alpha_l`` (a power law), ``alpha_l = alpha * s_l`` with ``s_l`` log-normal
   (sigma ``layer_spread``, geometric mean 1): some layers route almost uniformly, others to a
   few experts. ``alpha`` is calibrated (:func:`calibrate_alpha`) so that the whole trace hits the
   profile's coverage point; the calibrated value is stored in the profile.
2. **Topics.** The token stream is cut into topics of geometric length (mean ``topic_tokens``). A
   topic draws, per layer, a set of ``topic_experts`` experts from the popularity (without
   replacement): the experts this stretch of text prefers.
3. **Phrases.** Inside it, phrases of geometric length (mean ``phrase_tokens``) draw a smaller set
   of ``phrase_experts`` per layer from the topic's distribution: short-range reuse between
   consecutive tokens.
4. **Routing.** A token's distribution over experts is the mixture ``(1 - wt - wp) * popularity +
   wt * topic + wp * phrase`` (uniform over each set); its ``top_k`` distinct experts are drawn
   without replacement (exponential races, i.e. Gumbel top-k), as a router picks k distinct
   experts.

Topic and phrase boundaries are shared by all layers (a change of subject moves every layer at
once). :func:`adjacent_overlap` measures the short-range locality this gives (the share of a
token's experts the previous token also routed, per layer).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

# -- the file format ----------------------------------------------------------------------------


def save_trace(path: str | Path, ids: np.ndarray, meta: dict) -> Path:
    """Write ``ids`` (uint16 [tokens, moe_layers, top_k]) to ``path`` (.npy) and its sidecar."""
    path = Path(path).with_suffix(".npy")
    ids = np.asarray(ids)
    check_trace(ids, meta)
    np.save(path, ids.astype(np.uint16), allow_pickle=False)
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    return path


def load_trace(path: str | Path) -> tuple[np.ndarray, dict]:
    """Read a trace and its sidecar; checked against each other."""
    path = Path(path).with_suffix(".npy")
    ids = np.load(path, allow_pickle=False)
    meta = json.loads(path.with_suffix(".json").read_text())
    check_trace(ids, meta)
    return ids, meta


def check_trace(ids: np.ndarray, meta: dict) -> None:
    missing = {"model", "E", "top_k", "moe_layer_ids", "split", "source"} - set(meta)
    if missing:
        raise ValueError(f"trace sidecar lacks {sorted(missing)}")
    if ids.ndim != 3 or ids.shape[2] != meta["top_k"] or ids.shape[1] != len(meta["moe_layer_ids"]):
        raise ValueError(
            f"trace shape {ids.shape} does not match the sidecar (moe_layers "
            f"{len(meta['moe_layer_ids'])}, top_k {meta['top_k']})"
        )
    if ids.size and int(ids.max()) >= meta["E"]:
        raise ValueError(f"trace routes expert {int(ids.max())} but E is {meta['E']}")


# -- coverage -------------------------------------------------------------------------------------


def key_counts(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """Routings per (moe_layer, expert) pair: int64 [moe_layers * n_experts] (flat key ids)."""
    _, n_layers, _ = ids.shape
    flat = np.arange(n_layers, dtype=np.int64)[None, :, None] * n_experts + ids.astype(np.int64)
    return np.bincount(flat.ravel(), minlength=n_layers * n_experts)


def coverage(ids: np.ndarray, n_experts: int, fractions) -> np.ndarray:
    """Share of routings served by the hottest ``fractions`` of all (moe_layer, expert) pairs.

    Pairs of every layer are ranked together (one pool serves all layers); ``round(x * pairs)``
    of the hottest are taken. Returns float64 of the shape of ``fractions``.
    """
    counts = np.sort(key_counts(ids, n_experts))[::-1]
    cum = np.concatenate([[0], np.cumsum(counts)])
    x = np.asarray(fractions, dtype=np.float64)
    if np.any((x < 0) | (x > 1)):
        raise ValueError("fractions must be in [0, 1]")
    n = np.rint(x * len(counts)).astype(np.int64)
    return cum[n] / max(cum[-1], 1)


def adjacent_overlap(ids: np.ndarray) -> float:
    """Mean share of a token's routed experts (per layer) that the previous token also routed."""
    if len(ids) < 2:
        return 0.0
    a = np.sort(ids[1:].astype(np.int64), axis=2)
    b = np.sort(ids[:-1].astype(np.int64), axis=2)
    hits = (a[..., :, None] == b[..., None, :]).any(axis=3)
    return float(hits.mean())


# -- synthetic traces ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceProfile:
    """A model's geometry and the knobs of the synthetic generator (see the module doc)."""

    model: str
    moe_layers: int
    n_experts: int
    top_k: int
    hidden: int
    moe_intermediate: int
    target: tuple[float, float]  # (share of pairs, share of routings they serve)
    alpha: float  # calibrated power-law exponent (calibrate_alpha)
    layer_spread: float = 0.3
    topic_tokens: float = 512.0
    topic_experts: int = 32
    topic_weight: float = 0.3
    phrase_tokens: float = 12.0
    phrase_experts: int = 8
    phrase_weight: float = 0.25

    @property
    def slot_bytes(self) -> int:
        """Bytes of one expert's W2 row: w13 and w2 codes (2 bits) and UE8M0 scales per 32."""
        weights = 3 * self.hidden * self.moe_intermediate
        return weights // 4 + weights // 32

    def meta(self, tokens: int, seed: int) -> dict:
        return {
            "model": self.model,
            "E": self.n_experts,
            "top_k": self.top_k,
            "moe_layer_ids": list(range(self.moe_layers)),
            "split": "decode",
            "source": f"synthetic seed={seed} tokens={tokens} {json.dumps(asdict(self))}",
        }


#: DeepSeek-V4-Flash: 43 MoE layers, 256 routed experts, top-6, hidden 4096, expert width 2048.
DEEPSEEK_V4_FLASH = TraceProfile(
    model="deepseek-v4-flash (synthetic)",
    moe_layers=43,
    n_experts=256,
    top_k=6,
    hidden=4096,
    moe_intermediate=2048,
    target=(0.19, 0.96),
    alpha=3.087,  # calibrate_alpha(DEEPSEEK_V4_FLASH, 8192, 0): coverage 0.958 at 19%
)
#: GLM-5.2, GLM-5's geometry: 75 MoE layers, 256 routed experts, top-8, hidden 6144, width 2048.
GLM_5_2 = TraceProfile(
    model="glm-5.2 (synthetic)",
    moe_layers=75,
    n_experts=256,
    top_k=8,
    hidden=6144,
    moe_intermediate=2048,
    target=(0.51, 0.91),
    alpha=1.031,  # calibrate_alpha(GLM_5_2, 8192, 0): coverage 0.909 at 51%
)
PROFILES = {"deepseek-v4-flash": DEEPSEEK_V4_FLASH, "glm-5.2": GLM_5_2}


def _segments(rng: np.random.Generator, tokens: int, mean: float) -> np.ndarray:
    """Segment index of each token; segment lengths geometric with the given mean."""
    starts = np.zeros(tokens, dtype=bool)
    starts[0] = True
    starts[1:] = rng.random(tokens - 1) < 1.0 / mean
    return np.cumsum(starts) - 1


def _top(rng: np.random.Generator, weights: np.ndarray, size: int) -> np.ndarray:
    """Per row of ``weights`` [..., E] (positive), ``size`` distinct indices drawn without
    replacement with probability proportional to the weights (exponential races: the smallest
    ``Exp(1) / w``, which is the Gumbel top-k trick without logarithms)."""
    race = rng.standard_exponential(size=weights.shape, dtype=np.float32) / weights
    return np.argpartition(race, size - 1, axis=-1)[..., :size]


def _set_weights(top: np.ndarray, n_experts: int) -> np.ndarray:
    """Uniform distributions over the index sets ``top`` [..., size]: float32 [..., n_experts]."""
    out = np.zeros((*top.shape[:-1], n_experts), dtype=np.float32)
    np.put_along_axis(out, top, np.float32(1.0 / top.shape[-1]), axis=-1)
    return out


@dataclass(frozen=True)
class SyntheticState:
    """The hidden state of a synthetic trace: what an online policy could at best know about the
    next token (:func:`synthetic_state`). Token ``t`` routes its ``top_k`` distinct experts of each
    layer as a Plackett-Luce draw (without replacement) from :meth:`weights` ``(t)``."""

    q_topic: np.ndarray  # float32 [topics, moe_layers, E]: popularity and topic set, mixed
    topic: np.ndarray  # int64 [tokens]: topic of each token
    phrase: np.ndarray  # int64 [tokens]: phrase of each token
    phrase_sets: np.ndarray  # int64 [phrases, moe_layers, phrase_experts]
    phrase_weight: float  # added to each phrase expert's weight (phrase_weight / phrase_experts)

    def weights(self, t: int) -> np.ndarray:
        """float32 [moe_layers, E]: the (unnormalized) routing weights of token ``t``."""
        q = self.q_topic[self.topic[t]].copy()
        idx = self.phrase_sets[self.phrase[t]]
        np.put_along_axis(q, idx, np.take_along_axis(q, idx, axis=-1) + self.phrase_weight, -1)
        return q


def _generate(
    profile: TraceProfile, tokens: int, seed: int, alpha: float | None, chunk: int
) -> tuple[SyntheticState, np.random.Generator]:
    """The hidden state of a trace and the generator, positioned for the routing draws."""
    p = profile
    alpha = p.alpha if alpha is None else alpha
    rng = np.random.default_rng(seed)
    L, E = p.moe_layers, p.n_experts
    spread = rng.lognormal(0.0, p.layer_spread, size=L)
    spread /= np.exp(np.log(spread).mean())
    rank_w = np.log(np.arange(1, E + 1, dtype=np.float64))[None, :] * -(alpha * spread[:, None])
    pop = np.empty((L, E))
    for layer in range(L):
        pop[layer, rng.permutation(E)] = np.exp(rank_w[layer])
    pop /= pop.sum(axis=1, keepdims=True)
    pop = np.maximum(pop, 1e-30).astype(np.float32)

    topic = _segments(rng, tokens, p.topic_tokens)
    phrase = _segments(rng, tokens, p.phrase_tokens)
    n_topics, n_phrases = topic[-1] + 1, phrase[-1] + 1
    topic_sets = _top(rng, np.broadcast_to(pop, (n_topics, L, E)), p.topic_experts)
    # a phrase draws its set from its topic's distribution (popularity and topic set mixed)
    phrase_topic = np.zeros(n_phrases, dtype=np.int64)
    phrase_topic[phrase] = topic
    w_pop = np.float32(1.0 - p.topic_weight - p.phrase_weight)
    w_topic = np.float32(p.topic_weight)
    phrase_sets = np.empty((n_phrases, L, p.phrase_experts), dtype=np.int64)
    for a in range(0, n_phrases, chunk):
        b = min(n_phrases, a + chunk)
        within = w_pop * pop + w_topic * _set_weights(topic_sets[phrase_topic[a:b]], E)
        phrase_sets[a:b] = _top(rng, within, p.phrase_experts)

    q_topic = w_pop * pop + w_topic * _set_weights(topic_sets, E)
    w_set = np.float32(p.phrase_weight / p.phrase_experts)
    return SyntheticState(q_topic, topic, phrase, phrase_sets, w_set), rng


def synthetic_trace(
    profile: TraceProfile, tokens: int, seed: int, *, alpha: float | None = None, chunk: int = 256
) -> np.ndarray:
    """uint16 [tokens, moe_layers, top_k] routed expert ids (each row sorted), seeded."""
    st, rng = _generate(profile, tokens, seed, alpha, chunk)
    out = np.empty((tokens, profile.moe_layers, profile.top_k), dtype=np.uint16)
    for a in range(0, tokens, chunk):
        b = min(tokens, a + chunk)
        q = st.q_topic[st.topic[a:b]]
        idx = st.phrase_sets[st.phrase[a:b]]
        np.put_along_axis(q, idx, np.take_along_axis(q, idx, axis=-1) + st.phrase_weight, axis=-1)
        out[a:b] = np.sort(_top(rng, q, profile.top_k), axis=-1)
    return out


def synthetic_state(
    profile: TraceProfile, tokens: int, seed: int, *, alpha: float | None = None, chunk: int = 256
) -> SyntheticState:
    """The hidden state behind ``synthetic_trace(profile, tokens, seed)``: each token's routing
    weights (the topic and phrase it belongs to). No online policy can know more about the next
    token; :func:`~moet_vllm.planning.simulate.online_clean_bound` turns it into a bound."""
    return _generate(profile, tokens, seed, alpha, chunk)[0]


def calibrate_alpha(
    profile: TraceProfile,
    tokens: int,
    seed: int,
    *,
    lo: float = 0.0,
    hi: float = 4.0,
    iters: int = 14,
) -> float:
    """The ``alpha`` at which a ``tokens``-long trace of ``profile`` hits its coverage point
    (bisection: coverage grows with alpha)."""
    x, y = profile.target
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        got = coverage(synthetic_trace(profile, tokens, seed, alpha=mid), profile.n_experts, x)
        lo, hi = (mid, hi) if got < y else (lo, mid)
    return 0.5 * (lo + hi)


def with_alpha(profile: TraceProfile, alpha: float) -> TraceProfile:
    return replace(profile, alpha=alpha)
