"""`moet-quant` command line: inspect, study, convert, eval.

`add_subcommands` is the one definition of these subcommands: the user-facing `moet` command
(moet-vllm) mounts the same parsers and functions. User errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import __version__
from .errors import MoetError


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB"


def format_info(info) -> str:
    b = info.bytes
    rows = [
        ("checkpoint", info.path),
        ("architecture", f"{info.architecture} (family {info.family})"),
        ("expert format", info.source_format),
        ("dense quantization", (info.dense_quantization or {}).get("quant_method", "none")),
        (
            "MoE layers",
            f"{len(info.moe_layers)}: {info.moe_layers}"
            + (f" (MTP: {info.mtp_layers})" if info.mtp_layers else ""),
        ),
        ("experts / top-k", f"{info.n_experts} / {info.top_k}"),
        ("hidden / expert intermediate", f"{info.hidden_size} / {info.moe_intermediate_size}"),
        ("expert projections", str(info.n_projections)),
        ("source expert bytes", _gb(b["source_experts"])),
        ("dense bytes", _gb(b["dense"])),
        ("W2 tier bytes", _gb(b["w2"])),
        ("fp4r refinement bytes", _gb(b["fp4r"])),
        ("fp4x bytes", _gb(b["fp4x"]) if b["fp4x"] else "n/a (needs NVFP4/MXFP4 experts)"),
        ("ckpt_id", str(info.ckpt_id)),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def cmd_inspect(args: argparse.Namespace) -> int:
    from .checkpoint import open_checkpoint

    ck = open_checkpoint(args.checkpoint)
    try:
        print(json.dumps(ck.info.to_dict(), indent=1) if args.json else format_info(ck.info))
    finally:
        ck.close()
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    from .study import format_report, study_checkpoint

    report = study_checkpoint(
        args.checkpoint,
        zero_mode=args.zero_mode,
        limit=args.limit,
        progress=None if args.progress else False,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(format_report(report))
    return 1 if args.strict and not report["gate"]["passed"] else 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .convert import ConvertOptions, convert

    opts = ConvertOptions(zero_mode=args.zero_mode, mode=args.mode, fp4_tier=args.fp4_tier)
    res = convert(
        args.checkpoint,
        args.out,
        opts,
        dry_run=args.dry_run,
        progress=None if args.progress else False,
    )
    tb = res.plan.tier_bytes
    print(
        f"W2 experts {_gb(tb['w2'])}, FP4 tier {_gb(tb['fp4'])}, dense {_gb(tb['dense'])}, "
        f"total {_gb(tb['total'])} in {len(res.plan.shards)} shard(s)"
    )
    if res.dry_run:
        print("dry run: nothing written")
    else:
        kept = f", {len(res.kept_shards)} kept from an earlier run" if res.kept_shards else ""
        print(f"wrote {res.out} ({len(res.written_shards)} shard(s){kept}) in {res.seconds:.1f} s")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .quality import (
        DEFAULT_VARIANTS,
        EvalOptions,
        check_report_path,
        evaluate,
        format_table,
        load_tokens,
        write_report,
    )

    tokens = load_tokens(args.tokens)
    if args.json:
        check_report_path(args.json)
    variants = tuple(args.variant) if args.variant else DEFAULT_VARIANTS
    if variants[0] != "bf16":
        variants = ("bf16",) + tuple(v for v in variants if v != "bf16")
    opts = EvalOptions(
        variants=variants,
        window=args.window,
        max_tokens=args.max_tokens,
        n_boot=args.n_boot,
        extra={"token_file": str(args.tokens)},
    )
    report = evaluate(args.checkpoint, tokens, opts)
    print(format_table(report))
    if args.json:
        write_report(report, args.json)
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Add inspect, study, convert and eval to a subparsers object (shared with `moet`)."""
    p = sub.add_parser(
        "inspect",
        help="what a MoE checkpoint holds: format, geometry, bytes per tier",
        description="Read config.json and the safetensors headers (not the weights) "
        "and report the experts' format, layers, geometry, bytes per tier, ckpt_id.",
    )
    p.add_argument("checkpoint", help="checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--json", action="store_true", help="print the CheckpointInfo as JSON")
    p.set_defaults(func=cmd_inspect)

    zero_help = (
        "exact-zero sign balancing: auto (re-assign by k parity when one sign holds under "
        "5%% of a tensor's zeros), sign (keep sign bits), alt (always k parity)"
    )
    p = sub.add_parser(
        "study",
        help="codebook study: symmetric W2 vs the L2-optimal 4-level codebook",
        description="Per expert projection, rel-RMS and signed bias of the symmetric "
        "{-4,-1,1,4} codebook vs the L2-optimal asymmetric one, and the GATE verdict.",
    )
    p.add_argument("checkpoint")
    p.add_argument("--zero-mode", default="auto", choices=["auto", "sign", "alt"], help=zero_help)
    p.add_argument("--limit", type=int, default=None, help="study only the first N projections")
    p.add_argument("--json", metavar="FILE", help="also write the full per-tensor report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when the gate fails")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=cmd_study)

    p = sub.add_parser(
        "convert",
        help="write a moet checkpoint (2-bit experts, dense untouched)",
        description="Re-quantize the routed experts to W2 exactly (float64) and copy "
        "every other tensor. Resumable: rerun the same command after an interruption.",
    )
    p.add_argument("checkpoint", help="source checkpoint directory")
    p.add_argument("out", help="output directory (new or empty, or an interrupted conversion)")
    p.add_argument("--zero-mode", default="auto", choices=["auto", "sign", "alt"], help=zero_help)
    p.add_argument(
        "--mode",
        default="reference",
        choices=["reference", "optimal"],
        help="reference: the specified quantizer; optimal: per-block exponent search",
    )
    p.add_argument(
        "--fp4-tier",
        default="none",
        choices=["none", "fp4r", "fp4x"],
        help="also store FP4 tier data: fp4r (refinement plane), fp4x (the source's "
        "own NVFP4/MXFP4 data)",
    )
    p.add_argument("--dry-run", action="store_true", help="print sizes per tier, write nothing")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=cmd_convert)

    from .quality import MODELOPT_CONFIGS, VARIANTS  # numpy only: cheap to import here

    p = sub.add_parser(
        "eval",
        help="quality harness: bf16 vs W2 variants (perplexity, top-1 agreement, KL)",
        description="Run the checkpoint through transformers (float32) with each variant's "
        "dequantized routed experts over a token file; report perplexity, top-1 agreement and "
        "KL against bf16, paired-bootstrap significance, greedy loops, per-tensor rel-RMS/bias. "
        "Needs transformers.",
    )
    p.add_argument("checkpoint", help="a bf16 Hugging Face checkpoint transformers can load")
    p.add_argument("--tokens", required=True, help=".npy of token ids (1-D)")
    p.add_argument(
        "--variant",
        action="append",
        choices=[*VARIANTS, *MODELOPT_CONFIGS],
        help="(repeatable; default: bf16 and the four W2 variants; bf16 always runs first; "
        "fp4r: every expert at the FP4 tier's values; fp8/nvfp4 quantize the checkpoint with "
        "nvidia-modelopt)",
    )
    p.add_argument("--window", type=int, default=1024, help="tokens per window (context)")
    p.add_argument("--max-tokens", type=int, default=None, help="use the first N tokens")
    p.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    p.set_defaults(func=cmd_eval)


def run(args: argparse.Namespace, prog: str) -> int:
    """Run a parsed subcommand; user errors become one line on stderr and exit code 2."""
    try:
        return int(args.func(args))
    except MoetError as e:
        print(f"{prog}: error: {e.message}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; run the same command again to resume", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moet-quant", description="moet-quant: exact 2-bit re-quantization of MoE checkpoints"
    )
    parser.add_argument("--version", action="version", version=f"moet-quant {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_subcommands(sub)
    args = parser.parse_args(argv)
    return run(args, "moet-quant")


if __name__ == "__main__":
    sys.exit(main())
