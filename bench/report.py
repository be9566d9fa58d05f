"""The report step: every benchmark figure in README.md, docs/ and the packages' READMEs rendered
from the committed runs.

    nox -s report              # rewrite the tables between their markers
    nox -s report -- --check   # CI: fail when a table differs from what the runs render

A recipe's `[[figure]]` entries name a table (`readme`: the README's). A table lives in README.md,
a page of docs/ or a package's README (packages/*/README.md) between `<!-- bench:NAME begin -->`
and `<!-- bench:NAME end -->`, and its rows come from the newest run of each figure's recipe
(bench/results/<recipe>/), or the one its `run` names: the value, the baseline of the same run,
their ratio, the target and the run file. The pages a bench script renders itself from committed
results (SCRIPTED: a block between markers, or a whole file) are checked and rewritten the same
way, with the script's render; markers of other names are left alone.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from provenance import ROOT  # noqa: E402
from results_io import RESULTS, runs  # noqa: E402
from run import RECIPES, TARGET, RecipeError, load_recipe  # noqa: E402

MARKER = re.compile(r"<!-- bench:(?P<name>[\w-]+) begin -->\n.*?<!-- bench:(?P=name) end -->", re.S)
HEAD = (
    "| measured | value | baseline, same run | ratio | target | run |\n|---|---|---|---|---|---|\n"
)


def resolve(data, path: str):
    """The value at `path` in a run's result: keys joined by '.' (a key holding a dot in single
    quotes: `summary.'glm-5.2'.sized`), a list element picked by `[key=value&key=value]` (the one
    element whose fields print so) or `[N]`."""
    here = data
    for m in re.finditer(r"(?:'([^']*)'|([^.\[\]']+))(?:\[([^\]]*)\])?", path):
        key, pick = m.group(1) if m.group(1) is not None else m.group(2), m.group(3)
        if not isinstance(here, dict) or key not in here:
            have = sorted(here) if isinstance(here, dict) else type(here).__name__
            raise RecipeError(f"{path}: no {key!r} (found {have})")
        here = here[key]
        if pick is None:
            continue
        if not isinstance(here, list):
            raise RecipeError(f"{path}: {key} is not a list, it cannot take [{pick}]")
        if pick.isdigit():
            here = here[int(pick)]
            continue
        want = dict(c.split("=", 1) for c in pick.split("&"))
        found = [e for e in here if all(str(e.get(k)) == v for k, v in want.items())]
        if len(found) != 1:
            raise RecipeError(f"{path}: {len(found)} elements of {key} match [{pick}], expected 1")
        here = found[0]
    if not isinstance(here, (int, float)) or isinstance(here, bool):
        raise RecipeError(f"{path}: expected a number, found {here!r}")
    return float(here)


def number(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"


def shown_target(fig: dict) -> str:
    """A figure's target as the tables show it ("≥ 1.35×", "≤ 200 MB/s"), or ""."""
    if "target" not in fig:
        return ""
    op, bound, tunit = TARGET.fullmatch(fig["target"]).groups()
    return f"{'≥' if op == '>=' else '≤'} {bound}{' ' + tunit if tunit else '×'}"


def row(fig: dict, run_file: Path | None, doc: Path) -> str:
    """One figure's row of the table in `doc` (links relative to it)."""
    if run_file is None:
        return f"| {fig['what']} | no run yet | | | {shown_target(fig)} | |\n"
    body = json.loads(run_file.read_text())
    unit = f" {fig['unit']}" if fig.get("unit") else ""
    value = resolve(body["result"], fig["value"])
    base = ratio = None
    if "baseline" in fig:
        try:
            base = resolve(body["result"], fig["baseline"])
        except RecipeError:  # a run without the baseline (an older result adopted)
            base = None
        ratio = value / base if base else None
    target = shown_target(fig)
    if "target" in fig:
        op, bound, tunit = TARGET.fullmatch(fig["target"]).groups()
        of = value if tunit else ratio  # a target with a unit bounds the value, else the ratio
        met = None if of is None else (of >= float(bound) if op == ">=" else of <= float(bound))
        target += "" if met is None else f": {'met' if met else 'not met'}"
    p = body["provenance"]
    link = os.path.relpath(run_file, doc.parent)
    when = f"{p['machine']} {str(p['date'])[:10]} {str(p['commit'])[:7]}"
    base_cell = f"{number(base)}{unit} ({fig.get('vs', 'baseline')})" if base else (
        f"not in this run ({fig.get('vs', 'baseline')})" if "baseline" in fig else "")  # fmt: skip
    ratio_cell = f"{ratio:.2f}×" if ratio else ""
    return f"| {fig['what']} | {number(value)}{unit} | {base_cell} | {ratio_cell} | {target} | [{when}]({link}) |\n"


def figures(results: Path) -> dict[str, list[tuple[dict, Path | None]]]:
    """table name -> [(figure, its run or None)], in recipe-name order: the run of its recipe that
    the figure's `run` names (a past run's figure), else the newest."""
    tables: dict[str, list] = {}
    for path in sorted(RECIPES.glob("*.toml")):
        recipe = load_recipe(path.stem)
        done = runs(results, recipe["name"])
        for fig in recipe.get("figure", []):
            run_file = done[-1] if done else None
            if "run" in fig:
                run_file = next((p for p in done if p.stem == fig["run"]), None)
                if run_file is None:
                    raise RecipeError(f"recipe {recipe['name']}: figure {fig['what']!r}: no run "
                                      f"{fig['run']!r} (its runs: {[p.stem for p in done]})")  # fmt: skip
            tables.setdefault(fig["table"], []).append((fig, run_file))
    return tables


@functools.cache
def script(path: str):
    """bench/`path` as a module, for its render: that imports numpy and the installed moet
    packages' formatters (the .venv's), never torch, vLLM or a model."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, HERE / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache  # the block and the plot read the same run
def residency_run(results: Path) -> dict:
    """The result of the newest run of the recipe residency-policy (bench/residency.py)."""
    done = runs(results, "residency-policy")
    if not done:
        raise RecipeError("no run of the recipe residency-policy to render docs/residency.md from")
    return json.loads(done[-1].read_text())["result"]


# What bench scripts render themselves from committed results, checked and rewritten here with
# the recipes' tables: doc (from the root) -> (its marker name, or None: the whole file; the render:
# the results folder -> the text).
SCRIPTED = {
    "docs/quality.md": (None, lambda results: script("fixture/quality.py").render()),
    "docs/residency.md": (
        "residency",
        lambda results: script("residency.py").render(residency_run(results)),
    ),
    "docs/residency-replay.svg": (
        None,
        lambda results: script("residency.py").svg(residency_run(results)),
    ),
}


def render(
    doc: Path, text: str, tables: dict, blocks: dict[str, str] | None = None
) -> tuple[str, set[str]]:
    """`text` of `doc` with each recipes' table rendered, and each of `blocks` (marker name -> a
    script's text) put between its markers -> (new text, tables and blocks found in it)."""
    seen = set()
    blocks = blocks or {}

    def table(m: re.Match) -> str:
        name = m.group("name")
        if name in blocks:
            seen.add(name)
            return f"<!-- bench:{name} begin -->\n{blocks[name]}<!-- bench:{name} end -->"
        if name not in tables:
            return m.group(0)
        seen.add(name)
        rows = "".join(row(f, run_file, doc) for f, run_file in tables[name])
        return (f"<!-- bench:{name} begin -->\n<!-- generated by bench/report.py from "
                f"bench/recipes/ and their runs: do not edit -->\n{HEAD}{rows}"
                f"<!-- bench:{name} end -->")  # fmt: skip

    return MARKER.sub(table, text), seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/report.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if a table is not what renders")
    ap.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)
    ap.add_argument("--docs", type=Path, nargs="*", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    scripted = {(ROOT / rel).resolve(): entry for rel, entry in SCRIPTED.items()}
    if args.docs is not None:
        docs = args.docs
    else:
        docs = [
            ROOT / "README.md",
            *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "packages").glob("*/README.md")),
        ]
        listed = {d.resolve() for d in docs}
        docs += [p for p in scripted if p not in listed]
    try:
        tables = figures(args.results)
        stale, found = [], set()
        for doc in docs:
            text = doc.read_text()
            marker, make = scripted.get(doc.resolve(), (None, None))
            if make and marker is None:  # a script's whole file
                new = make(args.results)
            else:
                new, seen = render(
                    doc, text, tables, {marker: make(args.results)} if make else None
                )
                found |= seen
                if make and marker not in seen:
                    raise RecipeError(f"{os.path.relpath(doc, ROOT)}: no <!-- bench:{marker} "
                                      "begin --> ... end --> markers for its script's table")  # fmt: skip
            if new != text:
                stale.append(os.path.relpath(doc, ROOT))
                if not args.check:
                    doc.write_text(new)
        missing = sorted(set(tables) - found)
        if missing:
            raise RecipeError(f"tables {missing} of the recipes' figures have no markers "
                              "(<!-- bench:NAME begin --> ... end -->) in README.md, docs/ or "
                              "packages/*/README.md")  # fmt: skip
    except RecipeError as e:
        print(f"bench/report: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # a script's render needs the project's packages
        print(f"bench/report: error: {e.name} is not installed for {sys.executable}: run "
              "`nox -s report` (or bench/report.py with .venv/bin/python)", file=sys.stderr)  # fmt: skip
        return 2
    if args.check and stale:
        print(f"bench/report: {', '.join(stale)}: benchmark tables differ from what the committed "
              "results render: run `nox -s report` and commit", file=sys.stderr)  # fmt: skip
        return 1
    print(
        f"bench/report: {len(docs)} files, {sum(map(len, tables.values()))} figures, "
        f"{sum(d.resolve() in scripted for d in docs)} rendered by bench scripts: "
        + ("up to date" if not stale else f"rewrote {', '.join(stale)}")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
