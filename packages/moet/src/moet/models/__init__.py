"""Models shipped with moet as package data.

``fixture()`` is the project's trained fixture, ``glm-moe-fixture``: a small GLM-4.5-family MoE
(``Glm4MoeForCausalLM``: 3 MoE layers x 64 experts, top-4, a shared expert, sigmoid routing; its
own 4096-id tokenizer with GLM-4.5's special tokens and chat template), trained on Python sources
and man pages. It is the main job's default model and the real checkpoint of the tests and
benchmarks: a Hub-layout directory (config.json, model.safetensors, tokenizer files and its model
card, README.md) that transformers loads and vLLM serves unchanged.

It lives here, in the installed meta-package, so that everything that uses it (tests, the main
job, the benchmarks) finds it through the installed distribution, editable or from a wheel,
rather than by walking up a source tree. Its training and evaluation pipeline stays in the
repository, under bench/fixture/ (which writes its output into this directory).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

FIXTURE_NAME = "glm-moe-fixture"
# every file of the model directory (the wheel ships exactly these: pyproject's package-data)
FIXTURE_FILES = (
    "README.md",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)

__all__ = ["FIXTURE_FILES", "FIXTURE_NAME", "fixture"]


def fixture() -> Path:
    """The directory of the trained fixture model, as installed (pass it where a model path goes:
    ``moet convert``, ``vllm serve``, ``from_pretrained``). Raises FileNotFoundError when the
    installation lacks it (a zipped install, or a build that left the package data out)."""
    where = files(__name__) / FIXTURE_NAME
    if not isinstance(where, Path):  # e.g. imported from a zip: vLLM needs a real directory
        raise FileNotFoundError(f"moet.models: {FIXTURE_NAME} is not a directory on disk ({where})")
    missing = [f for f in FIXTURE_FILES if not (where / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"moet.models: {where} lacks {', '.join(missing)}: moet was installed without its "
            "package data (reinstall it: pip install moet, or -e packages/moet in the repository)"
        )
    return where
