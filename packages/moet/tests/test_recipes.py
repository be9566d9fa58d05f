"""The conda recipes read every moet version from the pyprojects (ci/check_recipes.py).

A bump edits one pyproject; a version written again in a recipe (its own or a pin of a sibling)
is refused, so no script has to reconcile copies.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CHECK = ("check_recipes.py", "check_versions.py")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of what the check reads: ci/'s two scripts, each package's pyproject, recipe, LICENSE."""
    (tmp_path / "ci").mkdir()
    for name in CHECK:
        shutil.copy(ROOT / "ci" / name, tmp_path / "ci" / name)
    for pyproject in (ROOT / "packages").glob("*/pyproject.toml"):
        folder = tmp_path / "packages" / pyproject.parent.name
        shutil.copytree(pyproject.parent / "recipe", folder / "recipe")
        shutil.copy(pyproject, folder / "pyproject.toml")
        shutil.copy(ROOT / "LICENSE", folder / "LICENSE")
    return tmp_path


def check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(root / "ci" / "check_recipes.py")], capture_output=True, text=True
    )


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path}: {old!r} not found"
    path.write_text(text.replace(old, new, 1))


def test_the_committed_recipes_pass(tree: Path) -> None:
    result = check(tree)
    assert result.returncode == 0, result.stderr
    assert "5 recipes agree" in result.stdout


def test_a_version_literal_is_refused(tree: Path) -> None:
    recipe = tree / "packages" / "moet-quant" / "recipe" / "recipe.yaml"
    edit(recipe, '${{ load_from_file("../pyproject.toml").project.version }}', '"0.1.0"')
    result = check(tree)
    assert result.returncode == 1
    assert "moet-quant/recipe/recipe.yaml: package.version must be read from" in result.stderr


def test_a_pin_literal_is_refused(tree: Path) -> None:
    recipe = tree / "packages" / "moet" / "recipe" / "recipe.yaml"
    pin = '~=${{ load_from_file("../../moet-vllm/pyproject.toml").project.version }}'
    edit(recipe, pin, "~=0.1.0")
    result = check(tree)
    assert result.returncode == 1
    assert "the pin 'moet-vllm ~=0.1.0' must read moet-vllm's version" in result.stderr


def test_a_bump_in_the_pyproject_reaches_the_recipe(tree: Path) -> None:
    """The recipe follows the pyproject; the meta-package's pin (a pyproject literal that
    check_versions reconciles) is what disagrees, and the check names it."""
    edit(
        tree / "packages" / "moet-store" / "pyproject.toml",
        'version = "0.1.0"',
        'version = "0.1.1"',
    )
    result = check(tree)
    assert result.returncode == 1
    assert (
        "moet-store is '~=0.1.1' but packages/moet/pyproject.toml says '~=0.1.0'" in result.stderr
    )
    assert "moet-store/recipe/recipe.yaml" not in result.stderr
