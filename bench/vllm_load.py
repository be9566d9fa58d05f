"""The weight-load phase of vLLM with moet: re-quantizing at load vs reading the pack cache.

Run through nox: `nox -s bench -- vllm-load`. One generated Qwen3-MoE checkpoint of >= 2 GB (bf16,
seeded, cached under $XDG_CACHE_HOME/moet/bench) is served by vLLM (CPU, float32) with
`--quantization moet` twice in the same run, with an empty pack cache (cold: experts re-quantized)
and then with the cache the first boot wrote (warm). Reported from the logs of each boot: vLLM's
"Loading weights took" (dense tensors: vLLM skips the expert tensors) plus moet's expert phase
(re-quantization or pack reads): the weight-load phase; the target is warm >= 5x faster. In-process, the peak extra host memory of one layer's re-quantization
(tracemalloc) is measured against the size of that layer's source experts. Greedy tokens of both
boots must be equal. Results: bench/results/vllm/<host>-<date>.json.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import tracemalloc
from datetime import datetime, timezone
from pathlib import Path

from results_io import write_result  # noqa: E402  (bench/ is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moet" / "bench"
MODEL = CACHE / "qwen3-moe-2gb"
DRIVER = ROOT / "packages" / "moet-vllm" / "tests" / "vllm_driver.py"
GEOMETRY = {
    "hidden_size": 1024,
    "moe_intermediate_size": 512,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 10,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 2048,
    "vocab_size": 4096,
    "max_position_embeddings": 512,
}


def build_model() -> None:
    if (MODEL / "config.json").exists():
        return
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    print(f"building {MODEL} (once)...", flush=True)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**GEOMETRY, tie_word_embeddings=False))
    tmp = MODEL.with_name(MODEL.name + ".partial")
    model.save_pretrained(tmp, max_shard_size="1GB")
    tmp.rename(MODEL)


def boot(name: str, cache_dir: Path, out_dir: Path) -> dict:
    out = out_dir / f"{name}.json"
    env = {**os.environ, "MOET_CACHE_DIR": str(cache_dir)}
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, str(DRIVER), str(MODEL), str(out), "--quantization", "moet"],
        capture_output=True,
        text=True,
        env=env,
    )
    wall = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"{name} boot failed:\n{r.stderr[-3000:]}")
    log = r.stdout + r.stderr
    load = re.search(r"Loading weights took ([\d.]+) seconds", log)
    experts = re.search(
        r"expert weights ready in ([\d.]+) s: (\d+) layers re-quantized, "
        r"(\d+) from the pack cache",
        log,
    )
    if not (load and experts):
        sys.exit(f"{name}: timing lines not found in the log:\n{log[-3000:]}")
    res = json.loads(out.read_text())
    return {
        "tokens": res["tokens"],
        "boot_wall_s": round(wall, 1),
        "llm_init_s": round(res["init_seconds"], 1),
        # vLLM's load_weights (dense tensors: the expert tensors are skipped) plus moet's expert
        # phase (re-quantization or pack reads, in process_weights_after_loading)
        "weight_load_phase_s": round(float(load.group(1)) + float(experts.group(1)), 2),
        "vllm_load_weights_s": float(load.group(1)),
        "moet_experts_s": float(experts.group(1)),
        "layers_requantized": int(experts.group(2)),
        "layers_from_packs": int(experts.group(3)),
    }


def one_layer_memory() -> dict:
    """Peak extra host memory of re-quantizing one MoE layer, vs that layer's source bytes."""
    from moet_vllm.config import resolve
    from moet_vllm.experts import ExpertSource

    src = ExpertSource.open(MODEL, resolve(None, None, {}))
    layer = src.moe_layers[0]
    per_layer = sum(s.source_bytes for s in src.ck.sources if s.key.layer == layer)
    total = sum(s.source_bytes for s in src.ck.sources)
    tracemalloc.start()
    sections = src.layer(layer)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    src.close()
    return {
        "layer_source_bytes": per_layer,
        "all_expert_source_bytes": total,
        "peak_traced_bytes": peak,
        "layer_w2_bytes": sum(v.nbytes for v in sections.values()),
        "peak_vs_layer_source": round(peak / per_layer, 3),
    }


def main() -> int:
    build_model()
    size = sum(f.stat().st_size for f in MODEL.glob("*.safetensors"))
    print(f"checkpoint {MODEL}: {size / 1e9:.2f} GB", flush=True)
    with tempfile.TemporaryDirectory(prefix="moet-bench-load-") as d:
        d = Path(d)
        cold = boot("cold", d / "packs", d)
        print(f"cold: {cold}", flush=True)
        warm = boot("warm", d / "packs", d)
        print(f"warm: {warm}", flush=True)
    if cold["tokens"] != warm["tokens"]:
        sys.exit("the two boots generated different tokens")
    if warm["layers_from_packs"] != GEOMETRY["num_hidden_layers"]:
        sys.exit("the warm boot did not read every layer from the pack cache")
    mem = one_layer_memory()
    result = {
        "bench": "vllm_load",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "command": "nox -s bench -- vllm-load",
        "checkpoint_bytes": size,
        "geometry": GEOMETRY,
        "cold": cold,
        "warm": warm,
        "weight_load_phase_speedup": round(
            cold["weight_load_phase_s"] / warm["weight_load_phase_s"], 2
        ),
        "expert_phase_speedup": round(cold["moet_experts_s"] / warm["moet_experts_s"], 2),
        "target_speedup": 5.0,
        "memory": mem,
    }
    print(
        json.dumps(
            {k: result[k] for k in ("weight_load_phase_speedup", "expert_phase_speedup", "memory")},
            indent=1,
        )
    )
    write_result("vllm", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
