"""Multi-turn environments: the `Environment` API, tool calls and built-in tools, and the runner that steps
environments in reward worker processes (`jaxrl.envs.runner`), environments by name (`registry`: `rollout.env`)
and observations as the chat template renders a tool message (`render`); gym-style environments (`reset(row)`,
`step(text) -> (observation, reward, done)`, no base class) are adapted (`adapter.GymEnv`). The engine side (a
live sequence continued across turns) is `RolloutService.add_tokens`."""

from .adapter import GymEnv
from .base import Environment, Step
from .registry import ENVS, env_factory, make_env
from .render import ObservationFormat
from .runner import EnvLimits, EnvRunner
from .tools import TOOLS, FormatError, ToolEnv, calculator, parse_tool_calls, render_responses, tool_fn, truncate

__all__ = ["ENVS", "TOOLS", "EnvLimits", "EnvRunner", "Environment", "FormatError", "GymEnv", "ObservationFormat",
           "Step", "ToolEnv", "calculator", "env_factory", "make_env", "parse_tool_calls", "render_responses",
           "tool_fn", "truncate"]
