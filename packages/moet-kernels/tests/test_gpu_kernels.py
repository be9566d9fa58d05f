"""The kernels on a CUDA GPU against the float64 references (marker `gpu`; design.md, Kernels).

    pytest -m gpu packages/moet-kernels/tests/test_gpu_kernels.py

One test per case of `moet_kernels.testing.VALIDATION_CASES` (what each checks:
`moet_kernels.testing.validate_case`, docs/kernels.md "Validation"), plus the refinement tier's
expansion on the GPU and the select kernel (expert selection) per family's routing. CI has no GPU and deselects the marker (`-m "not gpu"`); on a machine
that runs them, nothing here skips: no CUDA device or kernels that cannot load is a failure.

Inputs are fresh each run: the run's seed comes from os.urandom, or from GPU_TEST_SEED to
reproduce a failure (every failure message names it); each case draws from (seed, case id).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from moet_kernels import testing
from moet_kernels.loader import kernels_available
from moet_kernels.ops import select_experts
from moet_kernels.reference import Routing, route_reference

pytestmark = pytest.mark.gpu

# not a MOET_* name: moet-vllm refuses MOET_* variables that are not its settings, and vLLM
# engines of the same suite inherit this environment
SEED = int(os.environ.get("GPU_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
HERE = "packages/moet-kernels/tests/test_gpu_kernels.py"
NO_CUDA = "the gpu tests need a CUDA device; CI deselects them with -m 'not gpu'"


# Fail, never skip: on a machine that runs the gpu marker a missing prerequisite is a bug.
def require_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail(NO_CUDA, pytrace=False)


@functools.cache
def _kernels_missing() -> str | None:
    """Why the kernels cannot run on this device, or None (asked once per session)."""
    ok, why = kernels_available()
    return None if ok else why


def require_kernels() -> None:
    require_cuda()
    why = _kernels_missing()
    if why:
        pytest.fail(
            f"moet-kernels cannot run on this CUDA device: {why} (install moet-kernels where "
            "nvcc is on PATH, or point MOET_KERNELS_CUBIN_DIR at built cubins)",
            pytrace=False,
        )


def reproduce(test: str) -> str:
    return f"seed {SEED}: reproduce with GPU_TEST_SEED={SEED} python -m pytest '{HERE}::{test}'"


@pytest.mark.parametrize("case", testing.VALIDATION_CASES, ids=lambda c: c.id)
def test_kernels_match_references(case):
    require_kernels()
    try:
        r = testing.validate_case(case, SEED)
    finally:
        torch.cuda.empty_cache()  # the cases' pools add up over a session
    assert r["ok"], f"{case.id}: failed {r['failed']}\n{testing.result_line(r)}\n" + reproduce(
        f"test_kernels_match_references[{case.id}]"
    )


def test_refinement_expansion_matches_moet_quant():
    require_cuda()  # a torch expansion: no cubins needed
    r = testing.refinement_check()
    assert r["equal_to_moet_quant"], f"expand_refinement on the GPU differs from moet-quant: {r}"


# (routing, experts, correction bias): the routings of the supported families
SELECTIONS = {
    "mixtral": (Routing(top_k=2), 8, False),
    "qwen3-moe": (Routing(top_k=8), 128, False),
    "softmax-unnormalized": (Routing(top_k=4, renormalize=False), 60, False),
    "glm-4.5": (Routing(top_k=8, scoring="sigmoid"), 128, True),
    "deepseek-v3": (
        Routing(top_k=8, scoring="sigmoid", n_group=8, topk_group=4, scaling=2.5),
        256,
        True,
    ),
    "grouped-no-bias": (Routing(top_k=6, scoring="sigmoid", n_group=8, topk_group=3), 64, False),
    "kimi-k2": (Routing(top_k=8, scoring="sigmoid", scaling=2.827), 384, True),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", SELECTIONS)
def test_select_kernel_picks_the_references_experts(name, dtype):
    """ops.select_experts on the GPU against route_reference. Sigmoid scores are meant to be bit
    for bit torch's and softmax scores sum in another order, so a token's picks may differ only
    where the reference's selection scores tie within float32 ulps (bfloat16 logits tie often:
    both send ties to the lower expert id); at least 99% of tokens pick the same experts, and
    their weights agree within ulps."""
    require_kernels()
    routing, e, biased = SELECTIONS[name]
    gen = torch.Generator().manual_seed(SEED)
    for t in (1, 7, 33, 1000):
        logits = (torch.randn(t, e, generator=gen) * 2).to(dtype).cuda()
        bias = (torch.randn(e, generator=gen) * 0.1).cuda() if biased else None
        weights, ids = select_experts(logits, routing, bias)
        ref_w, ref_ids = route_reference(logits, routing, bias)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        where = f"{name}, {dtype}, {t} tokens; " + reproduce(
            f"test_select_kernel_picks_the_references_experts[{name}-{dtype}]"
        )
        z = logits.float()
        sel = torch.softmax(z, dim=-1) if routing.scoring == "softmax" else torch.sigmoid(z)
        sel = sel if bias is None else sel + bias
        got = sel.gather(1, ids.long()).sort(dim=1).values
        want = sel.gather(1, ref_ids).sort(dim=1).values
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=where)
        same = (ids.long() == ref_ids).all(dim=1)
        assert same.float().mean() >= 0.99, where
        torch.testing.assert_close(weights[same], ref_w[same], rtol=1e-5, atol=0, msg=where)


@pytest.mark.parametrize("name", [n for n, (r, e, _) in SELECTIONS.items() if r.n_group <= 1])
def test_select_kernel_one_token_picks_as_a_batch_does(name):
    """At one token the select kernel ranks the experts with the whole block instead of picking in
    rounds (a warp per token, as for any batch): the same ids and weights bit for bit, on bfloat16
    logits (ties, broken to the lower id), with NaN scores (sigmoid) or zero ones (softmax of
    -inf) among them."""
    require_kernels()
    routing, e, biased = SELECTIONS[name]
    gen = torch.Generator().manual_seed(SEED)
    logits = (torch.randn(16, e, generator=gen) * 2).bfloat16()
    logits[3, : e // 4] = logits[3, e // 4]  # a quarter of the experts tie
    logits[5, 1::3] = float("nan" if routing.scoring == "sigmoid" else "-inf")
    logits, bias = logits.cuda(), (torch.randn(e, generator=gen) * 0.1).cuda() if biased else None
    weights, ids = select_experts(logits, routing, bias)
    for r in range(logits.shape[0]):
        w1, i1 = select_experts(logits[r : r + 1], routing, bias)
        where = f"{name}, row {r}; " + reproduce(
            f"test_select_kernel_one_token_picks_as_a_batch_does[{name}]"
        )
        assert torch.equal(i1[0], ids[r]), where
        assert torch.equal(w1[0].view(torch.int32), weights[r].view(torch.int32)), where
