"""The "moet" quantization method inside vLLM: W2 routed experts, everything else untouched.

Imported by `plugin.register()` only when vLLM is installed. The classes live at module level
because vLLM pickles its configuration (quantization config included) into the engine process.

Where the experts come from:
* a **moet checkpoint** (`moet convert`): its `.w2_codes` / `.w2_scales` tensors stream through
  vLLM's loader into four uint8 parameters per MoE layer (`w13_w2_codes` [E, 2I, H/4],
  `w13_w2_scales` [E, 2I, H/32], `w2_w2_codes` [E, H, I/4], `w2_w2_scales` [E, H, I/32]: vLLM's
  expert mapping names them `w13_`/`w2_` + the checkpoint suffix), TP-sliced by vLLM's helpers;
* an **official checkpoint** with `--quantization moet`: vLLM skips the expert tensors, and after
  loading each MoE layer reads its experts through `experts.ExpertSource` (exact re-quantization
  by moet-quant), or from the persistent pack cache when an earlier boot wrote it.

Routing and compute (monolithic): `apply_monolithic` receives the router logits, routes with
moet-kernels' `route_reference` and runs its torch MoE reference in `exact` mode (the CPU path
and the GPU kernels' oracle).

Tiered residency (`MoetConfig.gpu_pool` other than "all"): the layers hold no expert parameters;
every MoE layer's experts reach moet-store packs at load, and `apply_monolithic` reads them from
the residency manager's pool of slots through its slot table (residency/manager.py), counting
misses that the runner hook (compat point 7) fetches and replays.
"""

from __future__ import annotations

import logging
import re
import time
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

from moet_kernels.reference import (
    Routing,
    route_reference,
    w2_moe_reference,
    w2_moe_slots_reference,
)
from moet_quant.arch import family_for
from moet_quant.checkpoint import text_config

from . import compat
from .compat import MoetVllmError
from .config import MoetConfig, pool_slots, resolve
from .dense import DenseDequantizer, dense_method
from .experts import ExpertSource, OfficialSource
from .packcache import ExpertPackCache
from .residency import manager as residency
from .residency.manager import MoetResidencyError, ResidencyManager
from .residency.sizing import GIB, boot_floor

log = logging.getLogger("vllm.moet")
PARAMS = {  # RowLayout section -> parameter name
    "w13_codes": "w13_w2_codes",
    "w13_scales": "w13_w2_scales",
    "w2_codes": "w2_w2_codes",
    "w2_scales": "w2_w2_scales",
}


def _layer_index(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name + ".")
    if m is None:
        raise MoetVllmError(f"cannot tell the model layer of MoE module {name!r}")
    return int(m.group(1))


class MoetLoadSession:
    """Per worker process: the expert source and pack cache shared by all MoE layers."""

    def __init__(self, cfg: MoetConfig, model_path: str, tp_rank: int, tp_size: int):
        self.cfg = cfg
        self.source = ExpertSource.open(model_path, cfg, tp_rank, tp_size)
        self.cache = ExpertPackCache(
            cfg,
            self.source.ckpt_id,
            self.source.layout,
            n_layers=len(self.source.moe_layers),
            n_experts=self.source.n_experts,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.pending = set(self.source.moe_layers)
        self.from_pack = self.quantized = 0
        self.seconds = 0.0
        log.info(
            "moet: experts of %s: %s (%s, %d MoE layers x %d experts); pack cache %s",
            model_path,
            self.source.kind,
            self.source.source_format,
            len(self.source.moe_layers),
            self.source.n_experts,
            self.cache.reason,
        )

    def sections(self, model_layer: int, keep: bool = True) -> dict | None:
        """One MoE layer's expert sections, from the pack cache or the checkpoint (then written
        to the cache). With `keep=False` (tiered residency) the layer only has to reach the
        packs: a cached layer is not read back."""
        t0 = time.perf_counter()
        ordinal = self.source.moe_layers.index(model_layer)
        secs = None
        if keep:
            secs = self.cache.read_layer(ordinal)
        elif ordinal in self.cache.cached_layers():
            secs = {}
        if secs is None:
            secs = self.source.layer(model_layer)
            self.cache.write_layer(ordinal, secs)
            self.quantized += 1
            if not keep and not self.cache.enabled:
                raise MoetResidencyError(
                    f"moet: tiered residency (gpu_pool={self.cfg.gpu_pool!r}) serves experts "
                    f"from the pack files, but the pack cache is off ({self.cache.reason}); "
                    "give it a writable cache_dir with room for the experts, or gpu_pool='all'"
                )
        else:
            self.from_pack += 1
        self.seconds += time.perf_counter() - t0
        self.pending.discard(model_layer)
        if not self.pending:
            log.info(
                "moet: expert weights ready in %.2f s: %d layers %s, %d from the pack cache",
                self.seconds,
                self.quantized,
                "re-quantized" if self.source.kind == OfficialSource.kind else "read as W2",
                self.from_pack,
            )
        return secs if keep else None

    @property
    def done(self) -> bool:
        return not self.pending

    def close(self) -> None:
        self.cache.close()
        self.source.close()


class MoetMoEMethod(FusedMoEMethodBase):
    """Routed experts as W2 codes and UE8M0 scales (see the module doc)."""

    def __init__(self, moe_config, quant_config: MoetQuantConfig, prefix: str):
        super().__init__(moe_config)
        self.quant_config = quant_config
        self.model_layer = _layer_index(prefix)
        self.routing: Routing | None = None  # from the layer, once it is loaded

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
        session = self.quant_config.load_session(layer)
        if session is None:
            return  # a moet checkpoint: the parameters were streamed in
        if self.quant_config.tiered:
            session.sections(self.model_layer, keep=False)  # into the packs, nothing resident
            if session.done:
                self.quant_config.start_residency(session, layer)
            return
        secs = session.sections(self.model_layer)
        if session.done:
            session.close()
        with torch.no_grad():
            for section, name in PARAMS.items():
                param = getattr(layer, name)
                src = torch.from_numpy(secs[section])
                if tuple(src.shape) != tuple(param.shape):
                    raise MoetVllmError(
                        f"{layer.layer_name}.{name}: experts of the checkpoint "
                        f"give {list(src.shape)}, the layer has "
                        f"{list(param.shape)}"
                    )
                param.copy_(src)

    # monolithic: moet owns routing and compute (the GPU route op will also write the miss counter
    # of tiered residency), so vLLM hands over the router logits, not its top-k choice
    @property
    def is_monolithic(self) -> bool:
        return True

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        weights, ids = route_reference(router_logits, self.routing, layer.e_score_correction_bias)
        mgr = residency.active()
        if mgr is not None:
            slot_table, routed = mgr.layer_tables(self.model_layer, ids)
            out = w2_moe_slots_reference(
                x,
                ids,
                weights,
                mgr.pool,
                slot_table,
                mgr.layout,
                mgr.n_real_tokens if mgr.n_real_tokens is not None else x.shape[0],
                mgr.miss_count,
                routed,
            )
            return out.to(x.dtype)
        out = w2_moe_reference(
            x,
            ids,
            weights,
            (layer.w13_w2_codes, layer.w13_w2_scales),
            (layer.w2_w2_codes, layer.w2_w2_scales),
        )
        return out.to(x.dtype)


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
        # before the model is built: vLLM binds each RoPE module's forward at construction
        compat.fix_cpu_rope_for_3d_inputs()

    def __getstate__(self):  # what travels to the engine process: never a live load session
        state = dict(self.__dict__)
        state["_session"] = None
        return state

    def __setstate__(self, state):  # in the engine/worker process, before the model is built
        self.__dict__.update(state)
        compat.fix_cpu_rope_for_3d_inputs()

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
        """The resolved MoetConfig; the first call (at boot, with vLLM's --additional-config and
        model config) fixes it and sets up the dense layers."""
        if self._cfg is None:
            if model_config is not None:  # an architecture moet cannot serve: refused at boot
                hf = model_config.hf_config.to_dict()
                family_for(text_config(hf), f"{model_config.model}/config.json")
            qc = self.checkpoint_qc if self.is_moet_checkpoint else None
            cfg = resolve(qc, additional_config or {})
            self._cfg = cfg
            # tiered: experts reach the packs through moet-quant, never vLLM's loader
            compat.skip_routed_expert_tensors(not self.is_moet_checkpoint or self.tiered)
            if self.tiered:
                self._serving = compat.check_residency_supported(cfg)
                compat.wrap_model_forward(residency.run_step)
            self.dense_policy = self._dense_policy(cfg, model_config)
            origin = "a moet checkpoint" if self.is_moet_checkpoint else "re-quantization at load"
            log.info(
                "moet: routed experts as %s from %s; compute: exact torch reference; %s",
                self._cfg.format,
                origin,
                f"tiered residency (gpu_pool={cfg.gpu_pool!r}, host tier {cfg.host_tier})"
                if self.tiered
                else "all experts resident",
            )
        return self._cfg

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
        """Tiered residency: experts live in a pool of slots, fetched from the packs on demand."""
        return self._cfg is not None and self._cfg.gpu_pool != "all"

    def start_residency(self, session: MoetLoadSession, layer) -> None:
        """After the last MoE layer reached the packs: the pool, its host tier, the manager."""
        cfg, src = self._cfg, session.source
        mtp = src.mtp_layers
        n_moe = len(src.moe_layers) - len(mtp)  # the tiered MoE layers (MTP's are pinned)
        n_tiered_keys = n_moe * src.n_experts
        max_num_seqs, num_spec = self._serving
        floor = boot_floor(n_moe, layer.top_k, 1 + num_spec, max_num_seqs)
        if cfg.gpu_pool == "auto":  # sized once the KV cache is allocated; until then one
            n_slots = 1  # slot and the staging area serve vLLM's profiling passes (streamed)
        else:
            n_slots = pool_slots(cfg, n_tiered_keys) or n_tiered_keys
            if n_slots < floor and not cfg.below_floor_ok:
                raise MoetResidencyError(
                    f"moet: gpu_pool={cfg.gpu_pool!r} gives {n_slots} expert slots, below the "
                    f"boot floor of {floor} (1.15 x {n_moe} MoE layers x top-{layer.top_k} x "
                    f"{1 + num_spec} tokens/step x min(max_num_seqs, 4)): set gpu_pool >= "
                    f"{floor}, lower max_num_seqs, or accept replays on most steps with "
                    "below_floor_ok=true"
                )
        store = session.cache.open_store(cfg.host_tier, cfg.host_arena)
        mgr = ResidencyManager(
            src.layout,
            src.moe_layers,
            src.n_experts,
            n_slots,
            store,
            pinned_layers=mtp,
            miss_mode=cfg.miss_mode,
            miss_tolerance=cfg.miss_tolerance,
            max_replays=cfg.max_replays,
            kpi_every=cfg.kpi_every,
            hot_path=session.cache.hot_path(),
            predict=cfg.predict,
            rank=layer.moe_config.tp_rank,
        )
        if cfg.gpu_pool == "auto":
            mgr.auto = residency.AutoPool(
                int(cfg.pool_reserve_gib * GIB), floor, cfg.below_floor_ok
            )
            compat.before_warm_up(residency.size_auto_pool)
        session.source.close()
        residency.activate(mgr)

    def load_session(self, layer) -> MoetLoadSession | None:
        """The shared expert source for an official checkpoint, or any checkpoint under tiered
        residency (None for a moet checkpoint with every expert resident)."""
        if self.is_moet_checkpoint and not self.tiered:
            return None
        if self._session is None:
            from vllm.config import get_current_vllm_config

            model = get_current_vllm_config().model_config.model
            moe = layer.moe_config
            self._session = MoetLoadSession(self.config(), model, moe.tp_rank, moe.tp_size)
        return self._session
