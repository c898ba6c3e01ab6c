"""scripts/quickstart_results.py with `--from` (no training run: each run directory is a metrics.jsonl plus the
summary `write_summary` makes of it, as in tests/test_docs.py): every file lands under its scripts/results/
name with the run's content, ppo_quickstart.json is the summary plus the critic's explained variance over the
summary's own windows, a run of other overrides or an unfinished run is refused, and the PPO table renders
from what the script writes."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from jaxrl.train.summary import write_summary

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


qr = _load("quickstart_results", ROOT / "scripts" / "quickstart_results.py")
docs = _load("jaxrl_docs_render_qr", ROOT / "scripts" / "docs.py")


def _run(tmp_path: Path, name: str, argv: list[str], steps: int = 10) -> Path:
    """A finished run's directory: metrics.jsonl (`steps` RL steps, step -1 a warm-start row without rewards),
    summary.json from it, curves.png and length_pairs.jsonl."""
    run = tmp_path / "runs" / name
    run.mkdir(parents=True)
    rows = [{"step": -1, "sft_loss": 1.0}] + [
        {"step": i, "reward_mean": 0.1 * i, "pass_rate": 0.01 * i, "step_seconds": 0.5 + i, "rollout_s": 0.1,
         "train_s": 0.3, "response_len_mean": 5.0, "response_len_max": 9, "compiles": 0,
         "critic/explained_var": 0.1 * i, "env/tool_success": 0.05 * i, "env/tool_calls": 100 + i,
         "env/format_errors": 10 - i, "env/turns_mean": 1.5} for i in range(steps)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_summary(run, 125.0, argv=argv)
    (run / "curves.png").write_bytes(b"\x89PNG\r\n\x1a\n" + name.encode())
    (run / "length_pairs.jsonl").write_text("".join(json.dumps({"tokens": [1, 2, i], "length": i}) + "\n"
                                                    for i in range(3)))
    return run


def test_outputs_are_the_runs_files():
    assert set(qr.OUTPUTS) == {dst for _, _, files in qr.RUNS.values() for dst in files.values()}


def test_from_copies_each_run(tmp_path, monkeypatch):
    out = tmp_path / "results"
    quick = _run(tmp_path, "quickstart", [])
    written = qr.main(["quickstart", "--from", str(quick), "--out-dir", str(out)])
    assert sorted(p.name for p in written) == ["quickstart.json", "quickstart_curves.png"]
    assert (out / "quickstart.json").read_text() == (quick / "summary.json").read_text()      # the summary as is
    assert (out / "quickstart_curves.png").read_bytes() == (quick / "curves.png").read_bytes()

    ppo = _run(tmp_path, "ppo", ["algo.advantage=gae", f"run_dir={tmp_path / 'runs' / 'ppo'}"])
    qr.main(["ppo", "--from", str(ppo), "--out-dir", str(out)])
    got, summary = json.loads((out / "ppo_quickstart.json").read_text()), json.loads((ppo / "summary.json").read_text())
    assert {k: v for k, v in got.items() if not k.startswith("critic_")} == summary
    assert summary["window_steps"] == 2 and summary["steps"] == 10
    assert got["critic_explained_var_first"] == pytest.approx((0.0 + 0.1) / 2)     # RL steps 0, 1 (not the warm start)
    assert got["critic_explained_var_last"] == pytest.approx((0.8 + 0.9) / 2)      # RL steps 8, 9
    assert (out / "ppo_quickstart_curves.png").read_bytes() == (ppo / "curves.png").read_bytes()

    lora = _run(tmp_path, "lora", ["model.lora.rank=8", "optim.lr=0.002"])
    qr.main(["lora", "--from", str(lora), "--out-dir", str(out)])
    assert (out / "lora_quickstart.json").read_text() == (lora / "summary.json").read_text()
    assert (out / "lora_quickstart_curves.png").read_bytes() == (lora / "curves.png").read_bytes()

    pairs = _run(tmp_path, "pairs", ["rollout.skew.enabled=true", "steps=40", "warm_start.steps=400"])
    qr.main(["length-pairs", "--from", str(pairs), "--out-dir", str(out)])
    assert (out / "quickstart_length_pairs.jsonl").read_bytes() == (pairs / "length_pairs.jsonl").read_bytes()

    turns = _run(tmp_path, "turns", ["--config", "configs/multiturn.yaml"])
    qr.main(["multiturn", "--from", str(turns), "--out-dir", str(out)])
    got = json.loads((out / "multiturn.json").read_text())
    assert {k: v for k, v in got.items() if not k.startswith("env/")} == json.loads((turns / "summary.json").read_text())
    assert got["env/tool_success_first"] == pytest.approx(0.025) and got["env/tool_calls_last"] == pytest.approx(108.5)
    assert (out / "multiturn_curves.png").read_bytes() == (turns / "curves.png").read_bytes()

    smol = tmp_path / "runs" / "smollm2"         # the real-model recipe: its evaluations and their completions
    smol.mkdir(parents=True)
    evals = [{"step": s, "eval/accuracy": a, "eval/prompts": 2, "eval/len_mean": 9.0} for s, a in ((0, 0.5), (2, 1.0))]
    rows = [{"step": i, "reward_mean": 0.1 * i, "step_seconds": 1.0, "rollout_s": 0.4, "train_s": 0.6,
             "response_len_mean": 5.0, "response_len_max": 9, "compiles": 0} for i in range(2)]
    rows = [{**rows[0], **evals[0]}, rows[1], evals[1]]      # before step 0; after the last (a row of its own)
    (smol / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (smol / "evals").mkdir()
    for step, answers in ((0, ["3", "x"]), (2, ["3", "4"])):
        (smol / "evals" / f"step{step}.jsonl").write_text("".join(json.dumps(
            {"index": i, "sample": 0, "prompt": f"What is {i} + 3?", "answer": str(i + 3), "completion": c,
             "reward": float(c == str(i + 3))}) + "\n" for i, c in enumerate(answers)))
    write_summary(smol, 60.0, argv=["--config", "configs/smollm2_arith.yaml"])
    (smol / "curves.png").write_bytes(b"\x89PNG\r\n\x1a\nsmollm2")
    qr.main(["smollm2", "--from", str(smol), "--out-dir", str(out)])
    got = json.loads((out / "smollm2_arith.json").read_text())
    assert [e["eval/accuracy"] for e in got["evals"]] == [0.5, 1.0]
    assert [(x["before"], x["after"], x["reward_after"]) for x in got["examples"]] == [("3", "3", 1.0), ("x", "4", 1.0)]
    assert sorted(p.name for p in out.iterdir()) == sorted(qr.OUTPUTS)
    monkeypatch.setattr(docs, "RESULTS", out)
    assert "**0.50 → 1.00** (+0.50)" in docs.RENDERERS["smollm2-recipe"]()
    monkeypatch.setattr(docs, "RESULTS", out)                  # the multi-turn table from what the script wrote
    assert "| tool success (calls that ran, of all calls), first 20% → last 20% | 0.03 → 0.43 |" in \
        docs.RENDERERS["multiturn-run"]()

    monkeypatch.setattr(docs, "RESULTS", out)                  # the PPO table from what the script wrote
    text = docs.RENDERERS["ppo-quickstart"]()
    assert "| critic explained variance, first 20% → last 20% | 0.05 → 0.85 | – (no critic) |" in text
    assert "| mean reward, first 20% → last 20% | 0.050 → 0.850 | 0.050 → 0.850 |" in text
    assert "`python -m jaxrl.train algo.advantage=gae run_dir=" in text and "Machine: PPO: " in text


def test_refuses_another_run(tmp_path):
    out = tmp_path / "results"
    tiny = _run(tmp_path, "tiny", ["steps=2", "algo.advantage=gae"])
    with pytest.raises(SystemExit, match="overrides"):
        qr.main(["ppo", "--from", str(tiny), "--out-dir", str(out)])
    with pytest.raises(SystemExit, match="overrides"):
        qr.main(["quickstart", "--from", str(tiny), "--out-dir", str(out)])
    (tiny / "summary.json").unlink()
    with pytest.raises(SystemExit, match="did not finish"):
        qr.main(["ppo", "--from", str(tiny), "--out-dir", str(out)])
    with pytest.raises(SystemExit):
        qr.main(["--from", str(tiny), "--out-dir", str(out)])                  # --from needs one run named
    assert not out.exists()


def test_recorded_overrides_drop_the_run_dir():
    assert qr.recorded_overrides({"command": "python -m jaxrl.train"}) == ()
    assert qr.recorded_overrides({"command": "python -m jaxrl.train --run-dir runs/x algo.advantage=gae "
                                             "run_dir=runs/y"}) == ("algo.advantage=gae",)
    with pytest.raises(SystemExit, match="not a"):
        qr.recorded_overrides({"command": "python other.py"})
