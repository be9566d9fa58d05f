"""Every development and CI task of the moet monorepo is a nox session (`nox -l` lists them).

Test, lint and check sessions run in the environment nox itself runs in (the shared `.venv` that
`ci/setup.sh` builds), so CI installs everything once. `wheels` and `install` build and check the
distributable artifacts in isolation.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.sessions = ["lint", "versions", "recipes", "report", "sass", "tests"]
nox.options.error_on_missing_interpreters = True

# short name -> distribution folder under packages/
PACKAGES = {
    "quant": "moet-quant",
    "store": "moet-store",
    "kernels": "moet-kernels",
    "vllm": "moet-vllm",
    "meta": "moet",
}
NATIVE = {"moet-store"}  # packages with compiled extensions (auditwheel-repaired)
# moet-vllm's tests are mostly vLLM engine boots, each of which keeps about one core busy: two
# pytest workers (pytest-xdist), a test file per worker so that a file's module fixtures are made
# once (-n 0 in the session's arguments runs them in one process)
# a file per worker at a time, in the files' collected order (moet-vllm's conftest.py: slowest first)
PARALLEL = {"vllm": ["-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]}


def _pkg_dir(short: str) -> Path:
    return ROOT / "packages" / PACKAGES[short]


@nox.session(python=False)
@nox.parametrize("pkg", list(PACKAGES), ids=list(PACKAGES))
def tests(session: nox.Session, pkg: str) -> None:
    """Run one package's test suite (pytest; for store also the C++ unit suite) in the shared venv."""
    if pkg == "store":
        build = ROOT / "build" / "store-cxx-tests"
        session.run(
            "cmake",
            "-S",
            str(_pkg_dir(pkg)),
            "-B",
            str(build),
            "-G",
            "Ninja",
            "-DMOET_STORE_BUILD_TESTS=ON",
            "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
            "-DPython_EXECUTABLE=" + sys.executable,
            external=True,
        )
        session.run("cmake", "--build", str(build), external=True)
        session.run("ctest", "--test-dir", str(build), "--output-on-failure", external=True)
    # the gpu marker is deselected, not skipped (ci/gpu.sh runs it); `-- -n 0 -m gpu` selects it
    # again (in one process: the GPU tests share one device);
    # ci/pytest_skips.py: with STRICT_SKIPS=1 (ci/test.sh) an unexpected skip fails the run
    path = os.pathsep.join(p for p in (str(ROOT / "ci"), os.environ.get("PYTHONPATH")) if p)
    # the slowest tests are printed: CI's time is bounded (~30 min), tests(vllm) takes most of it
    session.run(
        "python", "-m", "pytest", "-q", "-p", "pytest_skips", "-m", "not gpu", "--durations=15",
        *PARALLEL.get(pkg, []), str(_pkg_dir(pkg) / "tests"), *session.posargs,
        env={"PYTHONPATH": path},
    )  # fmt: skip


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    """ruff on all Python; clang-format (dry run) on all C++ sources."""
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    cxx = [
        p
        for p in glob.glob("packages/*/src/**/*.[ch]pp", recursive=True)
        + glob.glob("packages/*/tests/**/*.[ch]pp", recursive=True)
        + glob.glob("packages/*/src/**/*.cu", recursive=True)
        + glob.glob("packages/*/csrc/**/*.cu", recursive=True)
        + glob.glob("packages/*/tests/**/*.cu", recursive=True)
    ]
    if cxx:
        session.run("clang-format", "--dry-run", "--Werror", *cxx, external=True)


@nox.session(python=False)
def versions(session: nox.Session) -> None:
    """Check that every inter-package pin and the meta-package's pins match the packages' versions."""
    session.run("python", "ci/check_versions.py")


@nox.session(python=False)
def recipes(session: nox.Session) -> None:
    """Check that each conda recipe (recipe/recipe.yaml) agrees with its pyproject.toml."""
    session.run("python", "ci/check_recipes.py")


@nox.session(python=False)
def sass(session: nox.Session) -> None:
    """Rebuild moet-kernels' cubins from source in a scratch build dir and audit their SASS
    against sass/ (packages/moet-kernels/tools/sass_audit.py, docs/kernels.md): fails on drift
    from the committed listings and manifests, spills or stack, emulated FP8 MMA on sm_90a and
    ptxas "wgmma ... serialized" notes. `nox -s sass -- --update` rewrites sass/. Needs nvcc."""
    build = ROOT / "build" / "kernels-sass"
    shutil.rmtree(build, ignore_errors=True)
    kernels = _pkg_dir("kernels")
    session.run("cmake", "-S", str(kernels), "-B", str(build), "-G", "Ninja", external=True)
    session.run("cmake", "--build", str(build), external=True)
    session.run(
        "python",
        str(kernels / "tools" / "sass_audit.py"),
        "--cubins",
        str(build / "cubins"),
        "--sass-dir",
        str(ROOT / "sass"),
        *session.posargs,
    )


def _expected_cubins() -> list[str]:
    """The cubins a wheel must ship: one per committed SASS listing (sass/<name>.<arch>.sass)."""
    return sorted(p.name.removesuffix(".sass") + ".cubin" for p in (ROOT / "sass").glob("*.sass"))


@nox.session(python=False)
def wheels(session: nox.Session) -> None:
    """Build every wheel into dist/; native wheels are repaired to a manylinux tag by auditwheel."""
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    raw = ROOT / "build" / "raw-wheels"
    shutil.rmtree(raw, ignore_errors=True)
    for name in PACKAGES.values():
        out = raw if name in NATIVE else dist
        session.run(
            "python",
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--outdir",
            str(out),
            str(ROOT / "packages" / name),
        )
    for whl in glob.glob(str(raw / "*.whl")):
        session.run("auditwheel", "repair", "--wheel-dir", str(dist), whl, external=True)
    bad = [w for w in glob.glob(str(dist / "*.whl")) if "linux_x86_64" in w]
    if bad:
        session.error(f"unrepaired native wheels in dist/: {bad}")
    # cubins are package data, not Python-ABI specific: moet-kernels is py3-none-any
    if not glob.glob(str(dist / "moet_kernels-*-py3-none-any.whl")):
        session.error("dist/ holds no py3-none-any moet-kernels wheel")


@nox.session(python=False)
def install(session: nox.Session) -> None:
    """Install every wheel from dist/ into a fresh venv and import every package there."""
    wheels_ = sorted(glob.glob(str(ROOT / "dist" / "*.whl")))
    if not wheels_:
        session.error("dist/ holds no wheels: run `nox -s wheels` first")
    with tempfile.TemporaryDirectory(prefix="moet-install-") as tmp:
        venv = Path(tmp) / "venv"
        session.run(sys.executable, "-m", "venv", str(venv), external=True)
        py = str(venv / "bin" / "python")
        # torch is pinned to the local CPU build so pip never reaches for a CUDA wheel.
        session.run(py, "-m", "pip", "install", "-q", "torch==2.13.0", *wheels_, external=True)
        code = (
            "import moet_quant, moet_store, moet_kernels, moet_vllm; "
            "print('imported', moet_quant.__version__, moet_store.__version__, "
            "moet_kernels.__version__, moet_vllm.__version__)"
        )
        session.run(py, "-c", code, external=True, env={"PYTHONNOUSERSITE": "1"})
        # the meta-package's wheel ships the trained fixture model (moet.models, package data)
        code = (
            "import moet, moet.models as m; p = m.fixture(); "
            "assert 'site-packages' in str(p), p; "
            "print('fixture', moet.__version__, p, *sorted(f.name for f in p.iterdir()))"
        )
        session.run(py, "-c", code, external=True, env={"PYTHONNOUSERSITE": "1"})
        # the kernels wheel ships one cubin per committed SASS listing (nvcc at wheel build)
        expected = _expected_cubins()
        if not expected:
            session.error("sass/ holds no listings: no cubins to expect (run `nox -s sass`)")
        code = (
            "from moet_kernels.loader import shipped_cubins; s = shipped_cubins(); "
            f"want = {expected!r}; "
            "assert s == want, f'the moet-kernels wheel ships {s}, not {want}'; "
            "print('cubins', *s)"
        )
        session.run(py, "-c", code, external=True, env={"PYTHONNOUSERSITE": "1"})
        session.run(str(venv / "bin" / "moet"), "--help", external=True, silent=True)
        session.run(str(venv / "bin" / "moet-quant"), "--help", external=True, silent=True)


@nox.session(python=False)
def ci(session: nox.Session) -> None:
    """Everything CI runs, in order: lint, versions, recipes, the benchmark tables' check, sass,
    every test suite, wheels, install."""
    for name in ["lint", "versions", "recipes"]:
        session.notify(name)
    session.notify("report", ["--check"])
    session.notify("sass")
    for short in PACKAGES:
        session.notify(f"tests({short})")
    session.notify("wheels")
    session.notify("install")


@nox.session(python=False)
def bench(session: nox.Session) -> None:
    """Benchmarks, not timed tests: `nox -s bench -- RECIPE [RECIPE ...]` runs recipes of
    bench/recipes/ (`-- --list` lists them) through bench/run.py, each with its baselines in the
    same run, one result file per run under bench/results/<recipe>/ (docs/development.md,
    "Benchmarks"). On the GPU machine, without nox: `python3 bench/run.py RECIPE`."""
    session.run("python", "bench/run.py", *(session.posargs or ["--list"]))


@nox.session(python=False)
def report(session: nox.Session) -> None:
    """Render every benchmark table in README.md, docs/ and packages/*/README.md from the
    committed runs (bench/report.py); `-- --check` (in `ci`) fails when one differs from what
    they render."""
    session.run("python", "bench/report.py", *session.posargs)


os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")


@nox.session(python=False)
def fixture(session: nox.Session) -> None:
    """The trained fixture model's pipeline (bench/fixture/, ~20 min on 2 cores): rebuild the corpus
    and the tokenizer from this machine's files, re-evaluate the committed model (perplexities,
    unigram baselines, test-split routing trace and coverage), check that vLLM CPU serves it like
    transformers, rewrite its model card. The model itself is the meta-package's package data
    (moet.models.fixture(): packages/moet/src/moet/models/glm-moe-fixture/), where the tokenizer
    and the card are written. Training runs on the H200: bench/fixture/h200_train.py.
    """
    for script in ("corpus", "tokenizer", "evaluate", "check_vllm", "card"):
        session.run("python", f"bench/fixture/{script}.py")


@nox.session(python=False)
def quality(session: nox.Session) -> None:
    """The quality harness on the fixture (moet_quant.quality): bf16 vs the W2 variants on the
    test split -> bench/fixture/results/quality.json and docs/quality.md. Needs the tokenized
    splits of `nox -s fixture` (bench/out/fixture/corpus/)."""
    session.run("python", "bench/fixture/quality.py", *session.posargs)
