"""The benchmark system (bench/run.py, bench/report.py, bench/recipes/): every committed recipe is
valid and every figure renders from its committed run (the newest, or the one it names); the
runner runs a recipe and writes one run file with the one provenance schema; the report renders a
table from it and its check fails on a stale one; bad recipes and failing commands give one clear
line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "bench"
PROVENANCE = {"gpu", "driver", "torch", "vllm", "commit", "command", "date", "machine"}


def bench(script: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(BENCH / script), *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def tools():
    sys.path.insert(0, str(BENCH))
    import report
    import run

    yield run, report
    sys.path.remove(str(BENCH))


def test_every_recipe_loads_and_every_figure_renders_from_its_newest_run(tools):
    run, report = tools
    names = sorted(p.stem for p in run.RECIPES.glob("*.toml"))
    assert len(names) >= 10
    tables = report.figures(report.RESULTS)
    assert tables["readme"]  # the README's table
    rendered = 0
    for figs in tables.values():
        for fig, run_file in figs:
            if run_file is not None:
                assert report.row(fig, run_file, ROOT / "README.md").count("|") == 7
                rendered += 1
    assert rendered >= 10


def test_the_committed_tables_are_what_the_runs_render():
    r = bench("report.py", "--check")
    assert r.returncode == 0, r.stderr


def test_resolve_picks_list_elements_by_fields_and_says_what_is_missing(tools):
    run, report = tools
    data = {"tables": [{"pool": "all", "rows": [{"batch": 1, "tok_s": 5}, {"batch": 8, "tok_s": 9}]},
                       {"pool": "all, fp4 25%", "rows": [{"batch": 1, "tok_s": 3}]}]}  # fmt: skip
    assert report.resolve(data, "tables[pool=all].rows[batch=8].tok_s") == 9.0
    assert report.resolve(data, "tables[pool=all, fp4 25%].rows[0].tok_s") == 3.0
    with pytest.raises(run.RecipeError, match=r"0 elements of rows match \[batch=2\]"):
        report.resolve(data, "tables[pool=all].rows[batch=2].tok_s")
    with pytest.raises(run.RecipeError, match=r"no 'tok' \(found \['batch', 'tok_s'\]\)"):
        report.resolve(data, "tables[pool=all].rows[batch=1].tok")
    with pytest.raises(run.RecipeError, match="expected a number"):
        report.resolve(data, "tables[pool=all].pool")
    dotted = {"summary": {"glm-5.2": {"worst": 5.4}}, "layers": {"same": [0.7, 0.6]}}
    assert report.resolve(dotted, "summary.'glm-5.2'.worst") == 5.4  # a key holding a dot
    assert report.resolve(dotted, "layers.same[1]") == 0.6
    with pytest.raises(run.RecipeError, match=r"no 'glm-5'"):
        report.resolve(dotted, "summary.glm-5.2.worst")


RECIPE = """description = "a test recipe: a value and its baseline, written by the command"
machine = "cpu"
command = ["python", "-c", "import json, os; open(os.path.join(os.environ['BENCH_OUT'], 'r.json'), 'w').write(json.dumps({'rows': [{'batch': 1, 'moet': 30.0, 'stock': 20.0}]}))"]
result = "r.json"

[[figure]]
table = "test"
what = "decode, batch 1"
value = "rows[batch=1].moet"
baseline = "rows[batch=1].stock"
vs = "stock"
unit = "tok/s"
target = ">= 1.35"
"""


def test_a_recipe_runs_writes_one_run_file_and_renders_a_table(tmp_path, tools):
    run, report = tools
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(RECIPE)
    results = tmp_path / "results"
    r = bench("run.py", "--results", str(results), str(recipe))
    assert r.returncode == 0, r.stderr
    (path,) = (results / "tiny").glob("cpu-*.json")
    body = json.loads(path.read_text())
    assert body["schema"] == 1 and body["recipe"]["name"] == "tiny"
    assert set(body["provenance"]) >= PROVENANCE and body["provenance"]["machine"] == "cpu"
    assert body["result"] == {"rows": [{"batch": 1, "moet": 30.0, "stock": 20.0}]}
    fig = run.load_recipe(str(recipe))["figure"][0]
    line = report.row(fig, path, tmp_path / "doc.md")
    assert "| 30.0 tok/s | 20.0 tok/s (stock) | 1.50× | ≥ 1.35×: met |" in line
    assert f"(results/tiny/{path.name})" in line  # linked relative to the page
    doc = tmp_path / "doc.md"
    doc.write_text("# page\n<!-- bench:test begin -->\nstale\n<!-- bench:test end -->\n")
    new, seen = report.render(doc, doc.read_text(), {"test": [(fig, path)]})
    assert seen == {"test"} and "stale" not in new and line in new
    assert report.render(doc, new, {"test": [(fig, path)]})[0] == new  # stable


def test_a_figure_naming_a_run_reads_that_run_and_an_unknown_one_is_one_clear_line(
    tmp_path, tools, monkeypatch
):
    run, report = tools
    import results_io

    recipes, results = tmp_path / "recipes", tmp_path / "results"
    recipes.mkdir()
    newest = RECIPE[RECIPE.index("[[figure]]") :].replace('table = "test"', 'table = "newest"')
    (recipes / "tiny.toml").write_text(f'{RECIPE}run = "cpu-2026-11-01-aaaaaaa"\n\n{newest}')
    monkeypatch.setattr(run, "RECIPES", recipes)
    monkeypatch.setattr(report, "RECIPES", recipes)
    recipe = run.load_recipe("tiny")
    for commit, day, moet in [("aaaaaaa", "2026-11-01", 30.0), ("bbbbbbb", "2026-12-01", 40.0)]:
        prov = {"machine": "cpu", "date": day, "commit": commit}
        rows = [{"batch": 1, "moet": moet, "stock": 20.0}]
        results_io.write_run(results, recipe, prov, {"rows": rows})
    tables = report.figures(results)
    (fig, named), (_, newest_run) = tables["test"][0], tables["newest"][0]
    assert named.stem == "cpu-2026-11-01-aaaaaaa" and newest_run.stem == "cpu-2026-12-01-bbbbbbb"
    line = report.row(fig, named, tmp_path / "d.md")
    assert "| 30.0 tok/s | 20.0 tok/s (stock) | 1.50× |" in line and named.name in line
    (recipes / "tiny.toml").write_text(f'{RECIPE}run = "cpu-2026-10-01-ccccccc"\n')
    with pytest.raises(run.RecipeError, match="'decode, batch 1': no run 'cpu-2026-10-01-ccccccc'"):
        report.figures(results)


TABLE_RECIPE = """description = "a test recipe whose result is a table of two files"
machine = "cpu"
command = ["true"]

[result]
ours = "ours-*.json"
theirs = "theirs.json"

[[figure]]
table = "test"
what = "batch 1"
value = "ours.timing.batches.1.us"
baseline = "theirs.Marlin W4A16.1"
vs = "Marlin"
unit = "µs"
target = "<= 0.5"
"""


def test_adopt_wraps_older_files_as_a_run_of_a_table_recipe(tmp_path, tools):
    run, report = tools
    recipe = tmp_path / "pair.toml"
    recipe.write_text(TABLE_RECIPE)
    old = tmp_path / "old"
    old.mkdir()
    ours = old / "h200-2026-11-30.json"
    ours.write_text(json.dumps({"environment": {"commit": "abc1234", "gpu": "H200"},
                                "timing": {"batches": {"1": {"us": 40.0}}}}))  # fmt: skip
    theirs = old / "vllm_moe.json"
    theirs.write_text(json.dumps({"Marlin W4A16": {"1": 80.0}, "versions": {"vllm": "0.24.0"}}))
    results = tmp_path / "results"
    r = bench("run.py", "--results", str(results), "adopt", str(recipe),
              f"ours={ours}", f"theirs={theirs}")  # fmt: skip
    assert r.returncode == 0, r.stderr
    (path,) = (results / "pair").glob("cpu-2026-11-30-abc1234.json")
    body = json.loads(path.read_text())
    assert set(body["result"]) == {"ours", "theirs"} and body["provenance"]["gpu"] == "H200"
    assert set(body["provenance"]["adopted_from"]) == {"ours", "theirs"}
    fig = run.load_recipe(str(recipe))["figure"][0]
    assert "| 40.0 µs | 80.0 µs (Marlin) | 0.50× | ≤ 0.5×: met |" in report.row(
        fig, path, tmp_path / "d.md"
    )
    # a part the older result lacks stays out: its baseline is "not in this run"
    r = bench(
        "run.py", "--results", str(tmp_path / "partial"), "adopt", str(recipe), f"ours={ours}"
    )
    assert r.returncode == 0, r.stderr
    (path,) = (tmp_path / "partial" / "pair").glob("*.json")
    assert "| 40.0 µs | not in this run (Marlin) |" in report.row(fig, path, tmp_path / "d.md")
    # one FILE for a table recipe, an unknown part, parts of two runs: one clear line each
    other = old / "other.json"
    other.write_text(json.dumps({"environment": {"commit": "def5678"}}))
    for args, message in [
        ([str(ours)], "adopt takes NAME=FILE for its parts (ours, theirs)"),
        ([f"mine={ours}"], "its result's parts are ['ours', 'theirs'], found ['mine']"),
        ([f"ours={ours}", f"theirs={other}"], "not one run"),
    ]:
        r = bench("run.py", "--results", str(tmp_path / "bad"), "adopt", str(recipe), *args)
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "bad").exists()


def test_the_report_renders_the_packages_readmes_too(tools):
    _, report = tools
    found = set()
    for doc in sorted((ROOT / "packages").glob("*/README.md")):
        found |= report.render(doc, doc.read_text(), report.figures(report.RESULTS))[1]
    assert {"quant-speed", "store-cpu", "store-h200"} <= found


def test_the_check_fails_on_a_stale_table_with_one_line(tmp_path, tools):
    _, report = tools
    doc = tmp_path / "README.md"
    doc.write_text("".join(f"<!-- bench:{t} begin -->\nedited by hand\n<!-- bench:{t} end -->\n"
                           for t in report.figures(report.RESULTS)))  # fmt: skip
    r = bench("report.py", "--check", "--docs", str(doc))
    assert r.returncode == 1 and "run `nox -s report`" in r.stderr
    assert len(r.stderr.splitlines()) == 1 and "edited by hand" in doc.read_text()


def test_the_check_covers_what_bench_scripts_render(tmp_path, tools, monkeypatch, capsys):
    """docs/quality.md (bench/fixture/quality.py's, whole) and docs/residency.md's results table and
    docs/residency-replay.svg (bench/residency.py's) render from the committed results: the check
    passes on copies of the committed ones and fails with one line naming the file on a copy
    edited by hand, which the plain run restores; a page without the table's markers is an error."""
    _, report = tools
    monkeypatch.setattr(report, "ROOT", tmp_path)  # the scripts' docs: copies under tmp_path
    (tmp_path / "docs").mkdir()
    quality, svg, page = (tmp_path / "docs" / n for n in ("quality.md", "residency-replay.svg",
                                                          "residency.md"))  # fmt: skip
    for doc in (quality, svg):
        doc.write_text((ROOT / "docs" / doc.name).read_text())
    block = re.search(r"<!-- bench:residency begin -->\n.*?<!-- bench:residency end -->\n",
                      (ROOT / "docs" / "residency.md").read_text(), re.S).group(0)  # fmt: skip
    # the residency page: every recipe table (the check wants them all), rendered for this copy,
    # then the committed results table
    tables = report.figures(report.RESULTS)
    skeleton = "".join(f"<!-- bench:{t} begin -->\n<!-- bench:{t} end -->\n" for t in tables)
    page.write_text(report.render(page, skeleton, tables)[0] + block)
    docs = [str(d) for d in (quality, svg, page)]
    assert report.main(["--check", "--docs", *docs]) == 0, capsys.readouterr().err
    edits = {
        quality: lambda t: t.replace("not significant", "insignificant", 1),
        svg: lambda t: t.replace('fill="white"', 'fill="ivory"', 1),
        page: lambda t: t.replace(block, block.replace("| 5% |", "| 6% |", 1)),
    }
    for doc, edit in edits.items():
        committed = doc.read_text()
        doc.write_text(edit(committed))
        assert doc.read_text() != committed
        capsys.readouterr()
        assert report.main(["--check", "--docs", *docs]) == 1
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith(f"bench/report: docs/{doc.name}: ")
        assert "run `nox -s report`" in err and doc.read_text() != committed
        assert report.main(["--docs", *docs]) == 0 and doc.read_text() == committed
    page.write_text(report.render(page, skeleton, tables)[0])
    assert report.main(["--check", "--docs", *docs]) == 2
    assert "docs/residency.md: no <!-- bench:residency begin -->" in capsys.readouterr().err


def test_the_scripts_renders_import_no_torch_vllm_or_model():
    code = (
        "import sys; sys.path.insert(0, 'bench'); import report; "
        "[make(report.RESULTS) for _, make in report.SCRIPTED.values()]; "
        "heavy = {'torch', 'vllm', 'transformers', 'safetensors', 'moet'}; "
        "found = sorted(m for m in sys.modules if m.split('.')[0] in heavy); "
        "assert not found, found"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: s.replace('machine = "cpu"', 'machine = "tpu"'),
            "machine: expected one of cpu, h200",
        ),
        (lambda s: 'colour = "red"\n' + s, "unknown keys ['colour']"),
        (lambda s: s.replace('target = ">= 1.35"', 'target = "about 1.35"'), "figure[0].target"),
        (lambda s: s + 'colour = "red"\n', "figure[0]: unknown keys ['colour']"),
        (
            lambda s: s.replace('value = "rows[batch=1].moet"\n', ""),
            "figure[0].value: expected a string",
        ),
        (lambda s: s.replace("result = ", "result = 3 #"), "result: expected a file name"),
        (
            lambda s: s.replace('"python", "-c"', '"python", "-c", "raise SystemExit(3)", "-c"'),
            "its command exited 3",
        ),
        (
            lambda s: s.replace('result = "r.json"', 'result = "other.json"'),
            "result 'other.json': expected one file in the run's directory, found 0",
        ),
    ],
)
def test_a_bad_recipe_or_a_failing_command_is_one_clear_line(tmp_path, edit, message):
    recipe = tmp_path / "bad.toml"
    recipe.write_text(edit(RECIPE))
    r = bench("run.py", "--results", str(tmp_path / "results"), str(recipe))
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("bench/run: error: ") and message in err, err
    assert "Traceback" not in r.stderr and not (tmp_path / "results").exists()


def test_a_recipe_for_another_machine_is_refused(tmp_path, tools):
    import provenance

    here = provenance.machine()
    other = "h200" if here == "cpu" else "cpu"
    recipe = tmp_path / "elsewhere.toml"
    recipe.write_text(RECIPE.replace('machine = "cpu"', f'machine = "{other}"'))
    r = bench("run.py", "--results", str(tmp_path), str(recipe), cwd=tmp_path)
    assert r.returncode == 2 and f"runs on {other}, this machine is {here}" in r.stderr


def test_an_unknown_recipe_names_the_known_ones():
    r = bench("run.py", "no-such-recipe")
    assert r.returncode == 2 and "no such recipe" in r.stderr and "decode-glm45air" in r.stderr
