"""What a multi-turn policy acts in: an `Environment` answers each turn's text with an observation, a reward and
whether the trajectory is over.

    class MyEnv(Environment):
        def reset(self, row):            # the data row of this trajectory's prompt
            self.answer = row["answer"]
            return ""                    # text appended after the prompt before the first turn ("": none)
        def step(self, action):          # the model's text of one turn
            if "<tool_call>" in action:
                return Step(observation="<tool_response>...</tool_response>")
            return Step(reward=float(action.strip() == self.answer), done=True)

An instance is one trajectory's state and must be picklable: each `step` runs in a reward worker process (a
hard timeout, crashes contained: `jaxrl.envs.runner`) and the instance travels there and back, so it is also a
value a checkpoint can hold. A step that fails (raises, hangs past its timeout, kills its worker) leaves the
instance as it was before that step.

A gym-style class (no base class; `reset(row)`, `step(text)` returning `(observation, reward, done)` or gymnasium's
5-tuple) is adapted to this API by `jaxrl.envs.adapter.GymEnv`; every environment's methods are checked at start-up.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Step:
    """One environment step's result: the observation appended to the trajectory (context, never trained on),
    the reward of the turn (summed over a trajectory unless the trainer is told otherwise), whether the
    trajectory is over, and counters the runner sums into `env/` metrics (`tool_calls`, `tool_errors`,
    `format_errors`, `tool_seconds`)."""

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    info: dict = dataclasses.field(default_factory=dict)


class Environment:
    """One trajectory's environment (see the module docstring). Subclasses override `step`, usually `reset`."""

    def reset(self, row: dict) -> str:
        """Start a trajectory for data row `row`; returns text to append after the prompt ("" for none)."""
        return ""

    def step(self, action: str) -> Step:
        """The model's text of one turn -> what the environment answers."""
        raise NotImplementedError(f"{type(self).__name__}.step")
