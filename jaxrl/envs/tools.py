"""Tool calls in the model's text and the built-in tools: what `ToolEnv` runs between turns.

A tool call is a JSON object between tags, the format of the Qwen3 and Hermes chat templates:

    <tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call>

`parse_tool_calls` returns every call of a turn in order, or raises `FormatError` (text for a format-error
observation) when a call is malformed: JSON that does not parse, no `name`, `arguments` not an object, or an
unclosed tag. Each result goes back as `<tool_response>...</tool_response>`, one per call, in call order.

Built-in tools: `calculator` (exact integer and float arithmetic from a parsed expression; no names, calls or
attributes, bounded powers) and `python` (a program run in the code reward's sandbox: namespaces, rlimits,
killed with all it started; its stdout, or its error). A tool's output is cut to `max_output_chars`.

Simplified (stated): a tool's own time is bounded by the whole step's timeout in the worker (`EnvRunner`), not
per call; the python tool has its own wall limit inside that.
"""

from __future__ import annotations

import ast
import importlib
import json
import operator
import re
import time

from jaxrl.rewards.calling import RewardItem, invoke
from jaxrl.rewards.registry import resolve, reward_item
from jaxrl.rewards.sandbox import run_program

from .base import Environment, Step

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)


class FormatError(ValueError):
    """A malformed tool call; the message is what the model is told."""


def parse_tool_calls(text: str) -> list[tuple[str, dict]]:
    """Every `(name, arguments)` tool call in `text`, in order ([] when there is none)."""
    calls = []
    for k, m in enumerate(_CALL.finditer(text)):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError as e:
            raise FormatError(f"tool call {k + 1}: not JSON ({e.msg} at character {e.pos})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise FormatError(f'tool call {k + 1}: expected {{"name": ..., "arguments": {{...}}}}')
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            raise FormatError(f"tool call {k + 1}: arguments must be an object, got {type(args).__name__}")
        calls.append((obj["name"], args))
    if text.count(CALL_OPEN) != len(calls) or text.count(CALL_CLOSE) != len(calls):
        raise FormatError(f"unbalanced {CALL_OPEN} / {CALL_CLOSE} tags")
    return calls


def render_responses(outputs: list[str]) -> str:
    return "".join(f"<tool_response>{out}</tool_response>" for out in outputs)


def truncate(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    keep = limit
    while True:                       # the note's length depends on the count it reports
        note = f"...[{len(text) - keep} more characters cut]"
        if max(0, limit - len(note)) == keep:
            return text[:keep] + note
        keep = max(0, limit - len(note))


# ------------------------------------------------------------------------------------------- calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT, MAX_DIGITS = 1000, 4000


def calculator(expression: str) -> str:
    """The value of an arithmetic expression: numbers, + - * / // % ** and parentheses (ValueError otherwise)."""
    if not isinstance(expression, str) or len(expression) > 1000:
        raise ValueError("expression must be a string of at most 1000 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > MAX_EXPONENT:
                raise ValueError(f"exponent {b} is too large (at most {MAX_EXPONENT})")
            out = _BINARY[type(node.op)](a, b)
            if isinstance(out, int) and out.bit_length() > MAX_DIGITS * 3.33:
                raise ValueError(f"result has more than {MAX_DIGITS} digits")
            return out
        raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, got {type(node).__name__}")

    return str(ev(tree))


def python(code: str) -> str:
    """Run a Python program in the sandbox (2 s); its stdout, or its status and the end of its stderr."""
    if not isinstance(code, str):
        raise ValueError("code must be a string")
    r = run_program(code, timeout_s=2.0)
    return r.stdout if r.status == "ok" else f"{r.status}: {r.reason} {r.stderr[-500:]}".strip()


TOOLS = {"calculator": calculator, "python": python}


def tool_fn(name: str):
    """A built-in tool by name, or a user's by import path `"package.module:function"` (called with the
    call's arguments as keywords; whatever it returns is shown as text)."""
    if name in TOOLS:
        return TOOLS[name]
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"unknown tool {name!r}: a built-in ({', '.join(sorted(TOOLS))}) or 'package.module:function'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"tool {name!r} does not import: {type(e).__name__}: {e}") from None


class ToolEnv(Environment):
    """A task answered with tools: each turn either calls tools (their outputs are the observation) or, with no
    tool call, answers (scored by the row's reward function; the trajectory ends). A malformed call gets the
    format-error observation (`format_error`, with the parser's message) and is counted."""

    def __init__(self, tools=("calculator", "python"), reward: str = "builtin", max_output_chars: int = 1000,
                 format_error: str = "<tool_response>error: {error}</tool_response>"):
        """`tools`: built-in names or import paths (`tool_fn`), called by the last path component's name
        (`"my_tools:search"` is the tool "search")."""
        for name in tools:
            tool_fn(name)                 # fails here, before any trajectory, when a tool does not import
        self.tools = {name.rpartition(":")[2]: name for name in tools}
        self.reward, self.max_output_chars = reward, int(max_output_chars)
        self.format_error = format_error
        self.answer = self.task = ""
        self.item = RewardItem(reward, "", "", "")

    def reset(self, row: dict) -> str:
        """Keeps the row's answer, task, reward and the row values its reward takes by name (`reward_item`)."""
        self.answer, self.task = str(row.get("answer", "")), str(row.get("task", ""))
        self.reward = row.get("reward", self.reward)
        self.item = reward_item(self.reward, "", {**row, "answer": self.answer, "task": self.task})
        return ""

    def step(self, action: str) -> Step:
        try:
            calls = parse_tool_calls(action)
        except FormatError as e:
            return Step(self.format_error.format(error=e), info={"format_errors": 1})
        if not calls:
            item = self.item._replace(response=action)
            return Step(reward=float(invoke(resolve(item.fn), item)), done=True)
        outputs, errors, t0 = [], 0, time.perf_counter()
        for name, args in calls:
            try:
                if name not in self.tools:
                    raise ValueError(f"unknown tool {name!r}; available: {', '.join(self.tools)}")
                out = str(tool_fn(self.tools[name])(**args))
            except Exception as e:         # a tool's failure is the model's observation, never the step's
                out, errors = f"error: {type(e).__name__}: {e}", errors + 1
            outputs.append(truncate(out, self.max_output_chars))
        return Step(render_responses(outputs), info={"tool_calls": len(calls), "tool_errors": errors,
                                                     "tool_seconds": time.perf_counter() - t0})
