"""Rewards: verifiers by name, scored in a process pool with hard per-sample timeouts.

    from jaxrl.rewards import RewardPool, check_rewards, reward_name, reward_names
    with RewardPool(num_workers=4, timeout_s=5.0) as pool:
        check_rewards(reward_columns(rows, fn, registry), pool)  # start-up: every name resolves and fits its rows
        scores, stats = pool.score([reward_item(reward_name(row, fn, registry), response, row), ...])

A reward is `fn(response: str, answer: str, task: str) -> float`, which may also take the row's prompt and
columns by name (`fn(response, answer, *, prompt, difficulty)`, `**row`; TRL's `fn(completions, **kwargs)`
too: `calling`), named by a registered name ("math":
math-verify equivalence, "builtin": the synthetic tasks' own scorers) or an import path
"package.module:function". **Your own reward**: put the function in a module importable in a fresh
interpreter (the directory `python -m jaxrl.train` starts in, `PYTHONPATH`, or an installed package)
and name it per row (a `"reward"` field in the data), for every row (`rewards.fn`), or under a short
name (`rewards.registry`); see `registry` for the order. `check_rewards` resolves every name the data
uses, here and in a worker, before training starts. `pool` runs them (batch `score`, or streaming
`submit`/`poll`); a timeout or crash scores 0 and is counted with its cause, never a hung step.

Code (RollPacker §4.3): `run_program`/`run_tests` run untrusted programs in a sandbox (`sandbox`: PID,
network and mount namespaces, a throwaway uid, rlimits, everything killed afterwards); the "code" reward
(`code`) runs a response on a row's test cases; `RewardScheduler` (`scheduler`) scores responses as
they finish, reports prompt groups as they complete, cancels aborted ones and gives code test cases
adaptive timeouts (`AdaptiveTimeouts`, `timeouts`).
"""

from .code import CodeCase, CodeSpec, case_keys, code_reward, parse_spec
from .math import math_reward
from .pool import RewardItem, RewardPool, RewardResult
from .registry import (REWARD_FNS, RewardLookupError, check_rewards, resolve, reward_columns, reward_fn_for,
                       reward_item, reward_name, reward_names)
from .sandbox import ProgramResult, SandboxLimits, run_program, run_tests
from .scheduler import CompletedGroup, Polled, RewardScheduler, ScoredResponse
from .timeouts import AdaptiveTimeouts

__all__ = ["REWARD_FNS", "AdaptiveTimeouts", "CodeCase", "CodeSpec", "CompletedGroup", "Polled", "ProgramResult",
           "RewardItem", "RewardLookupError", "RewardPool", "RewardResult", "RewardScheduler", "SandboxLimits",
           "ScoredResponse", "case_keys", "check_rewards", "code_reward", "math_reward", "parse_spec",
           "resolve", "reward_columns", "reward_fn_for", "reward_item", "reward_name", "reward_names", "run_program",
           "run_tests"]
