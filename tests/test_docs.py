"""Docs that cannot drift: the site builds with `mkdocs build --strict` (a broken link or anchor, or a page
missing from the nav, fails), every rendered table equals what scripts/docs.py renders from scripts/results/
now, every file in scripts/results/ is named by one script's `OUTPUTS`, and the README stays a front page (the
two commands first, at most 250 lines)."""

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _docs_module():
    spec = importlib.util.spec_from_file_location("jaxrl_docs_render", ROOT / "scripts" / "docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


docs = _docs_module()


def test_every_rendered_block_equals_its_json():
    stale = [str(p.relative_to(ROOT)) for p in docs.stale()]
    assert not stale, f"pages differ from scripts/results/ (run: scripts/venv.sh python scripts/docs.py): {stale}"
    # every renderer is used by some page, and the pages name no unknown renderer (render_text would raise)
    used = set()
    for p in docs.pages():
        used |= {m.group("name") for m in docs.MARK.finditer(p.read_text())}
    assert used == set(docs.RENDERERS), sorted(set(docs.RENDERERS) ^ used)


def test_check_flag_exits_nonzero_on_a_changed_figure(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    fresh = docs.render_text("x\n<!-- render:rollout -->\n\nold\n\n<!-- /render:rollout -->\ny\n")
    assert "old" not in fresh and "| 1 |" in fresh and "Machine: " in fresh
    page.write_text(fresh.replace("| 1 |", "| 2 |", 1))                   # a figure typed over by hand
    monkeypatch.setattr(docs, "pages", lambda: [page])
    assert docs.stale() == [page]
    assert docs.main(["--check"]) == 1 and "| 2 |" in page.read_text()    # --check writes nothing
    assert docs.main([]) == 0 and docs.stale() == [] and page.read_text() == fresh
    with pytest.raises(SystemExit, match="unknown rendered block"):
        docs.render_text("<!-- render:nope -->\n<!-- /render:nope -->")
    with pytest.raises(SystemExit, match="unbalanced"):
        docs.render_text("<!-- render:rollout -->\n")


def test_quickstart_table_from_summary_json(tmp_path, monkeypatch):
    from jaxrl.train.summary import write_summary

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": i, "reward_mean": 0.1 * i, "pass_rate": 0.0, "step_seconds": 0.5, "rollout_s": 0.1,
             "train_s": 0.3, "response_len_mean": 5.0, "response_len_max": 9} for i in range(10)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(write_summary(run, 125.0, argv=[]), results / "quickstart.json")
    monkeypatch.setattr(docs, "RESULTS", results)
    text = docs.RENDERERS["quickstart"]()
    assert "| 2 min 5 s |" in text and "0.050 → 0.850 (+0.80)" in text and "5.0 / 9 tokens" in text
    assert "Machine: " in text and "not recorded" not in text
    (results / "quickstart.json").unlink()
    assert "Not measured on this release yet" in docs.RENDERERS["quickstart"]()


def _declared_outputs() -> dict[str, tuple[str, ...]]:
    """{script name: its module-level `OUTPUTS`} for scripts/*.py, read with `ast` (nothing is imported)."""
    out = {}
    for path in sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "OUTPUTS" for t in node.targets):
                out[path.name] = ast.literal_eval(node.value)
    return out


def test_every_result_file_is_written_by_a_script():
    """Each file in scripts/results/ matches exactly one script's OUTPUTS (names or glob patterns), each pattern
    matches a file there, and docs/benchmarks.md's table names every such script."""
    declared = _declared_outputs()
    assert all(isinstance(v, tuple) and v and all(isinstance(x, str) for x in v) for v in declared.values())
    files = sorted(p.name for p in docs.RESULTS.iterdir() if p.is_file())
    writers = {f: [s for s, pats in declared.items() if any(fnmatch(f, pat) for pat in pats)] for f in files}
    orphans = [f for f, w in writers.items() if not w]
    assert not orphans, f"scripts/results/ files no script in scripts/ names in its OUTPUTS: {orphans}"
    shared = {f: w for f, w in writers.items() if len(w) > 1}
    assert not shared, f"files named by several scripts: {shared}"
    unmatched = [(s, pat) for s, pats in declared.items() for pat in pats if not any(fnmatch(f, pat) for f in files)]
    assert not unmatched, f"OUTPUTS naming no file in scripts/results/: {unmatched}"
    table = (ROOT / "docs" / "benchmarks.md").read_text()
    assert not [s for s in declared if f"`{s}`" not in table], "docs/benchmarks.md's table misses a script"


def test_machine_line():
    assert docs.machine({}) == "not recorded"
    assert docs.machine({"backend": "cpu"}) == "not recorded (backend: cpu)"
    assert docs.machine({"machine": {"cpu": "AMD EPYC", "cores": 2}}) == "AMD EPYC, 2 cores"
    assert docs.machine({"environment": {"platform": "Linux", "cpu_cores": 2}}) == "Linux, 2 cores"


def test_readme_is_the_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"
    assert lines[2:6] == [
        "```bash",
        "scripts/venv.sh python -m jaxrl.train       # quickstart: tiny model, built-in tasks, warm start, then GRPO "
        "(~5 min on 2 CPU cores)",
        "scripts/venv.sh python -m pytest -q         # the whole test suite (what .ci/run runs)",
        "```"]
    assert "exec scripts/venv.sh python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


def test_nav_lists_every_page():
    cfg = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.SafeLoader)

    def walk(nav):
        for item in nav:
            for v in item.values() if isinstance(item, dict) else [item]:
                yield from walk(v) if isinstance(v, list) else [v]

    nav = sorted(walk(cfg["nav"]))
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert nav == sorted(pages + ["index.md"])            # index.md is README.md (the hook in scripts/docs.py)


def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    site = tmp_path / "site"
    assert (site / "index.html").exists() and (site / "results" / "quickstart_curves.png").exists()
    assert "results/quickstart_curves.png" in (site / "index.html").read_text()
