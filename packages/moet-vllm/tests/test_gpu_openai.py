"""`vllm serve` on a GPU (marker `gpu`, run by ci/gpu.sh on the H200): vLLM 0.24 serving the
trained fixture (serving.FIXTURE, converted by `moet convert`) with its default compilation
(torch.compile, FULL_AND_PIECEWISE CUDA graphs at the default capture sizes) through moet-kernels,
answering over the OpenAI API. On a CUDA machine a missing prerequisite fails, never skips."""

from __future__ import annotations

import json
import sys

import pytest
from serving import GPU_FLAGS, GPU_KV_FLAGS, KERNEL_LINE, Server
from tiny_models import GLM_PARSER_FLAGS, WEATHER_CITIES, WEATHER_TOOL, whitespace_token_ids

pytestmark = pytest.mark.gpu
NAME = "moet-glm-moe-fixture"


def test_vllm_serve_answers_chat_completion_and_a_tool_call_through_the_kernels(
    fixture_moet, tmp_path
):
    """`vllm serve` with default compilation (CUDA graphs at vLLM's default capture sizes): a
    chat, a completion and a named tool call over the OpenAI API, and the boot line saying that
    the kernels run, captured."""
    from openai import OpenAI

    vllm_serve = (sys.executable, "-m", "vllm.entrypoints.cli.main", "serve")
    srv = Server(
        fixture_moet, tmp_path / "server.log", tmp_path / "cache", (*GLM_PARSER_FLAGS, *GPU_KV_FLAGS),
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
            extra_body={**no_thinking, "ignore_eos": True},
        )
        assert chat.usage.completion_tokens == 16 and chat.choices[0].message.content
        completion = client.completions.create(
            model=NAME,
            prompt="import os\nimport sys\n\n\ndef main(",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
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
            logit_bias={str(i): -100 for i in whitespace_token_ids(fixture_moet)},
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
