"""The one benchmark runner: stands up a recipe's configuration, runs it, and writes one result
file per run (bench/results_io.write_run) with one provenance schema.

    nox -s bench -- RECIPE [RECIPE ...]     # a CPU machine (the shared .venv)
    python3 bench/run.py RECIPE [...]       # the GPU machine (no nox there; results under $OUT)
    python3 bench/run.py --list             # every recipe, its machine and its latest run
    python3 bench/run.py adopt RECIPE FILE  # a result written before the runner, as a run of RECIPE
    python3 bench/run.py adopt RECIPE NAME=FILE ...  # the same for a recipe whose result is a table

A recipe is bench/recipes/<name>.toml (or a path to one); docs/development.md, "Benchmarks", says
what its keys mean. The command runs from the repository root with BENCH_OUT and OUT set to a
scratch directory; `python` in it is this interpreter and `{out}` that directory. Its result
file(s) there, named by `result`, become the run's `result`. Results go to bench/results/<recipe>/
(`--results DIR`; on the GPU machine $OUT/<recipe>/, which the device returns for committing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from provenance import NOT_RECORDED, ROOT, provenance  # noqa: E402
from provenance import machine as this_machine_tag  # noqa: E402
from results_io import RESULTS, runs, write_run  # noqa: E402

RECIPES = HERE / "recipes"
MACHINES = ("cpu", "h200")
KEYS = {"description", "machine", "command", "result", "figure"}
FIGURE_KEYS = {"table", "what", "value", "baseline", "vs", "unit", "target", "run"}
# a figure's target: ">= 1.35", "<= 0.5" (on the ratio), ">= 200 MB/s" (on the value)
TARGET = re.compile(r"(>=|<=) ([0-9.]+(?:e[0-9]+)?)(?: (\S.*))?")


class RecipeError(Exception):
    """A recipe that cannot be run or reported: one line naming the file and the key."""


def recipe_path(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".toml":
        return p.resolve()
    return RECIPES / f"{name}.toml"


def load_recipe(name: str) -> dict:
    """The recipe `name` (bench/recipes/<name>.toml, or a .toml path), checked -> a dict with its
    `name` added."""
    path = recipe_path(name)
    where = os.path.relpath(path, ROOT) if path.is_relative_to(ROOT) else str(path)
    if not path.is_file():
        known = " ".join(sorted(p.stem for p in RECIPES.glob("*.toml")))
        raise RecipeError(f"{where}: no such recipe (the recipes: {known})")
    try:
        r = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise RecipeError(f"{where}: not valid TOML ({e})") from None

    def bad(key: str, expected: str) -> RecipeError:
        return RecipeError(f"{where}: {key}: expected {expected}, found {r.get(key)!r}")

    if set(r) - KEYS:
        raise RecipeError(f"{where}: unknown keys {sorted(set(r) - KEYS)}; expected {sorted(KEYS)}")
    if not isinstance(r.get("description"), str) or not r["description"].strip():
        raise bad("description", "one line saying what is measured")
    if r.get("machine") not in MACHINES:
        raise bad("machine", f"one of {', '.join(MACHINES)}")
    cmd = r.get("command")
    if not isinstance(cmd, list) or not cmd or not all(isinstance(a, str) for a in cmd):
        raise bad("command", "a list of strings")
    res = r.get("result")
    if not (isinstance(res, str) or (isinstance(res, dict) and res and all(
            isinstance(v, str) for v in res.values()))):  # fmt: skip
        raise bad("result", "a file name (glob) under the run's directory, or a table of them")
    for i, f in enumerate(r.get("figure", [])):
        key = f"figure[{i}]"
        if not isinstance(f, dict):
            raise RecipeError(
                f"{where}: {key}: expected a table of keys among {sorted(FIGURE_KEYS)}"
            )
        if set(f) - FIGURE_KEYS:
            raise RecipeError(f"{where}: {key}: unknown keys {sorted(set(f) - FIGURE_KEYS)}; "
                              f"expected keys among {sorted(FIGURE_KEYS)}")  # fmt: skip
        for k in ("table", "what", "value"):
            if not isinstance(f.get(k), str) or not f[k]:
                raise RecipeError(f"{where}: {key}.{k}: expected a string, found {f.get(k)!r}")
        if "target" in f and not TARGET.fullmatch(str(f["target"])):
            raise RecipeError(f"{where}: {key}.target: expected '>= N' or '<= N' (a ratio to the "
                              f"baseline, or the value with a unit), found {f['target']!r}")  # fmt: skip
    return {"name": path.stem, **r}


def collect(recipe: dict, out: Path):
    """The run's result: the file `result` names under `out` (exactly one), or a table of them."""

    def one(pattern: str):
        found = sorted(out.glob(pattern))
        if len(found) != 1:
            names = sorted(p.name for p in out.iterdir())
            raise RecipeError(f"recipe {recipe['name']}: result {pattern!r}: expected one file in "
                              f"the run's directory, found {len(found)} (it holds {names})")  # fmt: skip
        return json.loads(found[0].read_text())

    res = recipe["result"]
    return one(res) if isinstance(res, str) else {k: one(v) for k, v in res.items()}


def run(recipe: dict, results: Path) -> Path:
    machine = this_machine_tag()  # a GPU recipe runs on either Hopper kind the device lends;
    if (machine == "cpu") != (recipe["machine"] == "cpu"):  # its results name the GPU they ran on
        raise RecipeError(f"recipe {recipe['name']} runs on {recipe['machine']}, this machine is "
                          f"{machine}: run it there (docs/development.md, Benchmarks)")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix=f"moet-bench-{recipe['name']}-") as tmp:
        cmd = [
            sys.executable if a == "python" else a.replace("{out}", tmp) for a in recipe["command"]
        ]
        env = {**os.environ, "BENCH_OUT": tmp, "OUT": tmp}
        print(f"bench/run: {recipe['name']}: {' '.join(recipe['command'])}", flush=True)
        code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        if code != 0:
            raise RecipeError(f"recipe {recipe['name']}: its command exited {code} (output above); "
                              "nothing was written")  # fmt: skip
        result = collect(recipe, Path(tmp))
    prov = provenance(recipe["command"])
    path = write_run(results, recipe, prov, result)
    print(f"bench/run: {recipe['name']}: wrote {os.path.relpath(path, ROOT)}")
    return path


def adopt(recipe: dict, file: Path | dict[str, Path], results: Path) -> Path:
    """A result written before the runner existed, as a run of `recipe`: its provenance is the
    file's own (`provenance` or `environment`) or that of a JSON beside it (a run's engines);
    what none records stays "not recorded". A recipe whose `result` is a table takes a file per
    part, {name: file}; a part the older result lacks stays out (its figures then show "not in
    this run"), and parts whose own provenance names different commits are refused: not one run."""
    table = recipe["result"] if isinstance(recipe["result"], dict) else None
    if (table is None) != (not isinstance(file, dict)):
        want = f"NAME=FILE for its parts ({', '.join(table)})" if table else "one FILE"
        raise RecipeError(f"recipe {recipe['name']}: adopt takes {want}")
    parts = file if isinstance(file, dict) else {None: file}
    if table is not None and (not parts or set(parts) - set(table)):
        raise RecipeError(f"recipe {recipe['name']}: its result's parts are {sorted(table)}, "
                          f"found {sorted(parts)}")  # fmt: skip
    bodies = {name: json.loads(f.read_text()) for name, f in parts.items()}
    result = bodies[None] if table is None else bodies
    files = list(parts.values())
    own = {_commit(_own_provenance(b)) for b in bodies.values()} - {None}
    if len(own) > 1:
        raise RecipeError(f"recipe {recipe['name']}: the parts name commits {sorted(own)}: "
                          "not one run")  # fmt: skip
    prov = source = None
    given = [(f, bodies[n]) for n, f in parts.items()]
    beside = ((c, None) for f in files for c in sorted(f.parent.glob("*.json")))
    for cand, body in [*given, *beside]:
        prov = _own_provenance(json.loads(cand.read_text()) if body is None else body)
        if prov is not None:
            source = cand
            break
    if source is None:
        where = " or ".join(str(f) for f in files)
        raise RecipeError(
            f"{where}: no provenance in it or beside it (a commit to name the run by)"
        )
    first = bodies[next(iter(parts))]
    prov = {k: v for k, v in prov.items() if not isinstance(v, (dict, list)) or k == "gpus"}
    prov.setdefault("command", first.get("command", NOT_RECORDED))
    prov.setdefault("machine", recipe["machine"])
    prov.setdefault("date", first.get("date") or _date_in_name(files[0]))
    rel = {n: os.path.relpath(f.resolve(), ROOT) for n, f in parts.items()}
    prov["adopted_from"] = rel[None] if table is None else rel
    prov["provenance_from"] = os.path.relpath(source.resolve(), ROOT)  # its command is that file's
    path = write_run(results, recipe, prov, result)
    print(f"bench/run: {recipe['name']}: adopted {', '.join(rel.values())} as "
          f"{os.path.relpath(path, ROOT)}")  # fmt: skip
    return path


def _own_provenance(body) -> dict | None:
    """The provenance a result records, in the shapes results had: a provenance dict, an
    environment dict, a machine dict, or commit and date at the top level; None if none."""
    if not isinstance(body, dict):
        return None
    for prov in (body.get("provenance"), body.get("environment"), body.get("machine"), body):
        if isinstance(prov, dict) and isinstance(prov.get("commit"), str):
            return prov
    return None


def _commit(prov: dict | None) -> str | None:
    return None if prov is None else prov["commit"][:7]


def _date_in_name(file: Path) -> str:
    m = re.search(r"\d{4}-\d{2}-\d{2}", str(file))
    if not m:
        raise RecipeError(f"{file}: no date in the file or its path")
    return m.group(0)


def list_recipes(results: Path) -> None:
    for path in sorted(RECIPES.glob("*.toml")):
        r = load_recipe(path.stem)
        done = runs(results, r["name"])
        last = done[-1].name if done else "no run yet"
        print(f"{r['name']:<20} {r['machine']:<5} {last:<32} {r['description']}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    default = Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS
    ap.add_argument("--results", type=Path, default=default, help="where runs go (default: "
                    "$OUT on the GPU machine, else bench/results)")  # fmt: skip
    ap.add_argument("--list", action="store_true", help="list the recipes and their latest runs")
    ap.add_argument("recipes", nargs="*", metavar="RECIPE", help="recipe names or .toml paths; "
                    "`adopt RECIPE FILE` wraps an older result")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        if args.list:
            list_recipes(args.results)
        elif args.recipes[:1] == ["adopt"]:
            if len(args.recipes) < 3:
                ap.error("adopt takes RECIPE FILE (RECIPE NAME=FILE ... for a table result)")
            files = args.recipes[2:]
            if all("=" in a for a in files):  # a table result's parts
                file = {n: Path(f) for n, f in (a.split("=", 1) for a in files)}
            elif len(files) == 1:
                file = Path(files[0])
            else:
                ap.error("adopt takes RECIPE FILE (RECIPE NAME=FILE ... for a table result)")
            adopt(load_recipe(args.recipes[1]), file, args.results)
        elif not args.recipes:
            ap.error("name a recipe (--list shows them)")
        else:
            for r in [load_recipe(n) for n in args.recipes]:  # every recipe checked first
                run(r, args.results)
    except RecipeError as e:
        print(f"bench/run: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
