"""`time_budget_min`: a run stops cleanly after the RL step that passed its wall-clock budget (a cluster job's
time limit; the distillation recipe's fixed budget, docs/opd.md), checkpointed, and the same command continues."""

from tests.train_runs import _metrics, _train


def test_a_time_budget_stops_cleanly_after_a_step_and_the_same_command_continues(tmp_path):
    """time_budget_min (the recipe's fixed wall-clock budget; a cluster job's time limit): the run stops after
    the RL step that passed it, saves that checkpoint, evaluates, and the same command resumes from it."""
    args = ["steps=5", "time_budget_min=0.0001", "eval.split=4", "save_every=null"]
    out = _train(tmp_path / "run", *args)
    assert "time_budget_min=0.0001 spent after RL step 1 of steps=5" in out.stdout
    m = _metrics(tmp_path / "run")
    assert [r["step"] for r in m if "reward_mean" in r] == [0] and [r["step"] for r in m if "eval/accuracy" in r] == [0, 1]
    assert (tmp_path / "run" / "checkpoints" / "1").is_dir()
    out = _train(tmp_path / "run", "steps=5", "eval.split=4", "save_every=null")      # no budget now: to the end
    assert "resumed" in out.stdout + out.stderr
    assert [r["step"] for r in _metrics(tmp_path / "run") if "reward_mean" in r] == [0, 1, 2, 3, 4]
