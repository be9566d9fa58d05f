"""moet.models: the trained fixture model is package data of the meta-package, found through the
installed package (editable here, site-packages from a wheel), and the wheel ships all of it."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import shutil
import struct
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import moet
import moet.models

PACKAGE = Path(__file__).resolve().parents[1]  # packages/moet


def test_version_is_the_installed_distributions():
    assert moet.__version__ == importlib.metadata.version("moet")


def test_fixture_is_the_model_directory_with_every_file():
    path = moet.models.fixture()
    assert isinstance(path, Path) and path.is_dir() and path.name == moet.models.FIXTURE_NAME
    # FIXTURE_FILES is the directory, no more, no less (what the wheel must ship)
    assert sorted(p.name for p in path.iterdir()) == sorted(moet.models.FIXTURE_FILES)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "glm4_moe" and cfg["n_routed_experts"] == 64
    with open(path / "model.safetensors", "rb") as f:  # a real safetensors file, not a pointer
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in header)
    card = (path / "README.md").read_text()
    assert card.startswith("---\n") and "# glm-moe-fixture" in card


def test_a_missing_file_is_one_error_naming_it(monkeypatch):
    monkeypatch.setattr(moet.models, "FIXTURE_FILES", (*moet.models.FIXTURE_FILES, "absent.bin"))
    with pytest.raises(FileNotFoundError, match=r"lacks absent\.bin.*package data"):
        moet.models.fixture()


def test_package_data_globs_cover_every_file():
    data = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = data["package-data"]["moet.models"]
    for name in moet.models.FIXTURE_FILES:
        rel = f"{moet.models.FIXTURE_NAME}/{name}"
        assert any(fnmatch.fnmatch(rel, g) for g in globs), rel


def test_the_wheel_ships_the_model(tmp_path):
    """Build the meta-package's wheel from a copy of its folder (the tree stays clean) and find
    every file of the model in it, byte for byte."""
    pytest.importorskip("build")
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    out = tmp_path / "dist"
    cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out)]
    subprocess.run([*cmd, str(src)], check=True, capture_output=True)
    (whl,) = out.glob("moet-*-py3-none-any.whl")
    fixture = moet.models.fixture()
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        assert {"moet/__init__.py", "moet/models/__init__.py"} <= names
        for name in moet.models.FIXTURE_FILES:
            member = f"moet/models/{moet.models.FIXTURE_NAME}/{name}"
            assert member in names, member
            assert z.read(member) == (fixture / name).read_bytes(), member
