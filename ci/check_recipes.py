#!/usr/bin/env python3
"""Check each package's conda recipe against its pyproject.toml (`nox -s recipes`).

Every ``packages/<dir>/`` must have ``recipe/recipe.yaml`` in rattler-build's v1 format. For each:

* ``package.name`` equals the pyproject's name (``${{ var }}`` resolved from ``context``);
* every moet version in the recipe, the package's own and each pin of another moet package, is
  read from that package's pyproject (``${{ load_from_file("../pyproject.toml").project.version }}``,
  rattler-build ``--experimental``; the path is relative to the recipe's folder), never a literal:
  a pyproject is the one place a version is written;
* ``source.path`` points at the package folder;
* ``requirements.run`` equals the pyproject ``dependencies``, with conda names (``torch`` is
  ``pytorch``; others keep their names) and specifiers compared after normalization
  (``numpy >=1.26`` == ``numpy>=1.26``); a ``python`` entry must match ``requires-python``;
* no optional-dependency extra (``[gpu]``, ``[test]``, ...) is a run requirement, unless it is
  also a base dependency (``run_constraints`` may name them);
* the ``tests`` import the package's import name (the meta-package: its own and every
  component's);
* pure-Python packages are ``noarch: python`` and native ones are not (a scikit-build-core
  package with ``wheel.platlib = false`` builds a py3-none-any wheel: not native); every
  console script of the pyproject is in ``build.python.entry_points``;
* ``about.license`` equals the pyproject's license.

Prints one line per problem (naming the file) and exits 1, or a summary table and exits 0.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

try:
    import yaml
except ImportError:  # pragma: no cover - depends on the environment
    sys.exit("check_recipes: PyYAML is required (pip install pyyaml)")
try:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.utils import canonicalize_name
except ImportError:  # pragma: no cover - depends on the environment
    sys.exit("check_recipes: the 'packaging' distribution is required (pip install packaging)")

from check_versions import _valid, table  # noqa: E402  (ci/ is on sys.path when run as a script)

ROOT = Path(__file__).resolve().parent.parent
META = "moet"
# PyPI name -> conda-forge name, where they differ.
CONDA_NAMES = {"torch": "pytorch"}
NATIVE_BACKENDS = {"scikit_build_core.build"}
EXPR = re.compile(r"\$\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
# rattler-build's load_from_file(PATH).KEY.KEY: a value read from a TOML file beside the recipe.
FILE_EXPR = re.compile(
    r"\$\{\{\s*load_from_file\(\s*[\"']([^\"']+)[\"']\s*\)((?:\.[A-Za-z_][\w-]*)+)\s*\}\}"
)
ANY_EXPR = re.compile(r"\$\{\{.*?\}\}")
CONDA_SPEC = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*?)\s*$")


class RecipeError(Exception):
    pass


def resolve(value: object, context: dict[str, str], where: str, base: Path) -> str:
    """Substitutes `${{ var }}` from the recipe context and `${{ load_from_file("f.toml").a.b }}`
    from a TOML file relative to `base` (the recipe's folder); any other expression is an error."""
    text = str(value)
    for _ in range(5):  # context entries may refer to each other
        new = FILE_EXPR.sub(lambda m: _read_toml(m.group(1), m.group(2), base, where), text)
        new = EXPR.sub(lambda m: _lookup(m.group(1), context, where), new)
        if new == text:
            break
        text = new
    if ANY_EXPR.search(text):
        raise RecipeError(
            f"{where}: cannot resolve {text!r} (only `${{{{ var }}}}` from context and "
            '`${{ load_from_file("x.toml").key }}`)'
        )
    return text


def _read_toml(path: str, keys: str, base: Path, where: str) -> str:
    file = base / path
    try:
        here = tomllib.loads(file.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RecipeError(f"{where}: load_from_file({path!r}): {exc}") from None
    for key in keys.strip(".").split("."):
        if not isinstance(here, dict) or key not in here:
            raise RecipeError(f"{where}: load_from_file({path!r}){keys}: no {key!r} in {file.name}")
        here = here[key]
    return str(here)


def reads_version_of(raw: object, package: Path, base: Path) -> bool:
    """Whether a recipe value takes its version from `package`'s pyproject (load_from_file), so
    that no version literal needs reconciling."""
    return any(
        (base / m.group(1)).resolve() == (package / "pyproject.toml").resolve()
        and m.group(2) == ".project.version"
        for m in FILE_EXPR.finditer(str(raw))
    )


def _lookup(var: str, context: dict[str, str], where: str) -> str:
    if var not in context:
        raise RecipeError(f"{where}: `${{{{ {var} }}}}` is not defined in `context:`")
    return str(context[var])


def conda_name(pypi_name: str) -> str:
    name = canonicalize_name(pypi_name)
    return CONDA_NAMES.get(name, name)


def normalize_spec(spec: str, where: str) -> str:
    """A specifier set in canonical, order-independent form ('' means any version)."""
    spec = spec.replace(" ", "")
    parts = []
    for part in filter(None, spec.split(",")):
        if re.fullmatch(r"[0-9][0-9A-Za-z.*+!_-]*", part):  # conda: bare version
            part = f"=={part}"
        elif re.fullmatch(r"=[0-9][0-9A-Za-z.*+!_-]*", part):  # conda: =1.2 means 1.2.*
            part = f"={part}" if part.endswith("*") else f"={part}.*"
        parts.append(part)
    try:
        return ",".join(sorted(str(s) for s in SpecifierSet(",".join(parts))))
    except InvalidSpecifier as exc:
        raise RecipeError(f"{where}: {spec!r} is not a version specifier: {exc}") from None


def parse_conda(entry: str, where: str) -> tuple[str, str]:
    if "|" in entry or "[" in entry:
        raise RecipeError(f"{where}: {entry!r}: OR-specs and build selectors are not supported")
    m = CONDA_SPEC.match(entry)
    if not m:
        raise RecipeError(f"{where}: {entry!r} is not a conda match spec")
    name, spec = m.groups()
    if " " in spec.strip():  # "name version build" triples
        raise RecipeError(f"{where}: {entry!r}: build strings are not supported here")
    return canonicalize_name(name), normalize_spec(spec, where)


def string_list(value: object, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise RecipeError(f"{where}: expected a list")
    for item in value:
        if not isinstance(item, str):
            raise RecipeError(
                f"{where}: {item!r}: only plain strings are supported (no if/then selectors)"
            )
    return value


def builds_native(pyproject: dict) -> bool:
    """Whether a package's wheel holds native code: a scikit-build-core build, unless it targets
    the purelib (`wheel.platlib = false`: py3-none-any, e.g. moet-kernels' cubins as data)."""
    backend = pyproject.get("build-system", {}).get("build-backend", "")
    if backend not in NATIVE_BACKENDS:
        return False
    wheel = pyproject.get("tool", {}).get("scikit-build", {}).get("wheel", {})
    return wheel.get("platlib", True) is not False


def check(folder: Path, root: Path) -> tuple[list[str], list[str]]:
    """Returns (errors, table row) for one package folder."""
    pyproject = folder / "pyproject.toml"
    recipe = folder / "recipe" / "recipe.yaml"
    rel_py = str(pyproject.relative_to(root))
    rel = str(recipe.relative_to(root))
    if not pyproject.is_file():
        return [f"{rel_py}: missing"], [folder.name, "-", "-", "-"]
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    project = data.get("project", {})
    name = canonicalize_name(project.get("name", ""))
    version = project.get("version", "")
    if not recipe.is_file():
        return [f"{rel}: missing (every package needs a conda recipe)"], [name, version, "-", "-"]
    try:
        doc = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        return [f"{rel}: not valid YAML: {exc}"], [name, version, "-", "-"]
    if not isinstance(doc, dict):
        return [f"{rel}: expected a mapping at the top level"], [name, version, "-", "-"]

    errors: list[str] = []

    def guard(fn, *args):
        try:
            return fn(*args)
        except RecipeError as exc:
            errors.append(str(exc))
            return None

    context = {str(k): str(v) for k, v in (doc.get("context") or {}).items()}
    package = doc.get("package") or {}

    base = recipe.parent
    # name and version
    r_name = guard(resolve, package.get("name", ""), context, f"{rel}: package.name", base)
    r_version = guard(resolve, package.get("version", ""), context, f"{rel}: package.version", base)
    if r_name is not None and canonicalize_name(r_name) != name:
        errors.append(f"{rel}: package.name is {r_name!r} but {rel_py} says {name!r}")
    raw_version = EXPR.sub(
        lambda m: context.get(m.group(1), m.group(0)), str(package.get("version"))
    )
    if not reads_version_of(raw_version, folder, base):
        errors.append(
            f"{rel}: package.version must be read from {rel_py}, not written again: "
            '`${{ load_from_file("../pyproject.toml").project.version }}`'
        )
    elif r_version is not None and r_version != version:
        errors.append(f"{rel}: package.version is {r_version!r} but {rel_py} says {version!r}")

    # source
    source = doc.get("source") or {}
    src_path = source.get("path") if isinstance(source, dict) else None
    if not src_path:
        errors.append(f"{rel}: source.path must point at the package folder ('..')")
    elif (recipe.parent / src_path).resolve() != folder.resolve():
        errors.append(f"{rel}: source.path {src_path!r} is not the package folder {folder.name}/")

    # build kind and entry points
    build = doc.get("build") or {}
    backend = data.get("build-system", {}).get("build-backend", "")
    native = builds_native(data)
    noarch = build.get("noarch")
    if native and noarch:
        errors.append(f"{rel}: {name} builds native code ({backend}); it cannot be noarch")
    if not native and noarch != "python":
        errors.append(f"{rel}: {name} is pure Python: set build.noarch: python")
    entry_points = string_list(
        (build.get("python") or {}).get("entry_points"), f"{rel}: build.python.entry_points"
    )
    have_eps = {re.sub(r"\s+", "", e) for e in entry_points}
    for script, target in project.get("scripts", {}).items():
        if f"{script}={target}" not in have_eps:
            errors.append(
                f"{rel}: console script missing from build.python.entry_points: "
                f"'{script} = {target}' ({rel_py} [project.scripts])"
            )

    # run requirements vs dependencies
    reqs = doc.get("requirements") or {}
    where_run = f"{rel}: requirements.run"
    run: dict[str, str] = {}
    for entry in guard(string_list, reqs.get("run"), where_run) or []:
        resolved = guard(resolve, entry, context, where_run, base)
        parsed = guard(parse_conda, resolved, where_run) if resolved is not None else None
        if parsed:
            if parsed[0] in run:
                errors.append(f"{where_run}: {parsed[0]} is listed twice")
            run[parsed[0]] = parsed[1]
            sibling = root / "packages" / parsed[0]
            pinned = parsed[1] and (sibling / "pyproject.toml").is_file()
            if pinned and not reads_version_of(entry, sibling, base):
                errors.append(
                    f"{where_run}: the pin {entry!r} must read {parsed[0]}'s version from its "
                    f'pyproject: `${{{{ load_from_file("../../{parsed[0]}/pyproject.toml")'
                    ".project.version }}`"
                )
    want: dict[str, str] = {}
    for raw in project.get("dependencies", []):
        try:
            req = Requirement(raw)
        except InvalidRequirement as exc:
            errors.append(f"{rel_py}: dependency {raw!r} is invalid: {exc}")
            continue
        if req.marker is not None:
            errors.append(f"{rel_py}: {raw!r}: markers are not mapped to the recipe; avoid them")
        want[conda_name(req.name)] = normalize_spec(str(req.specifier), rel_py)

    py_spec = run.pop("python", None)
    requires_python = project.get("requires-python")
    if native and py_spec == "":
        pass  # a compiled package's python is pinned by the host variant (run_exports)
    elif py_spec is not None and requires_python:
        if py_spec != normalize_spec(requires_python, rel_py):
            errors.append(
                f"{where_run}: python {py_spec!r} does not match requires-python "
                f"{requires_python!r} ({rel_py})"
            )
    elif py_spec is None and not native:
        errors.append(f"{where_run}: a noarch: python package must list python (requires-python)")
    extras = {
        conda_name(Requirement(raw).name): extra
        for extra, items in project.get("optional-dependencies", {}).items()
        for raw in items
        if _valid(raw)
    }
    for dep in sorted(set(want) | set(run)):
        if dep not in want and dep in extras:
            errors.append(
                f"{where_run}: {dep} belongs to the optional extra [{extras[dep]}] and must not be "
                "a run requirement (use run_constraints to bound it)"
            )
        elif dep not in run:
            errors.append(f"{where_run}: missing {dep} {want[dep] or ''} (from {rel_py})".rstrip())
        elif dep not in want:
            errors.append(f"{where_run}: {dep} {run[dep]} is not a dependency in {rel_py}")
        elif run[dep] != want[dep]:
            errors.append(
                f"{where_run}: {dep} is '{run[dep] or '(any)'}' but {rel_py} says "
                f"'{want[dep] or '(any)'}'"
            )

    # tests import the module(s)
    imports: set[str] = set()
    for test in doc.get("tests") or []:
        if isinstance(test, dict) and isinstance(test.get("python"), dict):
            for mod in test["python"].get("imports") or []:
                imports.add(str(mod))
    if name == META:  # its own module (moet.models: the fixture model) and every component's
        needed = {META} | {
            canonicalize_name(Requirement(r).name).replace("-", "_")
            for r in project.get("dependencies", [])
            if canonicalize_name(Requirement(r).name).startswith("moet-")
        }
    else:
        needed = {name.replace("-", "_")}
    for mod in sorted(needed - imports):
        errors.append(f"{rel}: tests must import {mod!r} (a `python: {{imports: [...]}}` test)")

    # license
    about = doc.get("about") or {}
    license_ = project.get("license")
    if isinstance(license_, dict):
        license_ = license_.get("text")
    if license_ and about.get("license") != license_:
        errors.append(
            f"{rel}: about.license is {about.get('license')!r}, {rel_py} says {license_!r}"
        )

    license_files = about.get("license_file") or []
    for lic in [license_files] if isinstance(license_files, str) else license_files:
        if not (folder / str(lic)).is_file():
            errors.append(f"{rel}: about.license_file {lic!r} not found in {folder.name}/")

    row = [name, str(r_version), "native" if native else "noarch", str(len(run))]
    return errors, row


def main(root: Path = ROOT) -> int:
    errors: list[str] = []
    rows: list[list[str]] = []
    for folder in sorted(p for p in (root / "packages").iterdir() if p.is_dir()):
        errs, row = check(folder, root)
        errors += errs
        rows.append(row)
    if errors:
        for err in errors:
            print(f"error: {err}", file=sys.stderr)
        print(f"check_recipes: {len(errors)} problem(s)", file=sys.stderr)
        return 1
    print(table(rows, ["package", "version", "build", "run deps"]))
    print(f"check_recipes: {len(rows)} recipes agree with their pyproject.toml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
