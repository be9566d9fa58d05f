"""MoetConfig: precedence, validation, and every MOET_* variable being a documented field."""

import re
from pathlib import Path

import pytest

from moet_vllm import config
from moet_vllm.config import MoetConfigError, resolve

ROOT = Path(__file__).resolve().parents[3]
CKPT_QC = {
    "quant_method": "moet",
    "format": "w2-ue8m0b32-v1",
    "zero_mode": "sign",
    "mode": "reference",
    "block_size": 32,
    "fp4_tier": "none",
    "modules_not_converted": ["lm_head"],
    "source_format": "bf16",
    "source_ckpt_id": "abc",
    "source_quantization_config": None,
    "moet_quant_version": "0.1.0",
}


def test_defaults_without_any_source():
    cfg = resolve(None, None, {})
    assert (cfg.zero_mode, cfg.mode, cfg.fp4_tier, cfg.compute, cfg.pack_cache) == (
        "auto",
        "reference",
        "none",
        "auto",
        True,
    )


def test_precedence_checkpoint_then_additional_config_then_environment():
    cfg = resolve(CKPT_QC, None, {})
    assert cfg.zero_mode == "sign" and cfg.sources["zero_mode"] == "checkpoint quantization_config"
    assert cfg.modules_not_converted == ("lm_head",) and cfg.source_ckpt_id == "abc"
    cfg = resolve(CKPT_QC, {"moet": {"zero_mode": "alt", "pack_cache": False}}, {})
    assert cfg.zero_mode == "alt" and cfg.pack_cache is False
    assert cfg.sources["zero_mode"] == "--additional-config moet"
    cfg = resolve(
        CKPT_QC,
        {"moet": {"zero_mode": "alt"}},
        {"MOET_ZERO_MODE": "auto", "MOET_PACK_CACHE": "0", "PATH": "/bin"},
    )
    assert cfg.zero_mode == "auto" and cfg.pack_cache is False
    assert cfg.sources["zero_mode"] == "environment MOET_ZERO_MODE"


@pytest.mark.parametrize(
    "args, match",
    [
        (
            ({"moet": {"zero_mod": "alt"}}, {}),
            r"--additional-config moet: unknown key\(s\) zero_mod",
        ),
        ((None, {"MOET_ZEROMODE": "alt"}), r"environment: unknown variable\(s\) MOET_ZEROMODE"),
        (
            (None, {"MOET_ZERO_MODE": "maybe"}),
            r"MOET_ZERO_MODE: zero_mode='maybe'.*auto, sign, alt",
        ),
        ((None, {"MOET_PACK_CACHE": "perhaps"}), r"pack_cache='perhaps'.*boolean"),
        (({"moet": "fast"}, {}), r"'moet' must be an object"),
        (({"moet": {"source_ckpt_id": "x"}}, {}), r"unknown key\(s\) source_ckpt_id"),
    ],
)
def test_bad_keys_and_values_are_named(args, match):
    with pytest.raises(MoetConfigError, match=match):
        resolve(None, *args)


def test_the_projects_other_variables_are_not_settings():
    """MOET_* variables of moet-kernels, the builds and the scripts (MOET_KERNELS_CUBIN_DIR, ...)
    leave the settings alone; a misspelt setting beside them is still refused."""
    others = {"MOET_KERNELS_CUBIN_DIR": "/x", "MOET_NVCC_FLAGS": "-O3", "MOET_COMMIT": "abc"}
    assert resolve(None, None, others) == resolve(None, None, {})
    with pytest.raises(MoetConfigError, match=r"unknown variable\(s\) MOET_GPUPOOL"):
        resolve(None, None, {**others, "MOET_GPUPOOL": "50%"})


def test_checkpoint_errors():
    with pytest.raises(MoetConfigError, match="block_size=64"):
        resolve({**CKPT_QC, "block_size": 64}, None, {})
    with pytest.raises(MoetConfigError, match="format='w2-other'"):
        resolve({**CKPT_QC, "format": "w2-other"}, None, {})
    with pytest.raises(MoetConfigError, match=r"unknown key\(s\) surprise"):
        resolve({**CKPT_QC, "surprise": 1}, None, {})


def test_kernel_compute_without_cuda_is_refused():
    with pytest.raises(MoetConfigError, match="compute='kernel'.*unavailable"):
        resolve(None, None, {"MOET_COMPUTE": "kernel"})


def test_every_env_variable_is_a_documented_field():
    doc = (ROOT / "docs" / "vllm.md").read_text()
    for name, env, _default in config.describe():
        assert f"`{env}`" in doc, f"docs/vllm.md does not document {env}"
        assert f"`{name}`" in doc, f"docs/vllm.md does not document the field {name}"
    src = ROOT / "packages" / "moet-vllm" / "src"
    used = set()
    for py in src.rglob("*.py"):
        used |= set(re.findall(r"\bMOET_[A-Z_]+\b", py.read_text()))
    used = {u for u in used if not u.startswith(config.NOT_SETTINGS)}  # declared not settings
    fields = {env for _, env, _ in config.describe()}
    assert used <= fields, (
        f"MOET_* variables read in code but not MoetConfig fields: {used - fields}"
    )


def test_residency_fields_and_their_combinations():
    cfg = resolve(None, {"moet": {"gpu_pool": "25%", "host_tier": "pagecache"}}, {})
    assert config.pool_slots(cfg, 200) == 50 and cfg.host_tier == "pagecache"
    assert config.pool_slots(resolve(None, None, {"MOET_GPU_POOL": "40"}), 200) == 40
    assert config.pool_slots(resolve(None, None, {"MOET_GPU_POOL": "400"}), 200) is None
    assert config.pool_slots(resolve(None, None, {}), 200) is None  # "all"
    for bad in ("0", "150%", "-3", "lots"):
        with pytest.raises(MoetConfigError, match=f"gpu_pool={bad!r} is not valid"):
            resolve(None, None, {"MOET_GPU_POOL": bad})
    auto = resolve(None, {"moet": {"gpu_pool": "auto", "pool_reserve_gib": 0.5}}, {})
    assert (auto.gpu_pool, auto.pool_reserve_gib, auto.host_arena) == ("auto", 0.5, "auto")
    with pytest.raises(ValueError, match="no size before the KV cache"):
        config.pool_slots(auto, 200)
    assert resolve(None, None, {"MOET_HOST_ARENA": "1.5"}).host_arena == "1.5"
    for name, bad in (("POOL_RESERVE_GIB", "-1"), ("POOL_RESERVE_GIB", "nan"),
                      ("POOL_RESERVE_GIB", "auto"), ("HOST_ARENA", "big")):  # fmt: skip
        with pytest.raises(MoetConfigError, match=f"MOET_{name}.*a size in GiB"):
            resolve(None, None, {f"MOET_{name}": bad})
    with pytest.raises(MoetConfigError, match="MOET_MAX_REPLAYS.*an integer >= 1"):
        resolve(None, None, {"MOET_MAX_REPLAYS": "0"})
    with pytest.raises(MoetConfigError, match="only miss_mode='approximate' allows"):
        resolve(None, None, {"MOET_MISS_TOLERANCE": "2"})
    ok = resolve(None, None, {"MOET_MISS_TOLERANCE": "2", "MOET_MISS_MODE": "approximate"})
    assert ok.miss_tolerance == 2
    with pytest.raises(MoetConfigError, match="pack_cache is off"):
        resolve(None, None, {"MOET_GPU_POOL": "10", "MOET_PACK_CACHE": "0"})
