"""moet-vllm on a GPU: vLLM 0.24 (CUDA) serving the trained fixture through moet-kernels in CUDA
graphs, every expert resident and tiered. Marker `gpu`: `bash ci/gpu.sh` runs these on the H200
with vLLM staged; CI deselects them (`-m "not gpu"`). On a CUDA machine a missing prerequisite
(vLLM, the kernels' cubins) fails, it is never skipped.

The fixture (serving.FIXTURE: GLM-4.5 family, 3 MoE layers x 64 experts of intermediate 32,
top-4) is converted by `moet convert` and served in bfloat16 with vLLM's default compilation
(torch.compile, FULL_AND_PIECEWISE CUDA graphs). Engines of one comparison run the same prompts,
batch limit and capture sizes, so the batches vLLM forms (and so the dense layers' arithmetic)
are the same; what differs is where the experts come from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from serving import FIXTURE, GPU_FLAGS, Server, convert_fixture, fixture_prompts, run_vllm
from tiny_models import GLM_PARSER_FLAGS, WEATHER_CITIES, WEATHER_TOOL, whitespace_token_ids

from moet_vllm.residency.sizing import boot_floor

pytestmark = pytest.mark.gpu
NAME = "moet-glm-moe-fixture"
CAPTURE = ["1", "2", "4", "8"]  # captured batch sizes of the driver's engines
SEQS = 4  # max_num_seqs of the comparisons: 8 prompts, 4 decoding together
FLOOR = boot_floor(3, 4, 1, SEQS)  # 56 of the fixture's 192 (layer, expert) pairs
KERNEL_LINE = (
    "moet: compute: moet-kernels (sm_90a cubins) on cuda:0, captured in vLLM's CUDA graphs"
)


@pytest.fixture(scope="module", autouse=True)
def prerequisites():
    """What the suite needs on this machine; each missing piece is a failure that says so."""
    assert torch.cuda.is_available(), (
        "the gpu tests need a CUDA device (CI deselects them with -m 'not gpu')"
    )
    import vllm

    assert vllm.__version__.startswith("0.24."), f"vLLM 0.24 expected, found {vllm.__version__}"
    from moet_kernels.loader import kernels_available

    ok, why = kernels_available()
    assert ok, f"moet-kernels cannot run on this GPU: {why}"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return convert_fixture(tmp_path_factory.mktemp("gpu-models") / "fixture-moet")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu-packs")


def drive(model, tmp_path, name, env=None, prompts=8, seqs=SEQS) -> dict:
    """One engine (vllm_driver.py, its own process) with graphs at CAPTURE, greedy, bfloat16."""
    extra = ["--graphs", *CAPTURE, "--max-num-seqs", str(seqs), "--gpu-memory-utilization", "0.3"]
    return run_vllm(
        model, tmp_path, name, env=env, dtype="bfloat16", extra=extra,
        prompts=fixture_prompts(prompts),
    )  # fmt: skip


# --- vllm serve ---------------------------------------------------------------------------------


def test_vllm_serve_answers_chat_completion_and_a_tool_call_through_the_kernels(
    model, cache, tmp_path
):
    """`vllm serve` with default compilation (CUDA graphs at vLLM's default capture sizes): a
    chat, a completion and a named tool call over the OpenAI API, and the boot line saying that
    the kernels run, captured."""
    from openai import OpenAI

    vllm_serve = (sys.executable, "-m", "vllm.entrypoints.cli.main", "serve")
    srv = Server(
        model, tmp_path / "server.log", cache, (*GLM_PARSER_FLAGS, "--gpu-memory-utilization", "0.3"),
        name=NAME, device_flags=GPU_FLAGS, command=vllm_serve,
    )  # fmt: skip
    try:
        srv.wait_ready(timeout=480)
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=120, max_retries=0)
        no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
        chat = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "List the files."}],
            max_tokens=16,
            temperature=0,
            extra_body=no_thinking,
        )
        assert chat.usage.completion_tokens == 16 and chat.choices[0].message.content
        completion = client.completions.create(
            model=NAME, prompt="import os\nimport sys\n\n\ndef main(", max_tokens=16, temperature=0
        )
        assert completion.usage.completion_tokens == 16 and completion.choices[0].text
        call = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=96,
            temperature=0,
            # as in test_vllm_openai: without whitespace tokens the call's grammar is finite
            logit_bias={str(i): -100 for i in whitespace_token_ids(model)},
            extra_body=no_thinking,
        )
        calls = call.choices[0].message.tool_calls
        assert calls and len(calls) == 1, call
        (tool_call,) = calls
        assert tool_call.function.name == "get_weather"
        assert json.loads(tool_call.function.arguments)["city"] in WEATHER_CITIES
        log = srv.log()
        assert KERNEL_LINE in log, log[-4000:]
    finally:
        srv.stop()


# --- tiered residency against all-resident ------------------------------------------------------


@pytest.fixture(scope="module")
def resident(model, cache, tmp_path_factory) -> dict:
    """gpu_pool=all: every expert resident in native rows, through the same op and layout."""
    run = drive(
        model, tmp_path_factory.mktemp("resident"), "resident", {"MOET_CACHE_DIR": str(cache)}
    )
    assert KERNEL_LINE in run["log"]
    return run


@pytest.mark.parametrize(
    "pool, extra_env",
    [("96", {}), (str(FLOOR), {}), (str(FLOOR - 16), {"MOET_BELOW_FLOOR_OK": "1"})],
    ids=["50%", "the-floor", "below-the-floor"],
)
def test_tiered_tokens_and_logprobs_equal_all_resident_bit_for_bit(
    model, resident, tmp_path, pool, extra_env
):
    """A pool of 50%, of the boot floor, and below it (consented): every generated token and its
    logprob equals the all-resident engine's, bit for bit, and the pool did miss: replayed
    steps and fetched experts are counted (a run that never missed cannot pass)."""
    # a cache of its own: no hot set saved by another run warms this pool up
    env = {"MOET_CACHE_DIR": str(tmp_path / "packs"), "MOET_GPU_POOL": pool, "MOET_KPI_EVERY": "1"}
    env.update(extra_env)
    tiered = drive(model, tmp_path, f"tiered-{pool}", env)
    assert KERNEL_LINE in tiered["log"]
    assert f"tiered residency: {pool} expert slots for 3 MoE layers x 64 experts" in tiered["log"]
    assert tiered["tokens"] == resident["tokens"]
    assert tiered["logprobs"] == resident["logprobs"]
    counters = tiered["residency"]
    assert counters["replayed_steps"] > 0 and counters["replays"] > 0, counters
    assert counters["fetched_rows"] > 0, counters
    assert counters["unrestored_steps"] == 0, counters
    print(f"pool {pool}: {counters}")


# --- the kernels against their oracle, inside vLLM ----------------------------------------------

# The op's error: the kernels' int8 x int8 products are exact and their float32 scale products
# round at ~1e-7 relative; the oracle does the same arithmetic in float64. The rest of the model
# (bfloat16) is the same in both engines, so a position's logprobs can move only by the rounding
# that difference starts: bounded here by EPSILON (nats, measured far below it). If no logprob
# moves by more than eps, greedy top-1 can differ only where the oracle's top-2 margin is below
# 2 * eps: DELTA.
EPSILON = 0.1
DELTA = 2 * EPSILON


def split_prompt(n_tokens: int = 1000) -> tuple[str, list[int]]:
    """The first `n_tokens` of the interpreter's standard-library sources that fall in the
    fixture's test split (bench/fixture/corpus.py `split_of`: SHA-256 of the document key), as
    token ids of the fixture's tokenizer; -> (document keys, ids)."""
    import hashlib
    import sysconfig

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(FIXTURE) / "tokenizer.json"))
    root = Path(sysconfig.get_paths()["stdlib"])
    keys, ids = [], []
    for path in sorted(root.rglob("*.py")):
        key = f"stdlib/{path.relative_to(root)}"
        bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") % 100
        text = path.read_text(errors="replace")
        if 5 <= bucket < 10 and len(text) >= 200:
            keys.append(key)
            ids += tok.encode(text).ids
            if len(ids) >= n_tokens:
                return ", ".join(keys), ids[:n_tokens]
    raise AssertionError(f"fewer than {n_tokens} test-split tokens in {root}")


def test_kernels_agree_with_their_oracle_teacher_forced_on_test_text(model, tmp_path):
    """Teacher-forced over ~1000 tokens of the fixture's test split: the kernels (graphs on) and
    the kernel-mode torch reference (compute='oracle', eager) give the same greedy top-1 at
    every position except where the oracle's top-2 margin is below DELTA; no logprob moves by
    EPSILON or more. Agreement with the bf16 fixture (stock vLLM, no moet) is reported."""
    keys, prompt = split_prompt()
    common = ["--max-model-len", "1024", "--prompt-logprobs", "--max-num-seqs", "1",
              "--gpu-memory-utilization", "0.3"]  # fmt: skip
    runs = {
        "kernel": run_vllm(model, tmp_path, "kernel", dtype="bfloat16", prompts=[prompt],
                           extra=[*common, "--graphs", *CAPTURE]),
        "oracle": run_vllm(model, tmp_path, "oracle", dtype="bfloat16", prompts=[prompt],
                           extra=common, env={"MOET_COMPUTE": "oracle"}),
        "bf16": run_vllm(FIXTURE, tmp_path, "bf16", dtype="bfloat16", prompts=[prompt],
                         extra=[*common, "--graphs", *CAPTURE]),
    }  # fmt: skip
    assert KERNEL_LINE in runs["kernel"]["log"]
    assert "moet-kernels' torch reference in kernel mode on cuda:0" in runs["oracle"]["log"]
    kernel, oracle, bf16 = (runs[k]["prompt_top2"][0] for k in ("kernel", "oracle", "bf16"))
    assert len(kernel) == len(oracle) == len(prompt) - 1
    eps, flips = 0.0, []
    for i, (k, o) in enumerate(zip(kernel, oracle)):
        ko, oo = dict(map(tuple, k)), dict(map(tuple, o))
        eps = max([eps] + [abs(ko[t] - oo[t]) for t in ko.keys() & oo.keys()])
        if k[0][0] != o[0][0]:
            flips.append((i, o[0][1] - o[1][1]))
    agree_bf16 = sum(k[0][0] == b[0][0] for k, b in zip(kernel, bf16)) / len(kernel)
    print(
        f"{len(kernel)} positions of {keys[:200]}: kernel/oracle top-1 flips {len(flips)} "
        f"(margins {[round(m, 4) for _, m in flips]}), largest logprob move {eps:.4g} nats; "
        f"top-1 agreement with bf16 {agree_bf16:.3f}"
    )
    assert eps < EPSILON, f"a logprob moved by {eps} nats between the kernels and their oracle"
    assert all(m < DELTA for _, m in flips), flips
