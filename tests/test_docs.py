"""Docs that cannot drift: the site builds with `mkdocs build --strict` (a broken link or anchor, or a page
missing from the nav, fails), every rendered table equals what scripts/docs.py renders from scripts/results/
now, every file in scripts/results/ is named by one script's `OUTPUTS`, and the README stays a front page (the
two commands first, at most 250 lines), and every rendered block's JSON says which machine and commit measured it
and is not much older than the code it measures."""

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
    record = {"provenance": {"machine": {"cpu": "Intel Xeon", "cores": 2}}, "machine": {"cpus": 2}}
    assert docs.machine(record) == "Intel Xeon, 2 cores"          # the harness's record first


# ------------------------------------------------------------------------- where and when each block measured

# Rendered blocks whose JSON records no machine (a CPU model) or no commit, each with what it lacks. These were
# measured before scripts/bench_harness.py recorded both; what could be recovered from git was added to the JSON
# (`provenance.commit_source`: where the commit comes from; no commit message names their machine). This list
# may only shrink: re-measuring a result (its script writes the record) makes its entry an error until removed,
# and an entry must have lacked the same at ALLOW_LISTS_AT (test_allow_lists_only_shrink). Cost to re-measure, on
# a 2-core CPU, in the comments.
LEGACY_UNRECORDED = {
    "bench_adaptive_tp.json": ("machine",),            # ~30-40 min (profiles TP 1/2/4/8, 58M trajectories)
    "bench_adaptive_tp_predictor.json": ("machine",),  # ~20 min
    "bench_blockwise.json": ("machine",),              # ~15 min (compiled memory at qwen3-0.6b + CPU times at 8K)
    "bench_code_rewards.json": ("machine",),           # ~5 min (sandboxed code rewards)
    "bench_flow.json": ("machine",),                   # ~3 min (bytes counted: no figure depends on the machine)
    "bench_logprobs.json": ("machine",),               # ~1 min (compiled temp bytes)
    "bench_logprobs_f32.json": ("machine",),           # ~1 min (compiled temp bytes)
    "bench_lora.json": ("machine",),                   # ~20 min
    "bench_pipeline.json": ("machine",),               # ~30 min (three 4-step trainer runs on 8 fake devices)
    "bench_sim_cluster.json": ("machine",),            # ~10 min (simulated: no figure depends on the machine)
    "bench_sim_validation.json": ("machine",),         # ~30 min (real engine against the simulator)
    "bench_tail_batching.json": ("machine",),          # ~30 min
}

# The modules each result measures: a block is stale once more than STALE_AFTER commits touched them since the
# commit its JSON records (`git rev-list --count <commit>..HEAD -- <paths>`). Every JSON a block reads is here.
STALE_AFTER = 30
_WHOLE = ("jaxrl", "models", "kernels", "sharding")                  # a whole training run
_ENGINE = ("jaxrl/rollout", "models", "kernels/paged_attention.py", "jaxrl/runtime.py")
_STEP = ("jaxrl/train/step.py", "jaxrl/train/optim.py", "jaxrl/train/batch.py", "jaxrl/config/train.py",
         "jaxrl/runtime.py", "models",
         "kernels/attention.py", "kernels/attention_bwd.py", "kernels/attention_common.py", "kernels/logprobs.py",
         "kernels/logprob_loss.py")
MEASURES = {
    **dict.fromkeys(("quickstart.json", "ppo_quickstart.json", "lora_quickstart.json", "multiturn.json",
                     "smollm2_arith.json", "bench_async.json", "bench_recipes.json", "pair_runs.json",
                     "bench_cold_start.json", "bench_cold_start_xeon.json", "bench_warm_start.json",
                     "bench_e2e.json", "bench_e2e_xeon.json", "bench_pipeline.json"), _WHOLE),
    "suite_time.json": (*_WHOLE, "tests"),
    **dict.fromkeys(("bench_rollout.json", "bench_rollout_xeon.json", "bench_multiturn.json", "bench_lpt.json",
                     "bench_adaptive_tp.json", "bench_adaptive_tp_predictor.json"), _ENGINE),
    "bench_tail_batching.json": (*_ENGINE, "jaxrl/train/rl.py", "jaxrl/rewards"),
    "bench_train.json": (*_STEP, "jaxrl/algos"),
    "bench_train_memory.json": _STEP,
    "bench_blockwise.json": (*_STEP, "jaxrl/train/blockwise.py", "jaxrl/train/history_attention.py",
                             "kernels/attention_pairs.py"),
    "bench_lora.json": (*_STEP, *_ENGINE, "sharding"),
    "bench_logprobs.json": ("kernels/logprobs.py", "kernels/logprob_loss.py"),
    "bench_logprobs_f32.json": ("kernels/logprobs.py", "kernels/logprob_loss.py"),
    "bench_flow.json": ("jaxrl/flow", "jaxrl/train/batch.py", "jaxrl/train/distributed.py", "jaxrl/train/balance.py"),
    "bench_code_rewards.json": ("jaxrl/rewards",),
    "bench_sim_cluster.json": ("jaxrl/sim",),
    "sim_fit.json": ("jaxrl/sim",),
    "bench_sim_validation.json": ("jaxrl/sim", "jaxrl/rollout", "models"),
    "composition.json": ("jaxrl/config",),
    "bench_opd.json": _WHOLE,
    "bench_real_e2e.json": _WHOLE,
    "bench_real_profile.json": (*_STEP, *_ENGINE),
}

# Rendered blocks older than STALE_AFTER commits to what they measure when this check was added (the count then
# in the comment). It may only shrink: a re-measured entry is an error until removed, and an entry must have been
# stale at ALLOW_LISTS_AT already (a result that goes stale later is re-measured, not listed).
LEGACY_STALE = {
    "bench_adaptive_tp.json",             # 55
    "bench_adaptive_tp_predictor.json",   # 45
    "bench_async.json",                   # 55
    "bench_blockwise.json",               # 50
    "bench_cold_start_xeon.json",         # 43
    "bench_e2e_xeon.json",                # 43
    "bench_lora.json",                    # 52
    "bench_pipeline.json",                # 130
    "bench_recipes.json",                 # 87
    "bench_sim_validation.json",          # 42
    "bench_train.json",                   # 34
    "bench_warm_start.json",              # 35
}
ALLOW_LISTS_AT = "de8f5b5957077ca9974e311d0f2e7bbd02b1c588"   # HEAD when the lists were written


def block_results() -> dict[str, set[str]]:
    """{JSON in docs.RESULTS: the rendered blocks that read it}, over every block the pages have: each renderer
    runs with `Path.read_text` recording the files it opens there."""
    read, original = set(), Path.read_text

    def recording(self, *a, **kw):
        if Path(self).resolve().parent == docs.RESULTS.resolve():
            read.add(Path(self).name)
        return original(self, *a, **kw)

    names = {m.group("name") for p in docs.pages() for m in docs.MARK.finditer(p.read_text())}
    out: dict[str, set[str]] = {}
    Path.read_text = recording
    try:
        for name in sorted(names):
            read.clear()
            docs.RENDERERS[name]()
            for f in read:
                out.setdefault(f, set()).add(name)
    finally:
        Path.read_text = original
    return out


def recorded_commit(d: dict) -> str | None:
    """The commit a result records: its provenance record's (the harness's, or one recovered from git), else
    its own `commit` (a sha, or {"sha", "dirty"} as `jaxrl.train.summary` writes it)."""
    c = (d.get("provenance") or {}).get("commit") or d.get("commit")
    return c.get("sha") if isinstance(c, dict) else c


def unrecorded(d: dict) -> tuple[str, ...]:
    """What a result lacks of its machine (a CPU model: not only an OS or architecture string) and commit."""
    m = docs.machine_record(d)
    cpu = m.get("cpu") if isinstance(m, dict) else None
    return tuple(k for k, ok in (("machine", cpu and cpu != "unknown"), ("commit", recorded_commit(d))) if not ok)


def test_every_rendered_block_records_its_machine_and_commit():
    blocks = block_results()
    lacking = {f: unrecorded(json.loads((docs.RESULTS / f).read_text())) for f in sorted(blocks)}
    lacking = {f: miss for f, miss in lacking.items() if miss}
    new = {f"{f} (blocks {sorted(blocks[f])})": miss for f, miss in lacking.items()
           if LEGACY_UNRECORDED.get(f) != miss}
    assert not new, ("rendered blocks whose JSON records no machine or commit (re-measure with the script, which "
                     f"writes scripts/bench_harness.py's record): {new}")
    gone = sorted(set(LEGACY_UNRECORDED) - set(lacking))
    assert not gone, f"LEGACY_UNRECORDED lists JSONs that record what they lacked, or no block reads: remove {gone}"


def _git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_no_rendered_block_is_much_older_than_the_code_it_measures():
    if _git("rev-parse", "--is-inside-work-tree").returncode:
        pytest.skip("not a git checkout: no history to date the results by")
    blocks = block_results()
    unmapped = sorted(set(blocks) - set(MEASURES))
    assert not unmapped, f"MEASURES names no modules for {unmapped} (read by blocks {[blocks[f] for f in unmapped]})"
    age, unknown = {}, []
    for f in sorted(blocks):
        sha = recorded_commit(json.loads((docs.RESULTS / f).read_text()))
        if sha is None:
            continue                           # (the test above: listed in LEGACY_UNRECORDED)
        r = _git("rev-list", "--count", f"{sha}..HEAD", "--", *MEASURES[f])
        if r.returncode:
            unknown.append(f"{f}: {sha} ({r.stderr.strip()})")
            continue
        age[f] = int(r.stdout)
    assert not unknown, f"results recording a commit this history lacks: {unknown}"
    stale = {f: f"{n} commits; blocks {sorted(blocks[f])}" for f, n in age.items()
             if n > STALE_AFTER and f not in LEGACY_STALE}
    assert not stale, (f"rendered blocks older than {STALE_AFTER} commits to the modules they measure "
                       f"(re-measure, then scripts/docs.py): {stale}")
    fresh = sorted(f for f in LEGACY_STALE if age.get(f, 0) <= STALE_AFTER)
    assert not fresh, f"LEGACY_STALE lists results re-measured since (or read by no block): remove {fresh}"


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


def test_allow_lists_only_shrink():
    """An entry of LEGACY_UNRECORDED lacked the same in its JSON at ALLOW_LISTS_AT, and one of LEGACY_STALE was
    over STALE_AFTER commits old then: neither list can take a result that loses its record or ages later."""
    if _git("cat-file", "-e", f"{ALLOW_LISTS_AT}^{{commit}}").returncode:
        pytest.skip(f"no git history with {ALLOW_LISTS_AT[:10]}: the lists cannot be checked against it")
    rel = docs.RESULTS.relative_to(ROOT).as_posix()
    added = []
    for f, missing in LEGACY_UNRECORDED.items():
        r = _git("show", f"{ALLOW_LISTS_AT}:{rel}/{f}")
        if r.returncode or not set(missing) <= set(unrecorded(json.loads(r.stdout))):
            added.append(f)
    assert not added, f"LEGACY_UNRECORDED entries whose JSON recorded that at {ALLOW_LISTS_AT[:10]}: {added}"
    for f in LEGACY_STALE:
        sha = recorded_commit(json.loads((docs.RESULTS / f).read_text())) if (docs.RESULTS / f).exists() else None
        r = _git("rev-list", "--count", f"{sha}..{ALLOW_LISTS_AT}", "--", *MEASURES.get(f, ("-",)))
        if not sha or f not in MEASURES or r.returncode or int(r.stdout) <= STALE_AFTER:
            added.append(f)
    assert not added, f"LEGACY_STALE entries not over {STALE_AFTER} commits old at {ALLOW_LISTS_AT[:10]}: {added}"
