"""`rollout.env` and `rollout.turns`: multi-turn rollouts with an environment (`jaxrl.envs`,
`jaxrl.train.trajectories`)."""

from __future__ import annotations

import dataclasses

from .base import ConfigError, Section, check_float, check_int


@dataclasses.dataclass(frozen=True)
class TurnsSection(Section):
    """Multi-turn limits (used when `rollout.env` is set). A turn ends at one of `stops` (the text is
    tokenised with the run's tokenizer; the sequence pauses holding its KV while the environment steps) or at
    EOS; `rollout.max_new_tokens` bounds the whole trajectory after the prompt, observations included (its
    max_trajectory_tokens). Each environment step runs in a reward worker process under `step_timeout_s`.

    `deterministic`: every turn that ended at an engine step has its observation appended before the next engine
    step (in trajectory order), so which sequences decode together never depends on how fast a tool answered: a
    run, and a resumed run, reproduce bit for bit. The price is that a slow tool holds up the decoding of the
    other sequences; with false, observations join as their steps come back and tool time overlaps decoding
    (float32 rounding then depends on timing: log-probs within ~1e-6, tokens the same but for near-ties)."""

    max_turns: int = 4                          # model turns per trajectory (the last one ends it)
    stops: tuple[str, ...] = ("</tool_call>",)  # text that ends a turn, not the trajectory
    turn_max_tokens: int = 0                    # a turn also ends after this many sampled tokens (0: no limit)
    step_timeout_s: float = 10.0                # one environment step's wall time (hard, in its worker)
    max_observation_chars: int = 2000           # an observation is cut to this many characters (in the worker)
    deterministic: bool = True                  # observations join at the engine step after their turn (waits for slow tools): runs and resumes reproduce bit for bit; false: as they arrive

    def __post_init__(self):
        check_int("max_turns", self.max_turns, minimum=1)
        check_int("turn_max_tokens", self.turn_max_tokens, minimum=0)
        check_float("step_timeout_s", self.step_timeout_s, above=0.0)
        check_int("max_observation_chars", self.max_observation_chars, minimum=64)
        if any(not isinstance(s, str) or not s for s in self.stops):
            raise ConfigError("stops", f"each turn stop is a non-empty string, got {self.stops!r}")
        if self.max_turns > 1 and not self.stops and not self.turn_max_tokens:
            raise ConfigError("stops", f"max_turns={self.max_turns} needs a way to end a turn: turn stops or "
                              "turn_max_tokens")
