"""`convert`: the moet checkpoint layout, byte-exact dense tensors, resume, refusals, disk full."""

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moet_quant import checkpoint, convert, fp4, w2
from moet_quant.errors import MoetError
from moet_quant.safetensors_io import ShardedSafetensors


def _all(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize(
    "family, fmt, tier",
    [
        ("qwen3-moe", "bf16", "none"),
        ("glm", "fp8-block", "fp4r"),
        ("qwen3-moe", "nvfp4", "fp4x"),
        ("gpt-oss", "mxfp4", "fp4x"),
        ("mixtral", "int4-pack", "none"),
    ],
)
def test_convert_layout_and_values(make_ckpt, tmp_path, family, fmt, tier):
    src = make_ckpt(family, fmt, n_layers=2, zero_fraction=0.02)
    out = tmp_path / "out"
    res = convert.convert(src, out, convert.ConvertOptions(fp4_tier=tier), progress=False)
    assert len(res.written_shards) == 2
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "moet" and qc["format"] == "w2-ue8m0b32-v1"
    assert (qc["zero_mode"], qc["mode"], qc["block_size"], qc["fp4_tier"]) == (
        "auto",
        "reference",
        32,
        tier,
    )
    assert any("embed_tokens" in m for m in qc["modules_not_converted"])
    got = _all(out)  # the reference library reads every shard
    ck = checkpoint.open_checkpoint(src)
    consumed = {t for s in ck.sources for t in s.tensors}
    for name in ck.st.names():
        if name not in consumed:  # dense tensors: byte for byte
            assert (
                got[name].contiguous().view(torch.uint8).numpy().tobytes()
                == ck.st.array(name).tobytes()
            )
    assert not any(n in got for n in consumed)
    for s in ck.sources:
        if ".experts.gate_up_proj" not in s.tensors[0] and ".experts.down_proj" not in s.tensors[0]:
            # per-expert sources keep their names (Mixtral's w1/w3/w2: vLLM 0.24 loads only those)
            assert s.tensors[0].startswith(s.name + "."), (s.name, s.tensors)
        n, k = s.shape
        codes, scales = got[f"{s.name}.w2_codes"].numpy(), got[f"{s.name}.w2_scales"].numpy()
        assert codes.shape == (n, k // 4) and scales.shape == (n, k // 32)
        if fmt == "mxfp4":  # direct nibble map, scales verbatim
            x = s.fp4x()
            assert (scales == x["scales"]).all()
        else:
            ref = w2.quantize_f64(s.dequant())
            assert (codes == ref.codes).all() and (scales == ref.scales).all()
        if tier == "fp4r":
            nib = fp4.nibbles_from_refinement(codes, got[f"{s.name}.fp4_refine"].numpy())
            assert (nib == fp4.fp4r(s.dequant())[1]).all()
        if tier == "fp4x":
            x = s.fp4x()
            assert (got[f"{s.name}.fp4_codes"].numpy() == x["codes"]).all()
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(got)
    ShardedSafetensors(out)  # our reader validates the index against the shards
    assert (out / "README.md").read_text().startswith("# ")
    assert (out / "tokenizer_config.json").exists()


def test_dry_run_writes_nothing(make_ckpt, tmp_path):
    res = convert.convert(make_ckpt(), tmp_path / "out", dry_run=True)
    assert res.dry_run and res.plan.tier_bytes["w2"] > 0 and not (tmp_path / "out").exists()


def test_interrupted_conversion_resumes_and_verifies_kept_shards(make_ckpt, tmp_path, monkeypatch):
    src = make_ckpt(shards=3)
    out = tmp_path / "out"
    real = convert.write_safetensors
    calls = []

    def dying(path, *a, **kw):
        calls.append(path.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while writing the second shard
        return real(path, *a, **kw)

    monkeypatch.setattr(convert, "write_safetensors", dying)
    with pytest.raises(KeyboardInterrupt):
        convert.convert(src, out, progress=False)
    assert not (out / "config.json").exists()  # nothing looks complete
    with pytest.raises(MoetError, match="interrupted moet conversion"):
        convert.verify_complete(out)
    monkeypatch.setattr(convert, "write_safetensors", real)
    res = convert.convert(src, out, progress=False)
    assert res.kept_shards == [calls[0]] and len(res.written_shards) == 2
    convert.verify_complete(out)
    full = tmp_path / "full"
    convert.convert(src, full, progress=False)
    for f in full.glob("*.safetensors"):
        assert (out / f.name).read_bytes() == f.read_bytes()
    # a kept shard that no longer matches its checksum is rewritten, not trusted
    victim = out / calls[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    res = convert.convert(src, out, progress=False)
    assert calls[0] in res.written_shards
    assert victim.read_bytes() == (full / calls[0]).read_bytes()


def test_refuses_foreign_or_nonempty_output(make_ckpt, tmp_path):
    src = make_ckpt()
    out = tmp_path / "out"
    convert.convert(src, out, progress=False)
    with pytest.raises(MoetError, match="another checkpoint or with other options"):
        convert.convert(src, out, convert.ConvertOptions(zero_mode="sign"), progress=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(MoetError, match="not empty"):
        convert.convert(src, other, progress=False)
    assert (other / "notes.txt").read_text() == "mine"


def test_disk_full_is_a_clear_error_and_keeps_earlier_shards(make_ckpt, tmp_path, monkeypatch):
    src = make_ckpt(shards=2)
    out = tmp_path / "out"
    real = convert.write_safetensors
    n = []

    def full(path, *a, **kw):
        n.append(path)
        if len(n) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *a, **kw)

    monkeypatch.setattr(convert, "write_safetensors", full)
    with pytest.raises(MoetError, match="disk full.*resume"):
        convert.convert(src, out, progress=False)
    assert n[0].exists() and not (out / "config.json").exists()
    man = json.loads((out / ".moet-convert.json").read_text())
    assert list(man["shards"]) == [n[0].name] and man["complete"] is False


def test_preflight_refuses_when_space_is_short(make_ckpt, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 1000))
    with pytest.raises(MoetError, match=r"needs 0\.\d+ GB free.*found 0\.00 GB"):
        convert.convert(make_ckpt(), tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "config.json").exists()


def test_cli_convert_inspect_and_clean_errors(make_ckpt, tmp_path):
    src = make_ckpt("glm", "fp8-block")

    def run(*a):
        return subprocess.run(
            [sys.executable, "-m", "moet_quant.cli", *map(str, a)],  # noqa: E731
            capture_output=True,
            text=True,
        )

    r = run("inspect", src)
    assert r.returncode == 0 and "fp8-block" in r.stdout and "ckpt_id" in r.stdout
    r = run("inspect", src, "--json")
    assert json.loads(r.stdout)["n_experts"] == 4
    r = run("convert", src, tmp_path / "o", "--dry-run")
    assert r.returncode == 0 and "dry run" in r.stdout and not (tmp_path / "o").exists()
    r = run("convert", src, tmp_path / "o", "--no-progress")
    assert r.returncode == 0 and (tmp_path / "o" / "config.json").exists()
    for args in (
        ("inspect", tmp_path / "missing"),
        ("convert", src, tmp_path / "o", "--zero-mode", "sign"),
    ):
        r = run(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("moet-quant: error: ")
    # truncated shard: one line naming the file and the tensor
    shard = sorted(src.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-64])
    r = run("inspect", src)
    assert r.returncode == 2 and shard.name in r.stderr and "truncated" in r.stderr
    assert "Traceback" not in r.stderr


def test_kill_9_at_random_points_never_leaves_a_complete_looking_checkpoint(make_ckpt, tmp_path):
    """A real SIGKILL mid-conversion: the output never looks complete until it is, and rerunning
    the same command finishes it with the same bytes as an uninterrupted conversion."""
    import os
    import random
    import signal
    import time

    src = make_ckpt("qwen3-moe", "bf16", shards=6, n_layers=6, hidden=256, inter=128, n_experts=8)
    full = tmp_path / "full"
    convert.convert(src, full, progress=False)
    cmd = [sys.executable, "-m", "moet_quant.cli", "convert", str(src), "OUT", "--no-progress"]

    def start(out: Path) -> subprocess.Popen:
        """The command on `out`, returned once its manifest exists (the conversion has begun)."""
        p = subprocess.Popen([a if a != "OUT" else str(out) for a in cmd],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + 30
        while not (out / ".moet-convert.json").exists() and time.monotonic() < deadline:
            time.sleep(0.002)
        return p

    timed = start(tmp_path / "timed")  # how long a conversion runs here, so kills land inside it
    t0 = time.monotonic()
    assert timed.wait() == 0
    span = time.monotonic() - t0
    rng = random.Random(1)
    killed_midway = 0
    for trial in range(6):
        out = tmp_path / f"out{trial}"
        p = start(out)
        time.sleep(rng.uniform(0.05, 0.6) * span)
        p.send_signal(signal.SIGKILL)
        p.wait()
        if not (out / "config.json").exists():
            killed_midway += 1
            with pytest.raises(MoetError, match="interrupted"):
                convert.verify_complete(out)
        r = subprocess.run(
            [a if a != "OUT" else str(out) for a in cmd], capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr
        convert.verify_complete(out)
        for f in full.iterdir():
            if f.suffix == ".safetensors" or f.name == "config.json":
                assert (out / f.name).read_bytes() == f.read_bytes(), f.name
        assert not list(out.glob("*.partial"))
        assert os.path.exists(out / "model.safetensors.index.json")
    assert killed_midway >= 2  # the kills really landed mid-conversion


def test_small_real_filesystem_is_refused_before_writing(make_ckpt, tmp_path):
    """A 1 MiB tmpfs (root only: CI runs as root) cannot hold the output: the preflight says so."""
    import os

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {r.stderr.strip()}")
    try:
        src = make_ckpt(hidden=256, inter=128, n_experts=8, n_layers=4)
        with pytest.raises(MoetError, match=r"needs \d+\.\d+ GB free.*found 0\.00 GB"):
            convert.convert(src, mnt / "out", progress=False)
        assert not (mnt / "out" / "config.json").exists()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
