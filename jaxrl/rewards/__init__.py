"""Rewards: verifiers by name, scored in a process pool with hard per-sample timeouts.

    from jaxrl.rewards import RewardPool, reward_fn_for
    with RewardPool(num_workers=4, timeout_s=5.0) as pool:
        scores, stats = pool.score([(reward_fn_for(task), response, answer, task), ...])

`registry` maps names to `fn(response, answer, task) -> float` ("math": math-verify equivalence,
"builtin": the synthetic tasks' own scorers); `pool` runs them (batch `score`, or streaming
`submit`/`poll`); a timeout or crash scores 0 and is counted, never a hung step.
"""

from .math import math_reward
from .pool import RewardItem, RewardPool, RewardResult
from .registry import REWARD_FNS, resolve, reward_fn_for

__all__ = ["REWARD_FNS", "RewardItem", "RewardPool", "RewardResult", "math_reward", "resolve", "reward_fn_for"]
