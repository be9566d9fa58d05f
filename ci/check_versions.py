#!/usr/bin/env python3
"""Check that the versions of the moet packages agree with each other (`nox -s versions`).

For every ``packages/*/pyproject.toml``:

* each dependency on another moet package pins exactly that package's current version:
  ``~=X.Y.Z`` for a release, ``==X.Y.ZrcN`` (or any pre/dev release) for a pre-release
  (design.md, Layout);
* the meta-package ``moet`` pins every component package;
* ``src/<import name>/__init__.py`` reads ``__version__`` from the installed distribution
  (``importlib.metadata.version("<name>")``), never a literal: the pyproject is the one place;
* the package's ``CHANGELOG.md`` has a heading for its version.

Prints one line per problem (naming the file) and exits 1, or prints a summary table and exits 0.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

try:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version
except ImportError:  # pragma: no cover - depends on the environment
    sys.exit("check_versions: the 'packaging' distribution is required (pip install packaging)")

ROOT = Path(__file__).resolve().parent.parent
META = "moet"


@dataclass
class Package:
    name: str  # canonical distribution name
    folder: Path
    pyproject: Path
    version: str
    dependencies: list[str]
    root: Path
    notes: list[str] = field(default_factory=list)

    @property
    def import_name(self) -> str:
        return self.name.replace("-", "_")

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.root))


def load_packages(root: Path) -> tuple[dict[str, Package], list[str]]:
    packages: dict[str, Package] = {}
    errors: list[str] = []
    for folder in sorted(p for p in (root / "packages").iterdir() if p.is_dir()):
        pyproject = folder / "pyproject.toml"
        rel = pyproject.relative_to(root)
        if not pyproject.is_file():
            errors.append(f"{rel}: missing (every folder under packages/ is a package)")
            continue
        try:
            data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            errors.append(f"{rel}: not valid TOML: {exc}")
            continue
        project = data.get("project", {})
        name, version = project.get("name"), project.get("version")
        if not name or not version:
            errors.append(f"{rel}: [project] needs a static name and version")
            continue
        if "version" in project.get("dynamic", []):
            errors.append(f"{rel}: version must be static, not dynamic")
        try:
            Version(version)
        except InvalidVersion:
            errors.append(f"{rel}: version {version!r} is not a PEP 440 version")
            continue
        packages[canonicalize_name(name)] = Package(
            name=canonicalize_name(name),
            folder=folder,
            pyproject=pyproject,
            version=version,
            dependencies=list(project.get("dependencies", [])),
            root=root,
        )
    return packages, errors


def expected_pin(version: str) -> str:
    """The one specifier a dependent may use for `version` (design.md, Layout)."""
    return f"=={version}" if Version(version).is_prerelease else f"~={version}"


def check_pins(pkg: Package, packages: dict[str, Package]) -> tuple[list[str], list[str]]:
    """Returns (errors, pins) for pkg's dependencies on other moet packages."""
    errors: list[str] = []
    pins: list[str] = []
    rel = pkg.rel(pkg.pyproject)
    for raw in pkg.dependencies:
        try:
            req = Requirement(raw)
        except InvalidRequirement as exc:
            errors.append(f"{rel}: dependency {raw!r} is not a valid requirement: {exc}")
            continue
        dep = canonicalize_name(req.name)
        if not (dep == META or dep.startswith("moet-")):
            continue
        target = packages.get(dep)
        if target is None:
            errors.append(
                f"{rel}: depends on {dep!r}, but packages/ has no package of that name "
                f"(known: {', '.join(sorted(packages))})"
            )
            continue
        want = expected_pin(target.version)
        got = ",".join(sorted(str(s) for s in req.specifier))
        kind = "pre-release" if Version(target.version).is_prerelease else "release"
        if got != want:
            errors.append(
                f"{rel}: pin {raw!r} does not match {dep} {target.version} "
                f"({target.rel(target.pyproject)}): a {kind} must be pinned as '{dep}{want}'"
            )
        elif req.marker is not None or req.extras:
            errors.append(f"{rel}: pin {raw!r} must carry no extras or markers")
        pins.append(f"{dep}{got}")
    if pkg.name == META:
        pinned = {canonicalize_name(Requirement(r).name) for r in pkg.dependencies if _valid(r)}
        for comp in sorted(set(packages) - {META} - pinned):
            errors.append(f"{rel}: the meta-package does not pin component {comp!r}")
    return errors, pins


def _valid(raw: str) -> bool:
    try:
        Requirement(raw)
    except InvalidRequirement:
        return False
    return True


def literal_version(init: Path) -> str | None:
    """The string literal assigned to a top-level `__version__` in `init`, else None."""
    tree = ast.parse(init.read_text(encoding="utf-8"), filename=str(init))
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__version__" for t in targets):
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
            return None
    return None


def check_module_version(pkg: Package) -> tuple[list[str], str]:
    """Returns (errors, status for the table): the module reads its version from the installed
    distribution's metadata; a literal would be a second place to keep it."""
    init = pkg.folder / "src" / pkg.import_name / "__init__.py"
    rel = pkg.rel(init)
    if not init.is_file():
        return [f"{rel}: missing"], "missing"
    text = init.read_text(encoding="utf-8")
    found = literal_version(init)
    if found is not None:
        return [
            f"{rel}: a literal __version__ {found!r} repeats {pkg.rel(pkg.pyproject)}'s version; "
            f'read it with importlib.metadata.version("{pkg.name}")'
        ], found
    if f'version("{pkg.name}")' not in text:
        return [f'{rel}: __version__ must be importlib.metadata.version("{pkg.name}")'], "missing"
    return [], "metadata"


def changelog_has(text: str, version: str) -> bool:
    # "## 0.1.0", "## [0.1.0] - 2026-11-29", "## v0.1.0 (unreleased)" all count.
    pattern = rf"^#{{1,6}}\s*\[?v?{re.escape(version)}\]?(?=\s|$)"
    return re.search(pattern, text, flags=re.MULTILINE) is not None


def check_changelog(pkg: Package) -> tuple[list[str], str]:
    changelog = pkg.folder / "CHANGELOG.md"
    rel = pkg.rel(changelog)
    if not changelog.is_file():
        return [f"{rel}: missing (it needs a heading '## {pkg.version}')"], "missing"
    if not changelog_has(changelog.read_text(encoding="utf-8"), pkg.version):
        return [f"{rel}: no heading for version {pkg.version} (e.g. '## {pkg.version}')"], "missing"
    return [], "ok"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def main(root: Path = ROOT) -> int:
    packages, errors = load_packages(root)
    rows: list[list[str]] = []
    for pkg in packages.values():
        pin_errors, pins = check_pins(pkg, packages)
        mod_errors, mod = check_module_version(pkg)
        log_errors, log = check_changelog(pkg)
        errors += pin_errors + mod_errors + log_errors
        rows.append([pkg.name, pkg.version, mod, log, ", ".join(pins) or "-"])
    for pkg in packages.values():
        for note in pkg.notes:
            print(note)
    if errors:
        for err in errors:
            print(f"error: {err}", file=sys.stderr)
        print(f"check_versions: {len(errors)} problem(s)", file=sys.stderr)
        return 1
    print(table(rows, ["package", "version", "__version__", "changelog", "pins"]))
    print(f"check_versions: {len(packages)} packages consistent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
