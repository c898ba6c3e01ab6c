"""A new user's path through `python -m jaxrl.train`: their own HF checkpoint, JSONL data and reward
function; start-up errors as one line before the run directory exists; resume against a changed config;
a run that dies before its first RL step; the bundled 0.6B recipe at a tiny size (bfloat16).

The full runs are real processes (like the kill/resume runs of tests/test_train_resume.py); the start-up
errors call `main()` in this process, since they stop before JAX is asked for devices.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.train.__main__ import main as train_main

from .hf_util import write_bpe_tokenizer, write_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["algo.prompts_per_step=4", "algo.group_size=2", "rollout.max_new_tokens=8", "engine.max_batch=16",
         "engine.max_seq_len=128", "data.max_prompt_len=96", "rewards.num_workers=1", "save_every=1",
         "trainer.warmup=false"]   # short runs: compiling every bucket up front would dominate them

REWARDS = '''
def quarter(response, answer, *, prompt, level):     # the row's prompt and its own "level" column, by name
    return 0.25 if prompt.startswith("what is") and level == len(answer) else 0.0


def half(response, answer, task):
    return 0.5


def broken(response, answer, task):
    return 1 / 0
'''


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """What a user brings: an HF checkpoint directory, a JSONL file, a module with reward functions."""
    d = tmp_path_factory.mktemp("user")
    write_tiny_checkpoint(d / "model")
    rows = [{"prompt": f"what is {a} + {b}?", "answer": str(a + b), "task": "sum", "reward": "my_rewards:quarter",
             "level": len(str(a + b))} for a in range(6) for b in range(4)]
    (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "math.jsonl").write_text("".join(json.dumps({"problem": r["prompt"], "answer": r["answer"]}) + "\n"
                                          for r in rows))
    (d / "rewards").mkdir()
    (d / "rewards" / "my_rewards.py").write_text(REWARDS)
    return d


def _run(user, run_dir, *args, check=True):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{user / 'rewards'}{os.pathsep}{ROOT}")
    cmd = [sys.executable, "-m", "jaxrl.train", f"run_dir={run_dir}", f"model.hf_path={user / 'model'}", *SMALL, *args]
    p = subprocess.run(cmd, cwd=user, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _startup_error(capsys, *argv) -> str:
    """`main(argv)` must stop with exit 2 and one line on stderr; returns that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_main(list(argv))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and err.startswith("python -m jaxrl.train: error: "), err
    return err


def test_startup_errors_are_one_line_and_create_nothing(tmp_path, user, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    err = _startup_error(capsys, f"run_dir={run_dir}", "model.hf_path=missing_model")
    assert f"model.hf_path={tmp_path / 'missing_model'}: no such directory" in err   # absolute path
    err = _startup_error(capsys, f"run_dir={run_dir}", "data.source=nope.jsonl")
    assert f"data.source={tmp_path / 'nope.jsonl'}: no such file" in err
    for bad in ("--profile-steps=5:x", "--profile-steps="):
        assert "--profile-steps expects START:STOP" in _startup_error(capsys, f"run_dir={run_dir}", bad)
    err = _startup_error(capsys, f"run_dir={run_dir}", f"model.hf_path={user / 'model'}", "data.tokenizer=char")
    assert "does not match the tokenizer of model.hf_path" in err
    bare = tmp_path / "bare"                                       # a checkpoint without tokenizer files
    bare.mkdir()
    (bare / "config.json").write_text((user / "model" / "config.json").read_text())
    assert "has no tokenizer.json" in _startup_error(capsys, f"run_dir={run_dir}", f"model.hf_path={bare}")
    other = write_bpe_tokenizer(tmp_path / "other_tok", vocab_size=290)   # explicit tokenizer, other vocabulary
    assert "does not match" in _startup_error(capsys, f"run_dir={run_dir}", f"model.hf_path={user / 'model'}",
                                              f"data.tokenizer={other}")
    assert "engine.max_seq_len" in _startup_error(capsys, f"run_dir={run_dir}", "engine.max_seq_len=100")
    monkeypatch.setenv("JAXRL_EXECUTABLE_STORE_MAX_GB", "lots")        # read at the first compile: checked first
    assert "JAXRL_EXECUTABLE_STORE_MAX_GB='lots'" in _startup_error(capsys, f"run_dir={run_dir}")
    assert not run_dir.exists()


def test_bad_reward_name_stops_before_anything_compiles(tmp_path, user, capsys):
    run_dir = tmp_path / "run"
    err = _startup_error(capsys, f"run_dir={run_dir}", f"model.hf_path={user / 'model'}",
                         f"data.source={user / 'math.jsonl'}", "data.prompt_key=problem", "rewards.num_workers=1",
                         "rewards.fn=no_such_module:f")
    assert "no_such_module" in err
    assert not run_dir.exists()
    common = [f"run_dir={run_dir}", f"model.hf_path={user / 'model'}", f"data.source={user / 'math.jsonl'}",
              "data.prompt_key=problem", "rewards.num_workers=1"]
    err = _startup_error(capsys, *common, "rewards.fn=jaxrl.rewards._testing:rowwise")   # a column no row has
    assert ("reward 'jaxrl.rewards._testing:rowwise': rowwise(response, answer, *, prompt, difficulty) requires "
            "parameter 'difficulty', which not every row provides (rows have: answer, prompt, task;") in err
    err = _startup_error(capsys, *common, "rollout.env=jaxrl.envs._testing:ResetWithoutRow")   # before the warm-up
    assert err.endswith("rollout.env: environment 'jaxrl.envs._testing:ResetWithoutRow': ResetWithoutRow.reset() "
                        "cannot be called as reset(self, row)"), err
    assert not run_dir.exists()
    bad = tmp_path / "empty_answers.jsonl"            # rows, but none usable: one line naming the file and row
    bad.write_text(json.dumps({"prompt": "what is 1 + 1?", "answer": ""}) + "\n")
    err = _startup_error(capsys, f"run_dir={run_dir}", f"data.source={bad}")
    assert err.count("data.source: ") == 1 and "'answer' is empty" in err and f"{bad}:line 1" in err
    assert not run_dir.exists()


def test_own_model_data_and_reward_then_resume_against_another_config(tmp_path, user):
    run_dir = tmp_path / "run"
    data = f"data.source={user / 'data.jsonl'}"

    # 1. A reward that always raises: the first RL step fails; nothing is left that a retry would resume.
    p = _run(user, run_dir, data, "steps=2", "rewards.fn=my_rewards:broken", "data.source=math.jsonl",
             "data.prompt_key=problem", "rewards.max_failed_steps=1", check=False)
    assert p.returncode != 0
    assert "every reward failed" in p.stderr and "ZeroDivisionError" in p.stderr, p.stderr[-2000:]
    assert not (run_dir / "checkpoints" / "0").exists() and not (run_dir / "config.yaml").exists()

    # 2. The quickstart's defaults (warm start on the built-in tasks included) with the user's own model,
    #    data and per-row reward; the tokenizer is the model's (no data.tokenizer given).
    p = _run(user, run_dir, data, "steps=2", "rewards.fn=my_rewards:half")
    assert "resumed" not in p.stdout + p.stderr                   # the failed run left nothing behind
    assert "warm start skipped" in p.stdout and "'sum'" in p.stdout
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["reward_mean"] == 0.25 for r in rows)  # the row's "reward" wins over rewards.fn; it got prompt, level
    assert (run_dir / "hf" / "tokenizer.json").read_text() == (user / "model" / "tokenizer.json").read_text()
    assert (run_dir / "curves.png").stat().st_size > 0
    assert f"outputs in {run_dir}" in p.stdout and f"tensorboard --logdir {run_dir / 'tb'}" in p.stdout
    saved = (run_dir / "config.yaml").read_text()

    # 3. Same directory, another learning rate: stop, name the key, touch nothing.
    p = _run(user, run_dir, data, "steps=3", "rewards.fn=my_rewards:half", "optim.lr=3e-4", check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "optim.lr (0.0005 -> 0.0003)" in p.stderr and "--resume=force" in p.stderr
    assert (run_dir / "config.yaml").read_text() == saved and [r["step"] for r in _rows(run_dir)] == [0, 1]

    # 4. --resume=force continues with the new value; the summary and TensorBoard cover the whole run.
    p = _run(user, run_dir, data, "steps=3", "rewards.fn=my_rewards:half", "optim.lr=3e-4", "--resume=force")
    assert "resumed" in p.stdout + p.stderr
    assert (run_dir / "config.yaml").read_text() == saved
    assert "lr: 0.0003" in (run_dir / "config.step2.yaml").read_text()
    assert [r["step"] for r in _rows(run_dir)] == [0, 1, 2]
    assert "(steps 0-2)" in p.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Tensors("reward_mean")] == [0, 1, 2]


def test_bundled_recipe_runs_at_a_tiny_size(tmp_path, user):
    """configs/grpo_qwen3_0.6b_math.yaml (bfloat16, math data, math verifier), its sizes shrunk."""
    run_dir = tmp_path / "run"
    p = _run(user, run_dir, "--config", str(ROOT / "configs" / "grpo_qwen3_0.6b_math.yaml"),
             f"data.source={user / 'math.jsonl'}", "steps=1", "train_layout.fsdp=2", "engine.instances=2",
             "algo.micro_batches=1", "pack_len=null", "engine.max_batch=16")
    rows = _rows(run_dir)
    assert len(rows) == 1 and rows[0]["skipped"] == 0
    cfg = (run_dir / "config.yaml").read_text()
    assert "dtype: bfloat16" in cfg and "prompt_key: problem" in cfg
    assert json.loads((run_dir / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
