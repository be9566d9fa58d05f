"""The persistent quantization cache over real moet-store packs."""

import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from moet_kernels.layout import NativeRowLayout, RowLayout
from moet_vllm.config import resolve
from moet_vllm.packcache import ExpertPackCache


def rows(layout, n_experts, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n_experts, layout.row_bytes), dtype=np.uint8)


@pytest.fixture
def cfg(tmp_path):
    return resolve(None, None, {"MOET_CACHE_DIR": str(tmp_path / "cache")})


def test_round_trip_across_boots(cfg):
    lay = RowLayout(64, 32)
    first = ExpertPackCache(cfg, "ckpt-a", lay, n_layers=3, n_experts=4)
    assert first.enabled and first.cached_layers() == set()
    data = {layer: rows(lay, 4, layer) for layer in range(3)}
    for layer, layer_rows in data.items():
        assert first.read_rows(layer) is None
        first.write_rows(layer, layer_rows)
    first.close()
    again = ExpertPackCache(cfg, "ckpt-a", lay, n_layers=3, n_experts=4)  # the next boot
    assert again.cached_layers() == {0, 1, 2}
    for layer, layer_rows in data.items():
        assert np.array_equal(again.read_rows(layer), layer_rows)
    again.close()


@pytest.mark.parametrize("change", ["ckpt", "zero_mode", "tp_size", "geometry", "layout"])
def test_any_identity_change_misses(cfg, change):
    lay = RowLayout(64, 32)
    c = ExpertPackCache(cfg, "ckpt-a", lay, n_layers=1, n_experts=4)
    c.write_rows(0, rows(lay, 4, 0))
    c.close()
    kw = dict(cfg=cfg, ckpt_id="ckpt-a", layout=lay, n_layers=1, n_experts=4)
    if change == "ckpt":
        kw["ckpt_id"] = "ckpt-b"
    elif change == "zero_mode":
        kw["cfg"] = resolve(None, None, {"MOET_CACHE_DIR": cfg.cache_dir, "MOET_ZERO_MODE": "alt"})
    elif change == "tp_size":
        kw["tp_size"] = 2
    elif change == "geometry":
        kw["layout"] = RowLayout(64, 64)
    else:  # the kernels' native rows: packs of the logical layout are never misread as them
        kw["layout"] = NativeRowLayout(64, 32)
    assert ExpertPackCache(**kw).read_rows(0) is None


def test_disabled_and_unresolvable_identity(cfg, tmp_path):
    lay = RowLayout(64, 32)
    off = resolve(None, None, {"MOET_CACHE_DIR": str(tmp_path), "MOET_PACK_CACHE": "0"})
    c = ExpertPackCache(off, "x", lay, 1, 4)
    assert not c.enabled and "MOET_PACK_CACHE" in c.reason
    c.write_rows(0, rows(lay, 4, 0))
    assert not list(tmp_path.glob("*.pack"))
    c = ExpertPackCache(cfg, None, lay, 1, 4)
    assert not c.enabled and "identity" in c.reason


def test_unwritable_cache_dir_serves_without_the_cache_and_warns_once(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = resolve(None, None, {"MOET_CACHE_DIR": str(blocker / "cache")})
    lay = RowLayout(64, 32)
    c = ExpertPackCache(cfg, "ckpt-a", lay, 2, 4)
    with caplog.at_level(logging.WARNING):
        c.write_rows(0, rows(lay, 4, 0))
        c.write_rows(1, rows(lay, 4, 1))
    assert not c.enabled and c.read_rows(0) is None
    warnings = [r for r in caplog.records if "pack cache off" in r.getMessage()]
    assert len(warnings) == 1


def test_full_cache_dir_serves_without_the_cache_and_warns_once(tmp_path, caplog):
    """A 1 MiB tmpfs (CI runs as root) cannot hold a 4 MiB pack: the cache turns itself off."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        cfg = resolve(None, None, {"MOET_CACHE_DIR": str(mnt)})
        lay = RowLayout(1024, 256)  # ~130 KiB per expert row, 8 experts x 4 layers
        c = ExpertPackCache(cfg, "ckpt-a", lay, 4, 8)
        with caplog.at_level(logging.WARNING):
            for layer in range(4):
                c.write_rows(layer, rows(lay, 8, layer))
        assert not c.enabled and c.read_rows(0) is None
        warnings = [r.getMessage() for r in caplog.records if "pack cache off" in r.getMessage()]
        assert len(warnings) == 1 and "space" in warnings[0], warnings
        c.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_corrupt_pack_is_never_served(cfg):
    lay = RowLayout(64, 32)
    c = ExpertPackCache(cfg, "ckpt-a", lay, 1, 4)
    c.write_rows(0, rows(lay, 4, 0))
    c.close()
    pack = next(p for p in (c.directory).glob("*.pack"))
    data = bytearray(pack.read_bytes())
    data[100] ^= 0xFF
    pack.write_bytes(bytes(data))
    again = ExpertPackCache(cfg, "ckpt-a", lay, 1, 4)
    assert again.read_rows(0) is None  # checksum mismatch: re-quantize instead


def test_the_tiered_host_tiers_arena_follows_host_arena(cfg, monkeypatch):
    """host_arena GiB sizes the pinned arena of the `tiered` host tier; `auto` takes the whole
    pack, at most half of the host's available memory."""
    from moet_vllm.residency import sizing

    lay = RowLayout(64, 32)
    c = ExpertPackCache(cfg, "ckpt-a", lay, n_layers=3, n_experts=4)
    for layer in range(3):
        c.write_rows(layer, rows(lay, 4, layer))
    stride = c.spec.stride
    with c.open_store("tiered") as store:  # auto, with room for the whole pack
        assert store.arena_bytes == 12 * stride
    with c.open_store("tiered", str(5 * stride / sizing.GIB)) as store:
        assert store.arena_bytes == 5 * stride
    monkeypatch.setattr(sizing, "free_bytes", lambda device: 6 * stride + 100)  # little memory
    with c.open_store("tiered") as store:  # auto: half of what is available
        assert store.arena_bytes == 3 * stride
    c.close()


def test_load_session_counts_its_moe_layers_on_a_bar(tmp_path, capsys, monkeypatch):
    """Re-quantizing a large official checkpoint at boot takes minutes: the load session shows a
    bar over its MoE layers (TP rank 0, stderr a terminal), and none on other ranks."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from moet_quant import synth
    from moet_vllm.loading import MoetLoadSession

    src = synth.write_checkpoint(
        tmp_path / "src", "qwen3-moe", "bf16", n_layers=2, n_experts=4, hidden=64, inter=64
    )
    cfg = resolve(None, None, {"MOET_CACHE_DIR": str(tmp_path / "cache")})
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    for tp_rank in (1, 0):
        with set_current_vllm_config(VllmConfig()):  # a session is built inside an engine
            session = MoetLoadSession(cfg, str(src), tp_rank, 2, False, torch.device("cpu"))
        for layer in session.moe_layers:
            session.rows(layer)
        err = capsys.readouterr().err
        shown = "moet: experts of 2 MoE layers (re-quantized at load)" in err
        assert shown == (tp_rank == 0), err
    assert "2/2" in err and "layer/s" in err, err
