"""The main job (README): a real MoE checkpoint through moet-quant, end to end.

1. transformers builds a seeded Qwen3MoeForCausalLM (8 layers x 32 experts, bf16) and saves it as a
   real safetensors checkpoint (skipped when it is already there);
2. `moet-quant inspect` reports what it holds, `convert --dry-run` the sizes per tier;
3. `moet-quant convert` writes the moet checkpoint (2-bit experts), then `study` reports the
   codebook verdict.
Everything lives under $XDG_CACHE_HOME/moet/main-job (default ~/.cache/moet/main-job).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moet" / "main-job"
MODEL = CACHE / "qwen3-moe-tiny"
OUT = CACHE / "qwen3-moe-tiny-moet"


def build_model() -> None:
    if (MODEL / "config.json").exists():
        print(f"== model: {MODEL} (already built)")
        return
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    tmp = MODEL.with_name(MODEL.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="40MB")
    tmp.rename(MODEL)
    print(f"== model: built {MODEL} with transformers (seeded, untrained)")


def moet_quant(*args: str) -> None:
    print(f"\n== moet-quant {' '.join(args)}", flush=True)
    subprocess.run(["moet-quant", *args], check=True)


def main() -> int:
    CACHE.mkdir(parents=True, exist_ok=True)
    build_model()
    moet_quant("inspect", str(MODEL))
    moet_quant("convert", str(MODEL), str(OUT), "--dry-run")
    shutil.rmtree(OUT, ignore_errors=True)
    moet_quant("convert", str(MODEL), str(OUT))
    moet_quant("convert", str(MODEL), str(OUT))  # resumable: finds every shard finished
    moet_quant("study", str(MODEL), "--limit", "48")
    print(f"\n== done: the moet checkpoint is {OUT}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as e:
        print(f"main job: step failed with exit code {e.returncode}", file=sys.stderr)
        sys.exit(e.returncode)
