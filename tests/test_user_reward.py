"""A user's own reward function in training: data field, rewards.fn, rewards.registry, the start-up check
(here and in a worker), user modules on PYTHONPATH / in the start directory, all-failed steps, and rewards that
take the row's prompt and columns by name (`jaxrl.rewards.calling`).

Pools have one worker (or none); the rollout is a fake service, so nothing compiles. Reward modules that
workers must import are written to tmp_path and reached through sys.path or PYTHONPATH.
"""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from jaxrl.config.train import TrainConfig
from jaxrl.data import PromptDataset
from jaxrl.rewards import (RewardPool, RewardScheduler, check_rewards, reward_columns, reward_item, reward_name,
                           reward_names)
from jaxrl.rollout import Completion
from jaxrl.train import rl

HERE = "tests.test_user_reward:"
T = "jaxrl.rewards._testing:"


def length_reward(response: str, answer: str, task: str) -> float:
    return float(len(response))


def answer_match(response: str, answer: str, task: str) -> float:
    return 10.0 if response == answer else 5.0


def _module(dirpath, body: str) -> str:
    """Write a uniquely named module into dirpath (nothing cached in sys.modules); returns its name."""
    name = f"user_reward_{uuid.uuid4().hex[:8]}"
    (dirpath / f"{name}.py").write_text(textwrap.dedent(body))
    return name


# ------------------------------------------------------------------------------------------- data
def test_dataset_keeps_reward_field_and_skips_bad_ones(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "a", "answer": "1", "reward": "my_rewards:score"},
        {"prompt": "b", "answer": "2"},
        {"prompt": "c", "answer": "3", "reward": None},            # null = absent
        {"prompt": "d", "answer": "4", "reward": 7},
        {"prompt": "e", "answer": "5", "reward": ""},
        {"prompt": "f", "answer": "6", "reward": ["x"]},
    ]) + "\n")
    ds = PromptDataset.from_jsonl(p)
    assert ds.rows == [{"prompt": "a", "answer": "1", "task": "math", "reward": "my_rewards:score"},
                       {"prompt": "b", "answer": "2", "task": "math"},
                       {"prompt": "c", "answer": "3", "task": "math"}]
    assert ds.skipped == 3 and "line 4" in ds.skipped_example and "'reward' is int" in ds.skipped_example


def test_parquet_reward_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["x", "y"], "answer": ["1", "2"], "reward": ["mine", None]}), path)
    assert PromptDataset.from_parquet(path).rows == [{"prompt": "x", "answer": "1", "task": "math", "reward": "mine"},
                                                     {"prompt": "y", "answer": "2", "task": "math"}]
    pq.write_table(pa.table({"prompt": ["x", "y"], "answer": ["1", "2"], "reward": [1, 2]}), path)
    with pytest.raises(ValueError, match="'reward' is int"):
        PromptDataset.from_parquet(path)


def test_builtin_rows_have_no_reward_field():
    assert all("reward" not in row for row in PromptDataset.builtin(["copy", "add"], 8, seed=0))


# ------------------------------------------------------------------------------------------- names
def test_reward_name_order_and_registry():
    math_row, copy_row = {"task": "math"}, {"task": "copy"}
    own = {"task": "math", "reward": "mine"}
    assert reward_name(math_row) == "math" and reward_name(copy_row) == "builtin"
    assert reward_name(copy_row, "pkg.mod:fn") == "pkg.mod:fn"
    assert reward_name(own, "pkg.mod:fn") == "mine"
    registry = {"mine": "my_rewards:score", "math": "better:math"}
    assert reward_name(own, "pkg.mod:fn", registry) == "my_rewards:score"
    assert reward_name(math_row, None, registry) == "better:math"
    assert reward_name(copy_row, "mine", registry) == "my_rewards:score"
    assert reward_names([math_row, copy_row, own], None, registry) == {"better:math", "builtin", "my_rewards:score"}


# ------------------------------------------------------------------------------------------- rollout
class FakeService:
    """Stands in for RolloutService: each sample's response is its request id as text."""

    def __init__(self):
        self.requests = []
        self.done = False

    def add(self, ids, params):
        start = len(self.requests)
        self.requests += [ids] * params.n
        return list(range(start, len(self.requests)))

    def has_work(self):
        return not self.done

    def step(self):
        """Everything finishes in one engine step, in an order that differs from submission order."""
        self.done = True
        return [Completion(rid, self.requests[rid], [ord("a") + rid % 26] * (rid + 1), [], "stop", 0)
                for rid in reversed(range(len(self.requests)))]


class FakeTokenizer:
    def decode(self, tokens):
        return "".join(map(chr, tokens))


def _rollout(rows, fn=None, registry=None, workers=0):
    base = TrainConfig()
    cfg = dataclasses.replace(base, algo=dataclasses.replace(base.algo, group_size=2),
                              rewards=dataclasses.replace(base.rewards, fn=fn, registry=registry or {}))
    rows = [{"index": i, "answer": "a", "task": "copy", **row} for i, row in enumerate(rows)]
    with RewardPool(num_workers=workers, timeout_s=10.0) as pool:
        _, rewards, stats = rl.rollout_and_score(FakeService(), pool, FakeTokenizer(), cfg, [[1]] * len(rows),
                                                 rows, 0, [0])
    return rewards.tolist(), stats


def test_rollout_scores_each_row_by_its_reward():
    rewards, stats = _rollout([{"reward": HERE + "length_reward"}, {}, {"reward": HERE + "answer_match"}])
    # responses: "a", "bb" | "ccc", "dddd" | "eeeee", "ffffff"; row 1 falls back to "builtin" (copy of "a")
    assert rewards[:2] == [1.0, 2.0] and rewards[4:] == [5.0, 5.0]
    assert stats["items"] == 6 and stats["crashes"] == stats["timeouts"] == 0 and stats["first_error"] == ""


def test_rollout_uses_rewards_fn_and_registry():
    rewards, _ = _rollout([{}, {"reward": "match"}], fn=HERE + "length_reward",
                          registry={"match": HERE + "answer_match"})
    assert rewards == [1.0, 2.0, 5.0, 5.0]
    rewards, _ = _rollout([{}, {}], fn="short", registry={"short": HERE + "length_reward"})
    assert rewards == [1.0, 2.0, 3.0, 4.0]


def test_rollout_stats_name_the_first_failure():
    rewards, stats = _rollout([{"reward": T + "raise_error"}, {"reward": HERE + "length_reward"}])
    assert rewards == [0.0, 0.0, 3.0, 4.0]
    assert stats["items"] == 4 and stats["crashes"] == 2
    assert stats["first_error"] == f"crash in {T}raise_error: RuntimeError: deliberate failure in a reward fn"


# ------------------------------------------------------------------------------------------- start-up check
@pytest.mark.parametrize("name, cause", [
    ("no_such_module_xyz:score", "reward 'no_such_module_xyz:score': cannot import module 'no_such_module_xyz' "
                                 "(ModuleNotFoundError: No module named 'no_such_module_xyz'); the module must be "
                                 "importable in a fresh interpreter"),
    (HERE + "length_rewrad", f"reward '{HERE}length_rewrad': module 'tests.test_user_reward' has no function "
                             "'length_rewrad' (did you mean 'length_reward'?)"),
    ("foo", "unknown reward 'foo'; registered: builtin, code, math (or a name in rewards.registry, or a "
            "'package.module:function' import path)"),
    (HERE + "HERE", f"reward '{HERE}HERE': tests.test_user_reward.HERE is a str, not a function"),
])
def test_check_rewards_one_line_error(name, cause):
    with RewardPool(num_workers=0) as pool:
        with pytest.raises(ValueError) as e:
            check_rewards(["math", HERE + "length_reward", name], pool)
        check_rewards(["math", "builtin", HERE + "length_reward"], pool)   # all fine: returns None
    assert str(e.value).startswith(cause) and "\n" not in str(e.value)


def test_check_rewards_module_raising_on_import(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = _module(tmp_path, """
        x = 1 / 0
    """)
    with pytest.raises(ValueError, match=rf"^reward '{mod}:score': cannot import module '{mod}' "
                                         r"\(ZeroDivisionError: division by zero\)$"):
        check_rewards([f"{mod}:score"], RewardPool(num_workers=0))


def test_check_rewards_in_a_worker(tmp_path, monkeypatch):
    """A module that imports in the trainer but not in the workers' processes is caught by the worker check."""
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = _module(tmp_path, """
        import multiprocessing

        if multiprocessing.parent_process() is not None:
            raise RuntimeError("needs the trainer's state")

        def score(response, answer, task):
            return 1.0
    """)
    pool = RewardPool(num_workers=1, timeout_s=5.0)
    assert pool.check(["math", T + "raise_error"]) == {}
    assert pool.check([f"{mod}:score", "nope"]).keys() == {f"{mod}:score", "nope"}
    with pytest.raises(ValueError) as e:
        check_rewards(["math", f"{mod}:score"], pool)
    msg = str(e.value)
    assert msg.startswith(f"reward '{mod}:score': cannot import module '{mod}' (RuntimeError: needs the "
                          "trainer's state)") and "in a reward worker process" in msg and "\n" not in msg
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.check(["math"])


def test_workers_see_a_path_added_after_the_fork_server_started(tmp_path, monkeypatch):
    """The fork server keeps the sys.path it started with; workers get the parent's current one."""
    with RewardPool(num_workers=1, timeout_s=5.0) as pool:   # the fork server runs from here on
        pool.score([("math", "\\boxed{1}", "1", "math")])
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = _module(tmp_path, """
        def score(response, answer, task):
            return 0.25 * len(response)
    """)
    with RewardPool(num_workers=1, timeout_s=5.0) as pool:
        check_rewards([f"{mod}:score"], pool)
        scores, stats = pool.score([(f"{mod}:score", "abcd", "", "")])
    assert scores.tolist() == [1.0] and stats["crashes"] == 0


def test_user_module_on_pythonpath_and_in_start_directory(tmp_path):
    """`python -m run` started in a directory holding one reward module, with another on PYTHONPATH:
    both are checked and scored by real workers, with the fork server and with spawn."""
    pp, cwd = tmp_path / "pp", tmp_path / "cwd"
    pp.mkdir()
    cwd.mkdir()
    (pp / "my_rewards.py").write_text("def score(response, answer, task):\n    return float(response == answer)\n")
    (cwd / "cwd_rewards.py").write_text("def score(response, answer, task):\n    return 0.5\n")
    (cwd / "run_rewards.py").write_text(textwrap.dedent("""
        import json

        from jaxrl.rewards import RewardPool, check_rewards

        if __name__ == "__main__":
            names = ["my_rewards:score", "cwd_rewards:score"]
            out = {}
            for method in ("forkserver", "spawn"):
                with RewardPool(num_workers=1, timeout_s=30.0, start_method=method) as pool:
                    check_rewards(names, pool)
                    scores, stats = pool.score([(n, "42", "42", "t") for n in names])
                out[method] = scores.tolist() + [stats["crashes"]]
            print(json.dumps(out))
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pp)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    proc = subprocess.run([sys.executable, "-m", "run_rewards"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"forkserver": [1.0, 0.5, 0], "spawn": [1.0, 0.5, 0]}


# ------------------------------------------------------------------------------------------- all-failed steps
def _stats(items, failed, first=""):
    return dict(items=items, timeouts=0, crashes=failed, first_error=first, seconds=0.0)


def test_failure_guard_raises_after_n_steps_in_a_row_and_resets():
    guard = rl.RewardFailureGuard(3)
    guard.update(_stats(4, 4, "crash in m:f: ZeroDivisionError: division by zero"))
    guard.update(_stats(4, 4, "crash in m:f: second"))
    guard.update(_stats(4, 3))            # one success: the count starts over
    guard.update(_stats(0, 0))            # no rewards at all: neither counts nor resets
    guard.update(_stats(4, 4, "timeout in m:f: timed out after 5s"))
    guard.update(_stats(0, 0))
    guard.update(_stats(4, 4, "crash in m:f: later"))
    with pytest.raises(RuntimeError) as e:
        guard.update(dict(_stats(4, 0), timeouts=4, first_error="timeout in m:f: again"))
    assert str(e.value) == ("every reward failed in 3 steps in a row (first: timeout in m:f: timed out after 5s); "
                            "fix the reward function or raise rewards.max_failed_steps")
    with pytest.raises(ValueError):
        rl.RewardFailureGuard(0)


def test_failure_guard_on_rollout_stats():
    guard = rl.RewardFailureGuard(2)
    _, stats = _rollout([{"reward": T + "raise_error"}])
    guard.update(stats)
    with pytest.raises(RuntimeError, match=rf"^every reward failed in 2 steps in a row \(first: crash in {T}"
                                           r"raise_error: RuntimeError: deliberate failure in a reward fn\); "):
        guard.update(stats)
    one = rl.RewardFailureGuard(1)
    with pytest.raises(RuntimeError, match="failed in 1 step in a row"):
        one.update(stats)


# ------------------------------------------------------------------------------------------- row-aware rewards
ROW = {"prompt": "P?", "answer": "A", "task": "t", "difficulty": 3, "meta": {"k": [1]}, "index": 7, "reward": "x"}


def test_reward_item_passes_only_what_the_signature_names():
    """Decided from the signature: old-style gets nothing, named parameters their values, `**row` every row value
    but the three positional ones (never the loader's index or the reward name), TRL's form `prompts` and the rest."""
    assert reward_item(T + "old_style", "r", ROW) == (T + "old_style", "r", "A", "t", None)
    assert reward_item("math", "r", ROW).extra is None and reward_item("code", "r", ROW).extra is None
    assert reward_item(T + "rowwise", "r", ROW).extra == {"prompt": "P?", "difficulty": 3}
    assert reward_item(T + "takes_all", "r", ROW).extra == {"prompt": "P?", "difficulty": 3, "meta": {"k": [1]}}
    assert reward_item(T + "trl_style", "r", ROW).extra == {"prompts": "P?", "answer": "A", "task": "t",
                                                            "difficulty": 3, "meta": {"k": [1]}}
    # a name that does not resolve here goes out without extras (the pool scores it as a crash; check_rewards
    # refuses it at start-up): what a simulator's stand-in pool, which never resolves names, relies on
    assert reward_item("nope", "r", ROW) == ("nope", "r", "A", "t", None)


def _results(pool, items):
    ids = [pool.submit(it) for it in items]
    got = {}
    while len(got) < len(ids):
        got.update((r.id, r) for r in pool.poll(timeout=5.0))
    return [got[i] for i in ids]


def test_row_aware_rewards_in_a_worker_process():
    """Through a real worker process: each function gets exactly what it names; TRL's form scores one completion;
    the trainer's two submit sites (streamed, and the whole batch after the rollout) send the row's values."""
    rows = [{k: v for k, v in dict(ROW, index=i, difficulty=d).items() if k != "reward"} for i, d in ((0, 3), (1, 5))]
    with RewardPool(num_workers=1, timeout_s=10.0) as pool:
        old, row, every, trl = _results(pool, [reward_item(T + f, "resp", ROW) for f in
                                               ("old_style", "rowwise", "takes_all", "trl_style")])
        assert [r.status for r in (old, row, every, trl)] == ["ok"] * 4, [r.error for r in (old, row, every, trl)]
        assert old.info == {"args": ["resp", "A", "t"]}
        assert (row.score, row.info) == (3.0, {"response": "resp", "answer": "A", "prompt": "P?"})
        assert every.info == {"row": {"prompt": "P?", "difficulty": 3, "meta": {"k": [1]}}}
        assert trl.score == 34.0
        base = TrainConfig()
        cfg = dataclasses.replace(base, algo=dataclasses.replace(base.algo, group_size=2),
                                  rewards=dataclasses.replace(base.rewards, fn=T + "trl_style"))
        _, streamed, stats = rl.rollout_and_score(FakeService(), pool, FakeTokenizer(), cfg, [[1]] * 2, rows, 0, [0])
        # responses by request id: "a", "bb" | "ccc", "dddd" -> 10 x difficulty + length
        assert streamed.tolist() == [31.0, 32.0, 53.0, 54.0] and stats["crashes"] == 0, stats["first_error"]
        comps = [Completion(k, [1], [ord("a")] * (k + 1), [], "stop", 0) for k in range(4)]
        batch, _ = rl.score_batch(RewardScheduler(pool), FakeTokenizer(), cfg, rows, comps, 2)
        assert batch.tolist() == streamed.tolist()
        # the start-up check's worker side checks signatures too (test_check_rewards_refuses_a_signature_no_row_fits)
        assert pool.check({T + "rowwise": ("answer", "prompt", "task"), T + "takes_all": ("answer",),
                           "math": None}).keys() == {T + "rowwise"}


class _Capture:
    """Stands in for a RewardPool: keeps what the scheduler submits."""

    def __init__(self):
        self.items = []

    def submit(self, item, timeout_s=None):
        self.items.append(item)
        return len(self.items)


def test_code_rewards_scheduler_keywords_merge_with_the_row_values():
    tests = json.dumps({"tests": [{"stdin": "1\n", "stdout": "1\n"}]})
    pool = _Capture()
    sched = RewardScheduler(pool, code_fns=(T + "takes_all",))
    sched.submit("k", reward_item(T + "takes_all", "print(1)", dict(ROW, answer=tests)))
    extra = pool.items[0].extra
    assert {"prompt", "difficulty", "meta", "timeouts", "details", "limits"} == set(extra) and extra["difficulty"] == 3


def test_check_rewards_refuses_a_signature_no_row_fits():
    """One line naming the function, its signature and the parameter; the columns are those every row scored by
    the function has; names alone are checked against the built-in rows' columns; a worker checks the same."""
    rows = [dict(ROW, reward=T + "rowwise"), {"prompt": "q", "answer": "b", "task": "t", "reward": T + "rowwise"},
            {"prompt": "q", "answer": "b", "task": "t"}]
    cols = reward_columns(rows, T + "old_style")
    assert cols == {T + "rowwise": {"prompt", "answer", "task"}, T + "old_style": {"prompt", "answer", "task"}}
    assert reward_names(rows, T + "old_style", columns=True) == cols
    with RewardPool(num_workers=0) as pool:
        with pytest.raises(ValueError) as e:
            check_rewards(cols, pool)
        check_rewards(reward_columns(rows[:1], None), pool)        # every row has the column: fine
        check_rewards([T + "takes_all", T + "trl_style", "math", "code", "builtin"], pool)
        with pytest.raises(ValueError, match=rf"^reward '{T}no_positional': no_positional\(\*, prompt\) takes "
                                             "no positional parameter"):
            check_rewards([T + "no_positional"], pool)
        with pytest.raises(ValueError, match="requires parameter 'difficulty'"):
            check_rewards([T + "rowwise"], pool)
    msg = str(e.value)
    assert msg.startswith(f"reward '{T}rowwise': rowwise(response, answer, *, prompt, difficulty) "
                          "requires parameter 'difficulty', which not every row provides (rows have: answer, prompt, "
                          "task; ") and "\n" not in msg
