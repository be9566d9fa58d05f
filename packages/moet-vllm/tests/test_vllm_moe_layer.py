"""One MoE layer of the plugin (in-process, no engine): routing equals vLLM's own CPU router, and
the layer output equals a float64 reference (moet-quant's numpy dequantization, float64 routing
and SwiGLU) for random weights and logits, decode and prefill shapes."""

from __future__ import annotations

import enum
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.model_executor.layers.fused_moe.router import cpu_router  # noqa: E402

from moet_kernels.reference import Routing, route_reference  # noqa: E402
from moet_quant import w2  # noqa: E402
from moet_vllm.compat import MoetVllmError  # noqa: E402
from moet_vllm.method import MoetMoEMethod, routing_of  # noqa: E402

E, H, INTER = 16, 64, 32
ROUTINGS = {  # the layer attributes vLLM sets, per model family
    "qwen3": dict(scoring_func="softmax", renormalize=True, use_grouped_topk=False),
    "mixtral-no-renorm": dict(scoring_func="softmax", renormalize=False, use_grouped_topk=False),
    "glm45": dict(
        scoring_func="sigmoid",
        renormalize=True,
        use_grouped_topk=True,
        num_expert_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        bias=True,
    ),
    "deepseek-v3": dict(
        scoring_func="sigmoid",
        renormalize=True,
        use_grouped_topk=True,
        num_expert_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        bias=True,
    ),
}


class Act(enum.Enum):
    SILU = "silu"
    GELU = "gelu"


class Layer(SimpleNamespace):
    """What apply_monolithic reads of a vLLM MoE layer (weakly referable, as a module is: the
    reference op finds its layer by name through a weak reference)."""


def make_layer(kind: str, rng: np.random.Generator, top_k: int = 4, **over) -> Layer:
    attrs = dict(ROUTINGS[kind])
    bias = attrs.pop("bias", False)
    layer = Layer(
        layer_name=f"model.layers.1.mlp.experts[{kind}]",
        moe_config=SimpleNamespace(activation=Act.SILU, has_hash_routing=False, has_bias=False),
        top_k=top_k,
        num_expert_group=None,
        topk_group=None,
        routed_scaling_factor=1.0,
        custom_routing_function=None,
        apply_router_weight_on_input=False,
        swiglu_limit=None,
        expert_map=None,
        e_score_correction_bias=(
            torch.from_numpy(rng.standard_normal(E).astype(np.float32) * 0.1) if bias else None
        ),
        w13_w2_codes=torch.from_numpy(rng.integers(0, 256, (E, 2 * INTER, H // 4), np.uint8)),
        w13_w2_scales=torch.from_numpy(rng.integers(121, 126, (E, 2 * INTER, H // 32), np.uint8)),
        w2_w2_codes=torch.from_numpy(rng.integers(0, 256, (E, H, INTER // 4), np.uint8)),
        w2_w2_scales=torch.from_numpy(rng.integers(121, 126, (E, H, INTER // 32), np.uint8)),
    )
    for k, v in {**attrs, **over}.items():
        setattr(layer, k, v)
    return layer


def vllm_route(layer, logits):
    """vLLM 0.32's CPU router functions with the same layer attributes."""
    if layer.use_grouped_topk:
        return cpu_router._grouped_topk(
            logits,
            layer.top_k,
            layer.renormalize,
            layer.num_expert_group,
            layer.topk_group,
            layer.scoring_func,
            layer.routed_scaling_factor,
            layer.e_score_correction_bias,
        )
    return cpu_router._softmax_topk(logits, layer.top_k, layer.renormalize)


@pytest.mark.parametrize("kind", ROUTINGS)
def test_routing_equals_vllms_cpu_router(kind):
    rng = np.random.default_rng(1)
    layer = make_layer(kind, rng)
    logits = torch.from_numpy(rng.standard_normal((37, E)).astype(np.float32))
    w, ids = route_reference(logits, routing_of(layer), layer.e_score_correction_bias)
    vw, vids = vllm_route(layer, logits)
    order, vorder = ids.argsort(dim=1), vids.long().argsort(dim=1)  # vLLM leaves top-k unsorted
    assert torch.equal(ids.gather(1, order), vids.long().gather(1, vorder))
    torch.testing.assert_close(w.gather(1, order), vw.gather(1, vorder), rtol=1e-6, atol=0)


def float64_layer(layer, x: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    bias = layer.e_score_correction_bias
    weights, ids = route_reference(
        torch.from_numpy(logits), routing_of(layer), None if bias is None else bias.double()
    )
    weights, ids = weights.numpy(), ids.numpy()
    out = np.zeros((x.shape[0], H))
    for e in np.unique(ids):
        w13 = w2.dequantize(layer.w13_w2_codes[e].numpy(), layer.w13_w2_scales[e].numpy())
        w_down = w2.dequantize(layer.w2_w2_codes[e].numpy(), layer.w2_w2_scales[e].numpy())
        tok, slot = np.nonzero(ids == e)
        gate_up = x[tok] @ w13.T
        act = gate_up[:, :INTER] / (1 + np.exp(-gate_up[:, :INTER])) * gate_up[:, INTER:]
        out[tok] += weights[tok, slot][:, None] * (act @ w_down.T)
    return out, ids


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("tokens", [1, 2, 8, 100, 300])  # decode batches, then prefill chunks
def test_layer_output_matches_float64_reference(kind, tokens):
    rng = np.random.default_rng(tokens)
    layer = make_layer(kind, rng)
    x = rng.standard_normal((tokens, H))
    logits = rng.standard_normal((tokens, E)) * 2
    method = object.__new__(MoetMoEMethod)  # no engine in-process: only what apply needs
    method.routing = routing_of(layer)
    got = method.apply_monolithic(
        layer, torch.from_numpy(x).float(), torch.from_numpy(logits).float()
    )
    assert got.dtype == torch.float32 and tuple(got.shape) == (tokens, H)
    want, want_ids = float64_layer(layer, x, logits)
    _, ids = route_reference(
        torch.from_numpy(logits).float(), method.routing, layer.e_score_correction_bias
    )
    np.testing.assert_array_equal(ids.numpy(), want_ids)  # the same experts were chosen
    # float32 activations and accumulation against float64: stated tolerance 1e-5 of the
    # output's largest magnitude (measured worst case over these cases: 5.0e-7)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_what_moet_cannot_route_is_refused_at_load():
    rng = np.random.default_rng(0)
    cases = {
        "a custom routing function": dict(custom_routing_function=lambda *a: None),
        "router weights applied on the input": dict(apply_router_weight_on_input=True),
        "a clamped SwiGLU": dict(swiglu_limit=7.0),
        "expert parallelism": dict(expert_map=torch.arange(E)),
    }
    for what, over in cases.items():
        with pytest.raises(MoetVllmError, match=f"does not support {what}.*supported: softmax"):
            routing_of(make_layer("qwen3", rng, **over))
    gelu = make_layer("qwen3", rng)
    gelu.moe_config.activation = Act.GELU
    with pytest.raises(MoetVllmError, match="activation 'gelu'"):
        routing_of(gelu)
    assert routing_of(make_layer("deepseek-v3", rng)) == Routing(
        top_k=4, scoring="sigmoid", renormalize=True, n_group=4, topk_group=2, scaling=2.5
    )
