"""Multi-turn environments: the `Environment` API, tool calls and built-in tools, and the runner that steps
environments in reward worker processes (`jaxrl.envs.runner`). The engine side (a live sequence continued
across turns) is `RolloutService.add_tokens`."""

from .base import Environment, Step
from .runner import EnvLimits, EnvRunner
from .tools import TOOLS, FormatError, ToolEnv, calculator, parse_tool_calls, render_responses, tool_fn, truncate

__all__ = ["TOOLS", "EnvLimits", "EnvRunner", "Environment", "FormatError", "Step", "ToolEnv", "calculator",
           "parse_tool_calls", "render_responses", "tool_fn", "truncate"]
