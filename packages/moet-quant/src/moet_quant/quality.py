"""Quality harness (`moet-quant eval` / `moet eval`): what a quantization format does to a model.

The forward passes run through an implementation that is not moet's serving code: Hugging Face
transformers, float32, with each variant's routed-expert weights replaced by their dequantized
values (every other tensor is the checkpoint's). So the harness judges formats, not kernels.

Variants (`VARIANTS`), each a function of one expert projection w [N, K] in float64 (the
checkpoint's exact values) to its dequantized float64 replacement:

* ``bf16``            the checkpoint itself (the reference of every comparison);
* ``w2-reference``    moet's W2 reference quantizer (sign-symmetric {-4,-1,1,4}, UE8M0 per 32,
                      zero balancing ``auto``): ``w2.quantize_f64(w, "auto", "reference")``;
* ``w2-optimal``      the error-optimal exponent mode (e-1, e, e+1 searched per block);
* ``w2-nobalance``    the reference quantizer without zero balancing (zero mode ``sign``);
* ``w2-l2opt``        the ablation: the tensor's L2-optimal asymmetric 4-level codebook
                      (moet_quant.study), with the reference block exponents;
* ``fp4r``            (opt-in) the FP4 tier's re-quantized rows, every expert at FP4: the e2m1
                      nibbles of ``fp4.fp4r`` on the W2 block scales (what the FP4 tier serves);
* ``fp8``, ``nvfp4``  (opt-in) the experts of a real nvidia-modelopt export of the checkpoint
                      (``FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG``, ``NVFP4_EXPERTS_ONLY_CFG``, calibrated
                      on the first 8 x 256 tokens), read back exactly by moet's own checkpoint
                      readers; the export lives in a temporary directory under the moet cache
                      directory. Only the routed experts change, as for every variant.

Measured on windows of a token file (uint16/int .npy, every window's tokens predicting the next):

* perplexity; top-1 agreement with ``bf16`` (argmax equal); KL(bf16 || variant) of the next-token
  distributions per token: mean and 99th percentile;
* significance of the mean next-token loss difference against ``bf16`` and against
  ``w2-reference``: a paired bootstrap over windows (seeded; 95% interval; "significant" when it
  excludes 0);
* greedy generation from fixed prompts (the first ``prompt_len`` tokens of the first windows;
  ``gen_tokens`` tokens each, EOS suppressed by transformers' ``min_new_tokens``): the
  longest prefix equal to bf16's and a loop detector (the last 32 tokens repeat with a period of at
  most 8 tokens);
* per-tensor rel-RMS and signed bias (study.py's definitions: sqrt(mean((ŵ-w)²))/rms(w) and
  mean(ŵ-w)/rms(w)) over every routed expert projection.

Deterministic: no sampling anywhere, a seeded bootstrap, the thread count recorded; the same
inputs and thread count give the same JSON.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import fp4, study, w2
from .errors import MoetError

DEFAULT_VARIANTS = ("bf16", "w2-reference", "w2-optimal", "w2-nobalance", "w2-l2opt")
# variants whose experts come from a nvidia-modelopt export (config name in modelopt.torch.quantization)
MODELOPT_CONFIGS = {"fp8": "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG", "nvfp4": "NVFP4_EXPERTS_ONLY_CFG"}
CALIB_WINDOWS, CALIB_LEN = 8, 256
LOOP_TAIL, LOOP_PERIOD = 32, 8


def _w2(zero_mode: str, mode: str):
    def q(w: np.ndarray) -> np.ndarray:
        return w2.quantize_f64(w, zero_mode, mode).dequant()

    return q


def _l2opt(w: np.ndarray) -> np.ndarray:
    n, k = w.shape
    blocks = w.reshape(n, k // w2.BLOCK, w2.BLOCK)
    scale = np.exp2(w2.block_exponent(np.abs(blocks).max(-1)).astype(np.float64))[..., None]
    u = (blocks / scale).reshape(n, k)
    levels, _ = study.fit_levels(u)
    q = study.assign_levels(u, levels, w == 0).reshape(blocks.shape) * scale
    return q.reshape(n, k)


def _fp4r(w: np.ndarray) -> np.ndarray:
    base, nibbles = fp4.fp4r(w)
    return fp4.dequant_fp4r(nibbles, base.scales)


VARIANTS = {
    "bf16": lambda w: w,
    "w2-reference": _w2("auto", "reference"),
    "w2-optimal": _w2("auto", "optimal"),
    "w2-nobalance": _w2("sign", "reference"),
    "w2-l2opt": _l2opt,
    "fp4r": _fp4r,
}


@dataclass
class EvalOptions:
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    window: int = 1024
    max_tokens: int | None = None
    batch: int = 8
    n_boot: int = 2000
    seed: int = 0
    n_prompts: int = 8
    prompt_len: int = 16
    gen_tokens: int = 48
    exports: dict = field(default_factory=dict)  # fp8/nvfp4 -> an existing export of the model
    extra: dict = field(default_factory=dict)


# --- the model's routed experts -------------------------------------------------------------------


def expert_modules(model) -> list[tuple[str, object]]:
    """transformers' fused expert modules (3-D ``gate_up_proj`` [E, 2I, H] and ``down_proj``
    [E, H, I], gate rows first), by name. Other layouts are refused."""
    found = []
    for name, m in model.named_modules():
        gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if gu is None or down is None or getattr(gu, "ndim", 0) != 3:
            continue
        if getattr(m, "is_transposed", False) or getattr(m, "has_bias", False):
            raise MoetError(
                f"{name}: transposed or biased fused experts are not supported by the harness yet"
            )
        found.append((name, m))
    if not found:
        raise MoetError(
            "no routed experts found (expected transformers' fused gate_up_proj/down_proj)"
        )
    return found


def projections(module) -> list[tuple[str, np.ndarray]]:
    """(projection, float64 [N, K]) for every expert of one fused module: gate, up, down."""
    gu = module.gate_up_proj.detach().double().numpy()
    down = module.down_proj.detach().double().numpy()
    inter = gu.shape[1] // 2
    out = []
    for e in range(gu.shape[0]):
        out += [
            (f"{e}.gate_proj", gu[e, :inter]),
            (f"{e}.up_proj", gu[e, inter:]),
            (f"{e}.down_proj", down[e]),
        ]
    return out


def _tensor_stats(w: np.ndarray, q: np.ndarray) -> tuple[float, float]:
    rms = math.sqrt(float(np.mean(w * w)))
    if rms == 0.0:
        return 0.0, 0.0
    err = q - w
    return math.sqrt(float(np.mean(err * err))) / rms, float(np.mean(err)) / rms


def quantized_copy(model, variant: str, source=None) -> tuple[object, list[dict]]:
    """A copy of `model` whose routed experts hold `variant`'s dequantized weights, and the
    per-tensor rel-RMS / bias of that variant. `source(layer, expert, proj, w)` gives the
    replacement of one projection (default: the per-tensor function VARIANTS[variant])."""
    import torch

    if source is None:
        fn = VARIANTS[variant]

        def source(_layer, _e, _proj, w):
            return fn(w)

    out = copy.deepcopy(model)
    stats = []
    for name, m in expert_modules(out):
        layer = _layer_of(name)
        gu = m.gate_up_proj.detach().double().numpy().copy()
        down = m.down_proj.detach().double().numpy().copy()
        inter = gu.shape[1] // 2
        for proj, w in projections(m):
            e, kind = proj.split(".")
            e = int(e)
            q = np.asarray(source(layer, e, kind.removesuffix("_proj"), w), dtype=np.float64)
            if q.shape != w.shape:
                raise MoetError(f"{name}.{proj}: {variant} gives {q.shape}, expected {w.shape}")
            rel, bias = _tensor_stats(w, q)
            stats.append({"tensor": f"{name}.{proj}", "rel_rms": rel, "bias": bias})
            if kind == "gate_proj":
                gu[e, :inter] = q
            elif kind == "up_proj":
                gu[e, inter:] = q
            else:
                down[e] = q
        with torch.no_grad():
            m.gate_up_proj.copy_(torch.from_numpy(gu))
            m.down_proj.copy_(torch.from_numpy(down))
    return out, stats


def _layer_of(module_name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", module_name + ".")
    if not m:
        raise MoetError(f"{module_name}: cannot tell the layer index of this expert module")
    return int(m.group(1))


# --- modelopt variants: experts from a real modelopt export, read back exactly -------------------


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/moet``, else ``~/.cache/moet`` (where the harness keeps its exports)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "moet"


def modelopt_export(model_dir: str | Path, variant: str, calib: np.ndarray, out_dir: Path) -> Path:
    """Quantize the bf16 checkpoint with nvidia-modelopt (`MODELOPT_CONFIGS[variant]`; the
    calibration forward runs over `calib` [batch, seq] token ids) and write its Hugging Face
    export (`export_hf_checkpoint`) to out_dir."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    try:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
    except ImportError:
        raise MoetError(
            f"variant {variant} needs nvidia-modelopt (pip install nvidia-modelopt)"
        ) from None
    warnings.filterwarnings("ignore", category=UserWarning, module=r"modelopt\..*")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    batches = torch.from_numpy(np.asarray(calib, dtype=np.int64))

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches.split(4):
                m(input_ids=ids)

    mtq.quantize(model, getattr(mtq, MODELOPT_CONFIGS[variant]), forward_loop)
    with torch.no_grad():
        export_hf_checkpoint(model, export_dir=str(out_dir))
    return out_dir


def checkpoint_source(path: str | Path):
    """A `quantized_copy` source reading every routed expert projection of a checkpoint through
    moet's own exact readers (float64), e.g. a modelopt export."""
    from .checkpoint import open_checkpoint

    ckpt = open_checkpoint(path)
    by_key = {(s.key.layer, s.key.expert, s.key.proj): s for s in ckpt.sources}
    fmt = ckpt.info.source_format

    def source(layer, e, proj, w):
        try:
            return by_key[(layer, e, proj)].dequant()
        except KeyError:
            raise MoetError(
                f"{path}: no expert projection layer {layer} expert {e} {proj}"
            ) from None

    source.source_format = fmt
    return source


# --- metrics -------------------------------------------------------------------------------------


def load_tokens(path) -> np.ndarray:
    """A token file (.npy, 1-D token ids), or MoetError naming it."""
    try:
        tokens = np.load(path)
    except (OSError, ValueError) as e:
        raise MoetError(f"cannot read token file {path}: {e}") from None
    if tokens.ndim != 1:
        raise MoetError(f"{path}: expected a 1-D array of token ids, got {tokens.shape}")
    return tokens


def run_header(model_dir, n_tokens: int, n_windows: int, opts) -> dict:
    """What every harness report starts with: the model, the tokens and windows, the software
    and thread count it ran with (the results depend on them), the bootstrap's settings."""
    import torch

    return {
        "model": str(model_dir),
        "tokens": int(n_tokens),
        "windows": n_windows,
        "window": opts.window,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "n_boot": opts.n_boot,
        "seed": opts.seed,
    }


def windows_of(n_tokens: int, window: int) -> list[tuple[int, int]]:
    """(start, length) of the inputs: tokens[start:start+length] predict the next ones."""
    n = n_tokens - 1
    return [(s, min(window, n - s)) for s in range(0, n, window)]


def _batches(tokens: np.ndarray, window: int, batch: int):
    groups: dict[int, list[int]] = {}
    for s, n in windows_of(tokens.size, window):
        groups.setdefault(n, []).append(s)
    for n, starts in groups.items():
        for b in range(0, len(starts), batch):
            chunk = starts[b : b + batch]
            yield n, chunk, np.stack([tokens[s : s + n + 1] for s in chunk]).astype(np.int64)


def bootstrap(diff_sum: np.ndarray, count: np.ndarray, n_boot: int, seed: int) -> dict:
    """Paired bootstrap over windows of a token-weighted mean difference: resample windows with
    replacement; the 2.5/97.5 percentiles of the resampled means."""
    rng = np.random.default_rng(seed)
    n = diff_sum.size
    idx = rng.integers(0, n, size=(n_boot, n))
    means = diff_sum[idx].sum(1) / count[idx].sum(1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    mean = float(diff_sum.sum() / count.sum())
    return {
        "mean": mean,
        "ci95": [float(lo), float(hi)],
        "significant": bool(lo > 0 or hi < 0),
    }


def loop_period(seq: list[int], tail: int = LOOP_TAIL, max_period: int = LOOP_PERIOD) -> int:
    """The smallest p <= max_period with seq[-tail:] periodic of period p, else 0."""
    if len(seq) < tail:
        return 0
    t = seq[-tail:]
    for p in range(1, max_period + 1):
        if all(t[i] == t[i - p] for i in range(p, tail)):
            return p
    return 0


def evaluate(model_dir: str | Path, tokens: np.ndarray, opts: EvalOptions | None = None) -> dict:
    """Run every variant over `tokens` and return the report (see the module doc)."""
    import torch
    from transformers import AutoModelForCausalLM

    opts = opts or EvalOptions()
    unknown = [v for v in opts.variants if v not in VARIANTS and v not in MODELOPT_CONFIGS]
    if unknown or opts.variants[:1] != ("bf16",):
        raise MoetError(f"variants must start with bf16 and be among {list(VARIANTS)}: {unknown}")
    t0 = time.time()
    tokens = np.asarray(tokens)
    if opts.max_tokens:
        tokens = tokens[: opts.max_tokens + 1]
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    models, tensor_stats, formats_seen = {}, {}, {}
    calib_len = min(CALIB_LEN, tokens.size)
    calib = tokens[: CALIB_WINDOWS * calib_len]
    calib = calib[: (calib.size // calib_len) * calib_len].reshape(-1, calib_len)
    for v in opts.variants:
        if v == "bf16":
            models[v], tensor_stats[v] = ref, []
        elif v in MODELOPT_CONFIGS and v in opts.exports:
            src = checkpoint_source(opts.exports[v])
            models[v], tensor_stats[v] = quantized_copy(ref, v, src)
            formats_seen[v] = src.source_format
        elif v in MODELOPT_CONFIGS:
            cache_dir().mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=f"eval-{v}-", dir=cache_dir()) as tmp:
                src = checkpoint_source(modelopt_export(model_dir, v, calib, Path(tmp)))
                models[v], tensor_stats[v] = quantized_copy(ref, v, src)
            formats_seen[v] = src.source_format
        else:
            models[v], tensor_stats[v] = quantized_copy(ref, v)
        models[v].eval()

    wins = windows_of(tokens.size, opts.window)
    n_win, n_tok = len(wins), tokens.size - 1
    win_index = {s: i for i, (s, _) in enumerate(wins)}
    nll = {v: np.zeros(n_win) for v in opts.variants}
    agree = {v: 0 for v in opts.variants}
    kl_all = {v: np.empty(n_tok) for v in opts.variants}
    count = np.zeros(n_win)
    with torch.no_grad():
        for n, starts, x in _batches(tokens, opts.window, opts.batch):
            inp, tgt = torch.from_numpy(x[:, :-1]), torch.from_numpy(x[:, 1:])
            ref_lp = torch.log_softmax(models["bf16"](input_ids=inp).logits.double(), -1)
            ref_top = ref_lp.argmax(-1)
            for v in opts.variants:
                lp = (
                    ref_lp
                    if v == "bf16"
                    else torch.log_softmax(models[v](input_ids=inp).logits.double(), -1)
                )
                tok_nll = -lp.gather(-1, tgt[..., None])[..., 0]
                kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0.0)
                agree[v] += int((lp.argmax(-1) == ref_top).sum())
                for j, s in enumerate(starts):
                    i = win_index[s]
                    nll[v][i] = float(tok_nll[j].sum())
                    kl_all[v][s : s + n] = kl[j].numpy()
            for s in starts:
                count[win_index[s]] = n

    gen = _generation(models, tokens, opts)
    report: dict = {
        **run_header(model_dir, n_tok, n_win, opts),
        "gen_tokens": opts.gen_tokens,
        "modelopt_exports": {
            v: {"config": MODELOPT_CONFIGS[v], "expert_format": f} for v, f in formats_seen.items()
        },
        **opts.extra,
        "variants": {},
    }
    for v in opts.variants:
        loss = float(nll[v].sum() / count.sum())
        st = tensor_stats[v]
        row = {
            "loss": loss,
            "ppl": math.exp(loss),
            "top1_agreement": agree[v] / n_tok,
            "kl_mean": float(kl_all[v].mean()),
            "kl_p99": float(np.percentile(kl_all[v], 99)),
            "generation": gen[v],
        }
        if v != "bf16":
            row["vs_bf16"] = bootstrap(nll[v] - nll["bf16"], count, opts.n_boot, opts.seed)
            if v != "w2-reference" and "w2-reference" in nll:
                row["vs_w2_reference"] = bootstrap(
                    nll[v] - nll["w2-reference"], count, opts.n_boot, opts.seed
                )
            rel = np.array([s["rel_rms"] for s in st])
            bias = np.array([s["bias"] for s in st])
            row["tensors"] = {
                "n": len(st),
                "rel_rms_mean": float(rel.mean()),
                "rel_rms_max": float(rel.max()),
                "bias_mean": float(bias.mean()),
                "abs_bias_mean": float(np.abs(bias).mean()),
                "abs_bias_max": float(np.abs(bias).max()),
            }
        report["variants"][v] = row
    report["seconds"] = time.time() - t0
    return report


def _generation(models: dict, tokens: np.ndarray, opts: EvalOptions) -> dict:
    import torch

    prompts = [
        tokens[s : s + opts.prompt_len].astype(np.int64)
        for s, n in windows_of(tokens.size, opts.window)[: opts.n_prompts]
        if n >= opts.prompt_len
    ]
    outs: dict[str, list[list[int]]] = {}
    with torch.no_grad():
        for v, m in models.items():
            outs[v] = []
            for p in prompts:
                ids = torch.from_numpy(p)[None]
                g = m.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=opts.gen_tokens,
                    min_new_tokens=opts.gen_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
                outs[v].append(g[0, ids.shape[1] :].tolist())
    res = {}
    for v, seqs in outs.items():
        prefix = []
        for a, b in zip(seqs, outs["bf16"]):
            prefix.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b)))
        periods = [loop_period(s) for s in seqs]
        res[v] = {
            "prompts": len(seqs),
            "looping": sum(p > 0 for p in periods),
            "loop_periods": periods,
            "mean_prefix_equal_bf16": float(np.mean(prefix)) if prefix else 0.0,
        }
    return res


# --- output --------------------------------------------------------------------------------------


def format_table(report: dict) -> str:
    """A Markdown table of the report's variants (* marks a significant loss difference)."""
    lines = [
        "| variant | ppl | Δ loss vs bf16 [95% CI] | top-1 agree | KL mean | KL p99 | "
        "rel-RMS (mean) | abs. bias (mean) | greedy tokens = bf16 (mean) | looping prompts |",
        "|" + "---|" * 10,
    ]
    for v, r in report["variants"].items():
        d, t, g = r.get("vs_bf16"), r.get("tensors"), r["generation"]
        delta = "—"
        if d:
            delta = f"{d['mean']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]"
            delta += " *" if d["significant"] else ""
        rel = f"{t['rel_rms_mean']:.4f}" if t else "—"
        bias = f"{t['abs_bias_mean']:.5f}" if t else "—"
        lines.append(
            f"| {v} | {r['ppl']:.4f} | {delta} | {r['top1_agreement']:.4f} | "
            f"{r['kl_mean']:.5f} | {r['kl_p99']:.4f} | {rel} | {bias} | "
            f"{g['mean_prefix_equal_bf16']:.1f} of {report.get('gen_tokens', '?')} | "
            f"{g['looping']} of {g['prompts']} |"
        )
    return "\n".join(lines)


def check_report_path(path: str | Path) -> Path:
    """Before a run: the report's folder must exist and be writable (a long run is not lost)."""
    folder = Path(path).resolve().parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise MoetError(f"cannot write the report {path}: {folder} is not a writable folder")
    return Path(path)


def write_report(report: dict, path: str | Path) -> None:
    try:
        Path(path).write_text(json.dumps(report, indent=1) + "\n")
    except OSError as e:
        raise MoetError(f"cannot write the report {path}: {e}") from None
