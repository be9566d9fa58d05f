"""`MoetConfig`: the one typed configuration of the plugin (design.md, Residency: Configuration).

Precedence, lowest first: the checkpoint's `quantization_config` < vLLM's `--additional-config`
(`{"moet": {...}}`) < `MOET_*` environment variables. Every field below that users may set is
documented in docs/vllm.md, and every `MOET_*` variable is a field (a test holds both). Unknown
keys, bad values and impossible combinations are `MoetConfigError`s at boot, naming the key, the
value found, what is allowed and where it came from.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moet_quant import w2
from moet_quant.convert import FP4_TIERS

from .compat import MoetVllmError

ENV_PREFIX = "MOET_"
# MOET_* variables that belong to the project's other packages, builds and scripts, not settings
# of this one (any other unknown MOET_* variable is refused: it is most likely a misspelt setting)
NOT_SETTINGS = (
    "MOET_KERNELS_",  # moet-kernels (MOET_KERNELS_CUBIN_DIR) and its build (MOET_KERNELS_ARCHS)
    "MOET_STORE_",  # moet-store's build
    "MOET_NVCC",  # cmake/: the CUDA compiler and its flags
    "MOET_CUOBJDUMP",
    "MOET_WITH_LIBURING",
    "MOET_COMMIT",  # bench/provenance.py: the commit of a tree that travels without .git
    "MOET_SITE",  # bench/serving_gpu.sh: where the packages are installed
)


class MoetConfigError(MoetVllmError):
    """A configuration key, value or combination that moet cannot serve with."""


@dataclass(frozen=True)
class MoetConfig:
    # -- what the experts are (from a moet checkpoint's quantization_config, or the defaults used
    #    when an official checkpoint is re-quantized at load) --
    format: str = w2.FORMAT
    zero_mode: str = "auto"
    mode: str = "reference"
    fp4_tier: str = "none"
    # -- the FP4 tier (fp4_tier != "none"; docs/vllm.md, "The FP4 tier") --
    # device slots of FP4 expert rows beside the W2 pool, filled by heat: N slots, "P%" of the
    # (MoE layer, expert) pairs (at most 25% by default: docs/quality.md's curve), or "auto":
    # up to FP4_AUTO_SHARE of them, as many as memory holds beside the W2 pool
    fp4_pool: str = "25%"
    # the confidence gate: a decode step whose token's confidence (gate_metric: "margin", the
    # top-2 log-probability gap in nats, or "prob", the top-1 probability) is below gate_tau times
    # the share of its routed experts at W2 (outside the FP4 pool) promotes them to FP4 and runs
    # once more; defaults from docs/quality.md's curve
    gate: bool = True
    gate_metric: str = "margin"
    gate_tau: float = 1.0
    # -- how they are computed and cached --
    compute: str = "auto"  # auto: moet-kernels where they run, else the torch reference
    dense: str = "auto"  # quantized dense layers: the checkpoint's method, or dequantized at load
    pack_cache: bool = True  # persistent quantization cache (moet-store packs)
    cache_dir: str | None = None  # default: $XDG_CACHE_HOME/moet
    # -- tiered residency (docs/residency.md) --
    gpu_pool: str = "all"  # expert slots on the device: "all" (no tiering), N, "P%" or "auto"
    pool_reserve_gib: float = 2.0  # gpu_pool=auto: device memory left free after the pool
    host_tier: str = "ram"  # where non-resident experts come from: ram, pagecache, tiered
    host_arena: str = "auto"  # host_tier=tiered: the pinned arena in GiB, or "auto"
    miss_mode: str = "strict"  # strict: fail rather than serve zeroed experts; approximate
    miss_tolerance: int = 0  # approximate mode: skip the replay when <= this many pairs missed
    max_replays: int = 4  # replays per step (second-order misses) before the step fails
    kpi_every: int = 100  # steps between KPI log lines (0: off)
    below_floor_ok: bool = False  # consent to a pool below the boot floor (replays every step)
    # fetch the experts a decode step's tokens are predicted to route first; auto: with the torch
    # reference only (under the kernels its host work and extra rows cost more than it saves)
    predict: bool | str = "auto"
    # the pool's missing experts read in place from pinned host memory instead of fetched and
    # replayed (host_tier=ram); auto: on a GPU with the kernels
    read_in_place: bool | str = "auto"
    # -- checkpoint metadata (read from the checkpoint, never set by users) --
    modules_not_converted: tuple[str, ...] = ()
    source_format: str | None = None
    source_ckpt_id: str | None = None
    source_quantization_config: Mapping[str, Any] | None = field(default=None, compare=False)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)  # field -> origin

    @property
    def serves_fp4(self) -> bool:
        """An FP4 tier is served: fp4r or fp4x rows in a pool of at least one slot."""
        return self.fp4_tier != "none" and self.fp4_pool != "0"


CHOICES: dict[str, tuple[str, ...]] = {
    "format": (w2.FORMAT,),
    "zero_mode": w2.ZERO_MODES,
    "mode": w2.MODES,
    "fp4_tier": FP4_TIERS,
    "gate_metric": ("margin", "prob"),
    "compute": ("auto", "kernel", "exact", "oracle"),
    "dense": ("auto", "checkpoint", "dequantize"),
    "host_tier": ("ram", "pagecache", "tiered"),
    "miss_mode": ("strict", "approximate"),
}
USER_FIELDS = (
    "zero_mode",
    "mode",
    "fp4_tier",
    "fp4_pool",
    "gate",
    "gate_metric",
    "gate_tau",
    "compute",
    "dense",
    "pack_cache",
    "cache_dir",
    "gpu_pool",
    "pool_reserve_gib",
    "host_tier",
    "host_arena",
    "miss_mode",
    "miss_tolerance",
    "max_replays",
    "kpi_every",
    "below_floor_ok",
    "predict",
    "read_in_place",
)
INT_FIELDS = {"miss_tolerance": 0, "max_replays": 1, "kpi_every": 0}  # field -> minimum
AUTO_BOOLS = ("predict", "read_in_place")  # booleans that also take "auto"
# what a running server takes from `moet tune` (residency/metrics.py's run directory)
RUNTIME_FIELDS = ("miss_mode", "miss_tolerance", "max_replays", "kpi_every", "gate", "gate_tau")


def coerce_runtime(values: Mapping[str, Any], origin: str) -> dict:
    """Validate runtime-tunable settings (`moet tune`) with the boot-time rules."""
    unknown = sorted(set(values) - set(RUNTIME_FIELDS))
    if unknown:
        raise MoetConfigError(
            f"{origin}: {', '.join(unknown)} cannot change at runtime; runtime-tunable: "
            f"{', '.join(RUNTIME_FIELDS)}"
        )
    out = {k: _coerce(k, v, origin) for k, v in values.items()}
    if out.get("miss_tolerance") and out.get("miss_mode", "approximate") != "approximate":
        raise MoetConfigError(f"{origin}: miss_tolerance needs miss_mode='approximate'")
    return out


CHECKPOINT_FIELDS = USER_FIELDS + (
    "format",
    "modules_not_converted",
    "source_format",
    "source_ckpt_id",
    "source_quantization_config",
)
# keys a moet checkpoint's quantization_config carries that are not MoetConfig fields
CHECKPOINT_ONLY_KEYS = ("quant_method", "block_size", "moet_quant_version", "expert_source")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _coerce(name: str, value: Any, origin: str) -> Any:
    def bad(expected: str) -> MoetConfigError:
        return MoetConfigError(f"{origin}: {name}={value!r} is not valid; expected {expected}")

    if name in CHOICES:
        if value not in CHOICES[name]:
            raise bad(f"one of {', '.join(CHOICES[name])}")
        return value
    if name in INT_FIELDS:
        try:
            n = int(str(value).strip()) if not isinstance(value, bool) else None
        except ValueError:
            n = None
        if n is None or n < INT_FIELDS[name]:
            raise bad(f"an integer >= {INT_FIELDS[name]}")
        return n
    if name == "gpu_pool":
        text = str(value).strip()
        if text in ("all", "auto") or (text.endswith("%") and _is_percent(text[:-1])):
            return text
        if text.isascii() and text.isdigit() and int(text) > 0:
            return text
        raise bad(
            '"all", "auto", a number of expert slots (> 0), or a percentage of the experts ("25%")'
        )
    if name == "fp4_pool":
        text = str(value).strip()
        if (text.endswith("%") and _is_percent(text[:-1])) or (text.isascii() and text.isdigit()):
            return text
        if text == "auto":
            return text
        raise bad(
            'a number of FP4 expert slots (>= 0), a percentage of the experts ("25%"), or "auto"'
        )
    if name in ("pool_reserve_gib", "host_arena", "gate_tau"):
        text = str(value).strip()
        if name == "host_arena" and text == "auto":
            return text
        try:
            gib = float(text) if not isinstance(value, bool) else -1.0
        except ValueError:
            gib = -1.0
        if not (math.isfinite(gib) and gib >= 0):
            if name == "gate_tau":
                raise bad("a threshold >= 0 (nats for gate_metric=margin, a probability for prob)")
            raise bad(('"auto" or ' if name == "host_arena" else "") + "a size in GiB (>= 0)")
        return text if name == "host_arena" else gib
    if name in ("pack_cache", "below_floor_ok", "gate", *AUTO_BOOLS):
        if name in AUTO_BOOLS and value == "auto":
            return value
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise bad("a boolean (1/0, true/false)" + (' or "auto"' if name in AUTO_BOOLS else ""))
    if name == "cache_dir":
        if value is None or (isinstance(value, str) and value):
            return value
        raise bad("a directory path")
    if name == "modules_not_converted":
        if not isinstance(value, list | tuple) or not all(isinstance(m, str) for m in value):
            raise bad("a list of module names")
        return tuple(value)
    if name in ("source_format", "source_ckpt_id"):
        if value is None or isinstance(value, str):
            return value
        raise bad("a string")
    if name == "source_quantization_config":
        if value is None or isinstance(value, dict):
            return value
        raise bad("an object")
    raise AssertionError(name)


def _is_percent(text: str) -> bool:
    try:
        return 0 < float(text) <= 100
    except ValueError:
        return False


def _apply(
    values: dict,
    origins: dict,
    layer: Mapping[str, Any],
    allowed: tuple[str, ...],
    ignored: tuple[str, ...],
    origin: str,
) -> None:
    unknown = sorted(set(layer) - set(allowed) - set(ignored))
    if unknown:
        raise MoetConfigError(
            f"{origin}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(allowed)}"
        )
    for key in allowed:
        if key in layer:
            values[key] = _coerce(key, layer[key], origin)
            origins[key] = origin


def resolve(
    checkpoint_qc: Mapping[str, Any] | None = None,
    additional_config: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    probe_device: bool = True,
) -> MoetConfig:
    """Build the MoetConfig from its three sources (lowest precedence first) and validate it.
    `probe_device=False` leaves out the one check that initializes CUDA (compute='kernel': do
    the kernels run here?), for a process that must not hold a CUDA context (`moet serve`'s)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    if checkpoint_qc:
        if checkpoint_qc.get("quant_method") not in (None, "moet"):
            raise MoetConfigError(
                f"checkpoint quantization_config: quant_method "
                f"{checkpoint_qc.get('quant_method')!r} is not 'moet'"
            )
        if checkpoint_qc.get("block_size", w2.BLOCK) != w2.BLOCK:
            raise MoetConfigError(
                f"checkpoint quantization_config: block_size="
                f"{checkpoint_qc['block_size']!r}; this moet serves block "
                f"size {w2.BLOCK} only: reconvert the checkpoint"
            )
        _apply(
            values,
            origins,
            checkpoint_qc,
            CHECKPOINT_FIELDS,
            CHECKPOINT_ONLY_KEYS,
            "checkpoint quantization_config",
        )
    moet_extra = (additional_config or {}).get("moet")
    if moet_extra is not None:
        if not isinstance(moet_extra, Mapping):
            raise MoetConfigError(
                f"--additional-config: 'moet' must be an object of settings, "
                f"found {type(moet_extra).__name__}"
            )
        _apply(values, origins, moet_extra, USER_FIELDS, (), "--additional-config moet")
    env = {
        k[len(ENV_PREFIX) :].lower(): v
        for k, v in environ.items()
        if k.startswith(ENV_PREFIX) and not k.startswith(NOT_SETTINGS)
    }
    unknown = sorted(env_name(k) for k in env if k not in USER_FIELDS)
    if unknown:
        raise MoetConfigError(
            f"environment: unknown variable(s) {', '.join(unknown)}; known: "
            f"{', '.join(env_name(f) for f in USER_FIELDS)}"
        )
    for key, value in env.items():
        values[key] = _coerce(key, value, f"environment {env_name(key)}")
        origins[key] = f"environment {env_name(key)}"
    cfg = MoetConfig(**values, sources=origins)
    _check_combinations(cfg, probe_device)
    return cfg


def _check_combinations(cfg: MoetConfig, probe_device: bool) -> None:
    if cfg.compute == "kernel" and probe_device:
        from moet_kernels.loader import kernels_available

        ok, reason = kernels_available()
        if not ok:
            raise MoetConfigError(
                f"{cfg.sources.get('compute', 'config')}: compute='kernel' but "
                f"the GPU kernels are unavailable ({reason}); use compute='auto' "
                "or 'exact'"
            )
    if cfg.mode == "optimal" and cfg.format != w2.FORMAT:
        raise MoetConfigError(f"mode 'optimal' needs format {w2.FORMAT}, found {cfg.format}")
    where = cfg.sources.get
    if cfg.miss_tolerance and cfg.miss_mode != "approximate":
        raise MoetConfigError(
            f"{where('miss_tolerance', 'config')}: miss_tolerance={cfg.miss_tolerance} skips "
            "replays, which only miss_mode='approximate' allows (strict never serves zeroed "
            "experts); set miss_mode='approximate' too, or miss_tolerance=0"
        )
    if cfg.serves_fp4 and not cfg.pack_cache:
        raise MoetConfigError(
            f"{where('fp4_tier', 'config')}: fp4_tier={cfg.fp4_tier!r} serves FP4 rows from the "
            "pack files of the persistent cache, but pack_cache is off "
            f"({where('pack_cache', 'config')}); turn pack_cache on or use fp4_tier='none'"
        )
    if cfg.gpu_pool != "all" and not cfg.pack_cache:
        raise MoetConfigError(
            f"{where('gpu_pool', 'config')}: gpu_pool={cfg.gpu_pool!r} serves experts from the "
            "pack files of the persistent cache, but pack_cache is off "
            f"({where('pack_cache', 'config')}); turn pack_cache on or use gpu_pool='all'"
        )


def pool_slots(cfg: MoetConfig, n_keys: int) -> int | None:
    """The device pool's size in expert slots for a model of `n_keys` (MoE layer, expert) pairs;
    None when every expert is resident (no tiering). "auto" is sized once the KV cache is
    allocated (residency.sizing.auto_slots), not here."""
    if cfg.gpu_pool == "all":
        return None
    if cfg.gpu_pool == "auto":
        raise ValueError("gpu_pool='auto' has no size before the KV cache is allocated")
    n = size_slots(cfg.gpu_pool, n_keys)
    return None if n >= n_keys else max(n, 1)


def size_slots(size: str, n_keys: int) -> int:
    """A pool size as gpu_pool and fp4_pool take it: "N" slots, or "P%" of the `n_keys` pairs,
    rounded down (ValueError for other text)."""
    return int(n_keys * float(size[:-1]) / 100) if size.endswith("%") else int(size)


FP4_AUTO_SHARE = 0.25  # fp4_pool=auto: at most this share of the pairs (docs/quality.md)


def fp4_pool_slots(cfg: MoetConfig, n_keys: int) -> int:
    """The FP4 pool's size in slots for `n_keys` (MoE layer, expert) pairs (0: no FP4 tier;
    "auto": its cap, FP4_AUTO_SHARE, until memory sizes it before graph capture)."""
    if not cfg.serves_fp4:
        return 0
    if cfg.fp4_pool == "auto":
        return int(n_keys * FP4_AUTO_SHARE)
    return min(n_keys, size_slots(cfg.fp4_pool, n_keys))


def describe() -> list[tuple[str, str, str]]:
    """(field, MOET_* variable, default) for every user-settable field: the docs table's rows."""
    defaults = {f.name: f.default for f in dataclasses.fields(MoetConfig)}
    return [(name, env_name(name), repr(defaults[name])) for name in USER_FIELDS]
