"""route_reference against a float64 per-token loop written from the routing rules."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moet_kernels.reference import Routing, route_reference


def spec_route(logits: np.ndarray, r: Routing, bias: np.ndarray | None):
    """One token at a time, in float64, with plain Python sorting (ties: lower id first)."""
    t, e = logits.shape
    size = e // r.n_group
    all_w, all_ids = [], []
    for row in logits:
        if r.scoring == "softmax":
            ex = [math.exp(v - max(row)) for v in row]
            scores = [v / sum(ex) for v in ex]
        else:
            scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        sel = [s + (0.0 if bias is None else float(bias[i])) for i, s in enumerate(scores)]
        allowed = set(range(e))
        if r.n_group > 1:
            best = [sorted(sel[g * size : (g + 1) * size], reverse=True) for g in range(r.n_group)]
            group_score = [m[0] if bias is None else m[0] + m[1] for m in best]
            groups = sorted(range(r.n_group), key=lambda g: (-group_score[g], g))[: r.topk_group]
            allowed = {i for g in groups for i in range(g * size, (g + 1) * size)}
        ids = sorted(allowed, key=lambda i: (-sel[i], i))[: r.top_k]
        w = [scores[i] for i in ids]
        if r.renormalize:
            w = [v / sum(w) for v in w]
        all_w.append([v * r.scaling for v in w])
        all_ids.append(ids)
    return np.array(all_w), np.array(all_ids)


CASES = [
    Routing(top_k=2),  # Mixtral
    Routing(top_k=4, renormalize=True),  # Qwen3 norm_topk_prob
    Routing(top_k=4, renormalize=False),
    Routing(top_k=4, scoring="sigmoid", scaling=1.5),  # GLM-4.5 (one group)
    Routing(top_k=4, scoring="sigmoid", n_group=4, topk_group=2, scaling=2.5),  # DeepSeek-V3
    Routing(top_k=3, scoring="softmax", n_group=4, topk_group=1),
]


@pytest.mark.parametrize("routing", CASES, ids=repr)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_route_matches_float64_loop(routing, with_bias, tokens):
    rng = np.random.default_rng(tokens * 31 + routing.top_k)
    e = 16
    logits = rng.standard_normal((tokens, e)) * 2
    bias = rng.standard_normal(e) * 0.1 if with_bias else None
    want_w, want_ids = spec_route(logits, routing, bias)
    # float64 logits: the oracle precision; the selection must be identical
    w64, ids64 = route_reference(
        torch.from_numpy(logits), routing, None if bias is None else torch.from_numpy(bias)
    )
    assert ids64.dtype == torch.int64 and w64.dtype == torch.float64
    np.testing.assert_array_equal(ids64.numpy(), want_ids)
    np.testing.assert_allclose(w64.numpy(), want_w, rtol=1e-12)
    # float32 logits: the serving precision; same experts on these well-separated scores
    w32, ids32 = route_reference(
        torch.from_numpy(logits).float(),
        routing,
        None if bias is None else torch.from_numpy(bias).float(),
    )
    assert w32.dtype == torch.float32
    np.testing.assert_array_equal(ids32.numpy(), want_ids)
    np.testing.assert_allclose(w32.numpy(), want_w, rtol=1e-5)


def test_ties_go_to_the_lower_expert_id():
    logits = torch.zeros(3, 8)
    _, ids = route_reference(logits, Routing(top_k=3))
    assert ids.tolist() == [[0, 1, 2]] * 3
    _, ids = route_reference(logits, Routing(top_k=2, scoring="sigmoid", n_group=4, topk_group=2))
    assert ids.tolist() == [[0, 1]] * 3


def test_bias_steers_selection_but_not_weights():
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    w, ids = route_reference(logits, Routing(top_k=1, scoring="sigmoid", renormalize=False), bias)
    assert ids.tolist() == [[0]]
    assert w.item() == pytest.approx(0.5)  # sigmoid(0), not sigmoid(0) + 10


def test_bad_routings_are_refused():
    with pytest.raises(ValueError, match="scoring"):
        Routing(top_k=2, scoring="relu")
    with pytest.raises(ValueError, match="topk_group"):
        Routing(top_k=2, n_group=2, topk_group=3)
    with pytest.raises(ValueError, match="do not fit"):
        route_reference(torch.zeros(1, 6), Routing(top_k=2, n_group=4, topk_group=1))
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        route_reference(torch.zeros(6), Routing(top_k=2))


def test_select_experts_off_the_gpu_is_the_reference_with_int32_ids():
    """ops.select_experts where the select kernel cannot run: route_reference itself, ids as the
    kernels read them (int32); shapes the kernel could not take are refused by name."""
    from moet_kernels.ops import select_experts

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(64, generator=gen)
    r = Routing(top_k=6, scoring="sigmoid", n_group=8, topk_group=3, scaling=2.5)
    weights, ids = select_experts(logits, r, bias)
    ref_w, ref_ids = route_reference(logits, r, bias)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ref_ids)
    assert torch.equal(weights, ref_w)
    with pytest.raises(ValueError, match="at most 32 equal groups"):
        select_experts(torch.zeros(1, 128), Routing(top_k=2, n_group=64), None)
    with pytest.raises(ValueError, match=r"correction bias must be \[64\]"):
        select_experts(logits, r, bias[:32])
    with pytest.raises(ValueError, match="float64"):
        select_experts(logits.double(), r, bias)
