"""The meta-package pins exactly the current version of every component.

Fails when a component's version is bumped without the meta-package (or the other way round).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

PACKAGES = Path(__file__).resolve().parents[2]  # packages/
META = PACKAGES / "moet" / "pyproject.toml"


def project(pyproject: Path) -> dict:
    return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]


def components() -> dict[str, str]:
    """Distribution name -> version of every package under packages/ except the meta-package."""
    out = {}
    for pyproject in sorted(PACKAGES.glob("*/pyproject.toml")):
        if pyproject == META:
            continue
        proj = project(pyproject)
        out[canonicalize_name(proj["name"])] = proj["version"]
    return out


def meta_pins() -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in project(META)["dependencies"]]
    return {canonicalize_name(r.name): r for r in reqs}


def test_meta_pins_every_component() -> None:
    folders = {p.name for p in PACKAGES.iterdir() if p.is_dir() and p.name != "moet"}
    assert set(meta_pins()) == set(components()) == folders


@pytest.mark.parametrize("name", sorted(components()))
def test_pin_admits_exactly_the_component_version(name: str) -> None:
    version = Version(components()[name])
    spec = meta_pins()[name].specifier
    assert spec.contains(version, prereleases=True), f"{name}{spec} rejects {version}"
    specs = list(spec)
    assert len(specs) == 1, f"{name}: one specifier expected, got {spec}"
    (only,) = specs
    if version.is_prerelease:
        # == for pre-releases: nothing else is admitted.
        assert (only.operator, Version(only.version)) == ("==", version)
    else:
        # ~=X.Y.Z: this version and its patch releases, not the next minor or an older patch.
        assert only.operator == "~=" and Version(only.version) == version, f"{name}{spec}"
        major, minor, patch = (version.release + (0, 0))[:3]
        assert len(version.release) == 3, f"{name}: release versions are X.Y.Z, got {version}"
        assert not spec.contains(f"{major}.{minor + 1}.0")
        if patch:
            assert not spec.contains(f"{major}.{minor}.{patch - 1}")


def test_meta_ships_one_module_moet() -> None:
    """The meta-package's own code is `moet` alone (moet.models: the fixture model, package data);
    it never ships a component's module."""
    data = tomllib.loads(META.read_text(encoding="utf-8"))
    assert data["tool"]["setuptools"]["packages"]["find"]["where"] == ["src"]
    src = META.parent / "src"
    tops = sorted(p.name for p in src.iterdir() if p.is_dir() and not p.name.endswith(".egg-info"))
    assert tops == ["moet"]


@pytest.mark.parametrize("name", sorted(components()))
def test_each_module_reports_its_pyprojects_version(name: str) -> None:
    """`__version__` is read from the installed metadata: an install older than the source tree
    (an editable install not redone after a bump) fails here."""
    import importlib

    module = importlib.import_module(name.replace("-", "_"))
    assert module.__version__ == components()[name]
