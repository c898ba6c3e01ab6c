"""Multi-turn environments (jaxrl.envs): tool-call parsing, the calculator, `ToolEnv`, and the runner that steps
environments in reward worker processes, against hostile tools and environments: one that raises, hangs, prints
megabytes, returns something that is not text, kills its worker or returns something that is not a Step always
gives a bounded observation within its timeout, and the trajectory keeps its state from before the step."""

import json
import pickle
import time

import pytest

from jaxrl.envs import (EnvLimits, EnvRunner, Environment, FormatError, GymEnv, Step, ToolEnv, calculator,
                        env_factory, make_env, parse_tool_calls, render_responses, truncate)
from jaxrl.envs import _testing
from jaxrl.rewards import RewardPool

T = "jaxrl.envs._testing:"


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_parse_tool_calls():
    text = "I will compute. " + call("calculator", expression="2+3") + " and " + call("python", code="print(1)")
    assert parse_tool_calls(text) == [("calculator", {"expression": "2+3"}), ("python", {"code": "print(1)"})]
    assert parse_tool_calls("no calls here") == []
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>') == [("f", {})]
    for bad, why in [("<tool_call>{nope}</tool_call>", "not JSON"), ('<tool_call>["f"]</tool_call>', "expected"),
                     ('<tool_call>{"arguments": {}}</tool_call>', "expected"),
                     ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be an object"),
                     ('<tool_call>{"name": "f"}', "unbalanced"), (call("f") + "</tool_call>", "unbalanced")]:
        with pytest.raises(FormatError, match=why):
            parse_tool_calls(bad)


def test_calculator_is_exact_and_refuses_code():
    assert calculator("123456789 * 987654321") == str(123456789 * 987654321)
    assert calculator("(7 - 10) // 2 + 2 ** 10 % 7") == str((7 - 10) // 2 + 2 ** 10 % 7)
    assert calculator("-1.5 / 3") == "-0.5"
    for bad in ["__import__('os')", "x + 1", "(1).real", "[1, 2]", "10 ** 100000", "1 +", "'a' * 3"]:
        with pytest.raises(ValueError):
            calculator(bad)
    with pytest.raises(ZeroDivisionError):
        calculator("1 / 0")


def test_truncate_says_what_it_cut():
    assert truncate("abc", 10) == "abc"
    cut = truncate("x" * 1000, 100)
    assert len(cut) == 100 and cut == "x" * 72 + "...[928 more characters cut]"


def test_tool_env_turns_in_process():
    env = ToolEnv(tools=("calculator", T + "raises"), reward=T + "exact")
    assert env.reset({"answer": "42", "task": "t"}) == ""
    s = env.step("let me check " + call("calculator", expression="6*7") + call("raises"))
    assert not s.done and s.reward == 0
    assert s.observation == render_responses(["42", "error: ZeroDivisionError: deliberate failure in a tool"])
    assert s.info["tool_calls"] == 2 and s.info["tool_errors"] == 1
    s = env.step(call("search", q="x"))
    assert "unknown tool 'search'" in s.observation and s.info["tool_errors"] == 1
    s = env.step("<tool_call>{broken</tool_call>")
    assert s.observation.startswith("<tool_response>error: tool call 1: not JSON") and s.info == {"format_errors": 1}
    assert env.step("42") == Step(reward=1.0, done=True)
    assert env.step("41").reward == 0.0
    pickle.loads(pickle.dumps(env))                              # it can travel to a worker
    with pytest.raises(ValueError, match="does not import"):
        ToolEnv(tools=("no_such_module:f",))


def test_python_tool_runs_in_the_sandbox():
    env = ToolEnv(tools=("python",), reward=T + "exact")
    env.reset({"answer": "x"})
    s = env.step(call("python", code="print(sum(range(10)))"))
    assert s.observation == render_responses(["45\n"])
    s = env.step(call("python", code="while True: pass"))
    assert "timeout" in s.observation


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=5.0) as p:
        yield p


def _run(runner, items, timeout=30.0):
    for key, env, action in items:
        runner.submit(key, env, action)
    got, end = {}, time.monotonic() + timeout
    while runner.pending and time.monotonic() < end:
        for key, env, step in runner.poll(0.1):
            got[key] = (env, step)
    assert not runner.pending
    return got


def test_hostile_tools_never_stall_a_step(pool):
    limits = EnvLimits(max_turns=4, step_timeout_s=1.5, max_observation_chars=300)
    runner = EnvRunner(pool, limits)
    tools = ("calculator",) + tuple(T + n for n in ("raises", "hangs", "floods", "malformed", "exits"))
    env = ToolEnv(tools=tools, reward=T + "exact", max_output_chars=200)
    env.reset({"answer": "1"})
    t0 = time.monotonic()
    got = _run(runner, [(n, env, call(n)) for n in ("raises", "hangs", "floods", "malformed", "exits")]
               + [("ok", env, call("calculator", expression="2**10"))])
    assert time.monotonic() - t0 < 12                  # the hung tool cost its step's timeout, not more
    for key, (_, step) in got.items():
        assert not step.done and len(step.observation) <= 300, key
    assert got["ok"][1].observation == render_responses(["1024"])
    assert "ZeroDivisionError" in got["raises"][1].observation and got["raises"][1].info["tool_errors"] == 1
    assert "timed out" in got["hangs"][1].observation and got["hangs"][1].info == {"env_errors": 1, "status": "timeout"}
    assert got["floods"][1].observation.endswith("more characters cut]</tool_response>")
    assert "'not': 'text'" in got["malformed"][1].observation
    assert "worker died" in got["exits"][1].observation and got["exits"][1].info == {"env_errors": 1, "status": "crash"}
    assert runner.totals["env_errors"] == 2 and runner.totals["tool_calls"] == 4 and runner.totals["steps"] == 6


def test_state_travels_and_failures_keep_the_state_before_the_step(pool):
    runner = EnvRunner(pool, EnvLimits(max_turns=8, step_timeout_s=5.0))
    env = _testing.Counter()
    for k in range(1, 4):
        env, step = _run(runner, [("a", env, f"turn {k}")])["a"]
        assert env.n == k and step.observation == f"step {k}: turn {k}" and step.reward == k
    assert step.done and "a" not in runner.turns
    broken = _testing.Broken()
    after, step = _run(runner, [("b", broken, "x")])["b"]
    assert after is broken and "not a Step" in step.observation and step.info == {"env_errors": 1, "status": "crash"}


def test_the_runner_ends_a_trajectory_at_max_turns(pool):
    runner = EnvRunner(pool, EnvLimits(max_turns=2, step_timeout_s=5.0))
    env, step = _run(runner, [("a", _testing.Counter(), "1")])["a"]
    assert not step.done
    env, step = _run(runner, [("a", env, "2")])["a"]
    assert step.done and step.info["turn_limit"] == 1 and env.n == 2


def test_env_limits_are_checked():
    for bad in [dict(max_turns=0), dict(step_timeout_s=0), dict(max_observation_chars=10)]:
        with pytest.raises(ValueError):
            EnvLimits(**bad)
    with pytest.raises(NotImplementedError):
        Environment().step("x")


def test_a_cancelled_step_never_comes_back(pool):
    """Tail batching gives up a trajectory while its environment steps: the step's result is dropped."""
    runner = EnvRunner(pool, EnvLimits(max_turns=8, step_timeout_s=5.0))
    runner.submit("gone", _testing.Counter(), "x")
    runner.submit("kept", _testing.Counter(), "y")
    runner.cancel("gone")
    got = _run(runner, [])
    assert set(got) == {"kept"} and runner.pending == 0 and "gone" not in runner.turns


def test_gym_style_environments_are_adapted(pool):
    """No base class: `reset(row)` -> None and `step` -> (observation, reward, done); gymnasium's signatures:
    `reset(options=row)` -> (obs, info) and the 5-tuple (truncated ends the trajectory, info dropped). Stepped in
    the runner's worker processes, the state travelling as for any environment."""
    runner = EnvRunner(pool, EnvLimits(max_turns=8, step_timeout_s=5.0))
    env = make_env(T + "GymGuess")
    assert isinstance(env, GymEnv) and env.reset({"answer": "7", "task": "t"}) == ""
    env, step = _run(runner, [("g", env, "3")])["g"]
    assert step == Step("no (1)", 0.0, False)
    env, step = _run(runner, [("g", env, " 7 ")])["g"]
    assert step == Step("", 0.5, True) and env.env.tries == 2
    env = make_env(T + "GymnasiumStyle")
    assert env.reset({"prompt": "P", "answer": "a", "task": "t"}) == " [start]"
    env, step = _run(runner, [("h", env, "x")])["h"]
    assert step == Step("P#1", 0.5, False)             # (its info's "status" is not read as the step's)
    env, step = _run(runner, [("h", env, "x")])["h"]
    assert step == Step("P#2", 0.5, True)
    assert make_env("calculator").__class__ is ToolEnv


@pytest.mark.parametrize("name, why", [
    ("ResetWithoutRow", "ResetWithoutRow.reset() cannot be called as reset(self, row)"),
    ("StepWithoutText", "StepWithoutText.step() cannot be called as step(self, text)"),
    ("exact", "exact(response, answer, task) needs arguments; name a class made with none, or a zero-argument "
              "factory"),
    ("malformed", "malformed() made a dict, not an environment: a jaxrl.envs.Environment, or a gym-style class "
                  "with reset(row) and step(text)"),
])
def test_an_environment_that_cannot_run_is_refused_in_one_line(name, why):
    with pytest.raises(ValueError) as e:
        env_factory(T + name)
    assert str(e.value) == f"environment '{T}{name}': {why}"
