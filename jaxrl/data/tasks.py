"""Built-in task suite: generated prompts with verifiable answers, no downloads.

Every task is a short string transformation a tiny character-level model can learn (copy, reverse,
sort, repeat, add), over the letters a-j and the digits. What makes them a useful RL testbed is the
*length* of the answer: it is set by the prompt and drawn from a clipped log-normal
(`long_tail_length`), so most answers are 2-8 characters and about one prompt in fifty needs 30-60:
the long-tailed generation skew that tail batching (RollPacker), skew-aware placement (StreamRL) and
adaptive TP (PAT) attack. `repeat` hides the length behind
arithmetic ("rep ab 7" → 14 characters), so a length predictor has to learn it rather than read it off
the prompt length.

Prompts are compact (the char tokenizer spends one token per character) and use only printable ASCII:
with `CharTokenizer`'s chat template a prompt is ~27 tokens (median) and prompt + answer + EOS is at
most 144 tokens. Answer lengths over 10k examples (median / p99 / max characters): copy, reverse and
sort 5 / 42 / 60, repeat 6 / 51 / 60, add 2 / 16 / 30.

`demonstration` gives the ideal response for the supervised warm start; `score` gives partial credit in
[0, 1] — the fraction of the answer reproduced as a correct prefix, divided by the longer of response and
answer, so a wrong character, a missing tail and trailing garbage all cost reward and only the exact
answer scores 1 — which keeps the reward informative for a policy that is only partly right.

`score(task, response, answer)` is a picklable top-level function with no JAX import: the reward
process pool calls it in worker processes. Rows of other tasks (e.g. "math" from DeepScaleR) are scored
by their own verifiers elsewhere; here they raise `KeyError`.

`arith` (opt-in, for a pretrained chat model such as SmolLM2: `configs/smollm2_arith.yaml`) asks "What is 23 + 48?"
for two 2-digit numbers (8,100 distinct prompts) and scores 1 when the last integer of the response is the sum
(`final_number_score`), else 0.

**Opt-in tasks.** `BUILTIN_TASKS` is the default suite (`data.tasks: []` means all of it). `code` is
built in but opt-in (`data.tasks: [code]`; `TASKS` holds both): "py add 7" asks for a one-line Python
program that reads a line from stdin and prints the result ("print(int(input())+7)"); the answer is the
test cases as JSON (`jaxrl.rewards.code` schema: three stdin/stdout pairs) and the reward runs the
program on them in the sandbox ("code" reward: 1 when every case passes, else 0). Seven operations
(add k, mul k, rep k, head k, rev, sort, len) over small integers and the letters a-j; prompts are
8-10 characters, demonstrations 20-32.

`calc` (opt-in, multi-turn: `configs/multiturn.yaml`) asks for the product of two 2-digit numbers ("calc
48*39" -> "1872"), which a tiny model cannot compute in its head. Its demonstrations (`demonstration_turns`)
show two strategies, each correct on its row: for a stable share of the prompts (`CALC_DIRECT_DEMOS`, half; by a
hash of the prompt) the product written directly with no tool, for the others a calculator call in one turn and
the tool's result as the answer in the next. Only the tool generalises to products the model has not
memorised, and which strategy pays is what RL has to find out. The reward is 1 for the exact product, else 0 (a prefix score would pay for
leading digits right by chance: noise that GRPO's normalisation amplifies).
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
import zlib
from typing import Callable, Sequence

import numpy as np

from jaxrl.rewards.code import code_reward

# Ten letters, not 26: with the same 400 supervised steps a 2-layer, 128-wide char model reached a
# greedy score of 0.62/0.62/0.60 on copy/reverse/sort over "a".."j" against 0.24/0.35/0.44 over "a".."z"
# (CPU, packed batches of 64 demonstrations) — a warm start that sometimes succeeds, as RL needs.
LETTERS = string.ascii_lowercase[:10]
MAX_ANSWER_CHARS = 60


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    task: str


def long_tail_length(rng: np.random.Generator, median: float, sigma: float = 0.9, lo: int = 1,
                     hi: int = MAX_ANSWER_CHARS) -> int:
    """round(median · exp(sigma · z)), z ~ N(0, 1), clipped to [lo, hi].

    With sigma = 0.9 the 99th percentile is ≈ 8× the median (exp(2.33 · 0.9)); the clip bounds the
    longest rollout (and so the CPU quickstart's time).
    """
    return int(np.clip(round(median * np.exp(sigma * rng.standard_normal())), lo, hi))


def _letters(rng: np.random.Generator, n: int) -> str:
    return "".join(LETTERS[i] for i in rng.integers(0, len(LETTERS), size=n))


def _number(rng: np.random.Generator, digits: int) -> int:
    if digits == 1:
        return int(rng.integers(0, 10))
    return int(str(rng.integers(1, 10)) + "".join(str(d) for d in rng.integers(0, 10, size=digits - 1)))


def prefix_score(response: str, answer: str) -> float:
    """|common prefix| / max(|response|, |answer|): 1 only for the exact answer, else < 1.

    Monotone in the length of the correct prefix; trailing characters after a correct answer (a policy
    that does not stop) lower the score like missing ones do.
    """
    response, answer = response.strip(), answer.strip()
    denom = max(len(response), len(answer))
    if denom == 0:
        return 1.0
    k = 0
    for a, b in zip(response, answer):
        if a != b:
            break
        k += 1
    return k / denom


@dataclasses.dataclass(frozen=True)
class Task:
    """A generator of (prompt, answer) pairs with a verifier.

    `generate(rng) -> (prompt, answer)`; `scorer(response, answer) -> [0, 1]`.
    """

    name: str
    description: str
    generate: Callable[[np.random.Generator], tuple[str, str]]
    scorer: Callable[[str, str], float] = prefix_score
    demo: Callable[[Example], str] | None = None   # the ideal response when it is not the answer itself
    turns: Callable[[Example], list[str]] | None = None   # multi-turn: the ideal turns (tool calls, then the answer)

    def make(self, rng: np.random.Generator) -> Example:
        prompt, answer = self.generate(rng)
        return Example(prompt, answer, self.name)

    def demonstration(self, ex: Example) -> str:
        """The ideal response text (without EOS; the tokenizer's EOS ends it)."""
        return self.demo(ex) if self.demo is not None else ex.answer

    def demonstration_turns(self, ex: Example) -> list[str]:
        """The ideal turns of a multi-turn trajectory (each tool call its own turn, the answer last); a task
        answered in one turn: its demonstration."""
        return self.turns(ex) if self.turns is not None else [self.demonstration(ex)]

    def score(self, response: str, answer: str) -> float:
        return float(self.scorer(response.strip(), answer.strip()))


def _copy(rng):
    s = _letters(rng, long_tail_length(rng, median=5))
    return f"copy {s}", s


def _reverse(rng):
    s = _letters(rng, long_tail_length(rng, median=5))
    return f"rev {s}", s[::-1]


def _sort(rng):
    s = _letters(rng, long_tail_length(rng, median=5))
    return f"sort {s}", "".join(sorted(s))


def _repeat(rng):
    unit = _letters(rng, int(rng.integers(1, 3)))
    n = max(2, long_tail_length(rng, median=6, lo=2) // len(unit))
    return f"rep {unit} {n}", unit * n


def _add(rng):
    digits = long_tail_length(rng, median=2, lo=1, hi=MAX_ANSWER_CHARS // 2)
    a, b = _number(rng, digits), _number(rng, int(rng.integers(1, digits + 1)))
    if rng.random() < 0.5:
        a, b = b, a
    return f"add {a}+{b}", str(a + b)


def _calc(rng):
    a, b = int(rng.integers(10, 100)), int(rng.integers(10, 100))
    return f"calc {a}*{b}", str(a * b)


ARITH_PROMPT = "What is {a} + {b}?"


def _arith(rng):
    a, b = int(rng.integers(10, 100)), int(rng.integers(10, 100))
    return ARITH_PROMPT.format(a=a, b=b), str(a + b)


_INT = re.compile(r"-?\d[\d,]*")


def final_number_score(response: str, answer: str) -> float:
    """1 when the last integer written in the response (thousands commas allowed) is the answer, else 0: a
    worked solution that ends on the right sum scores like the bare sum; one that ends on another number
    does not."""
    found = _INT.findall(response)
    return float(bool(found) and found[-1].replace(",", "") == answer.strip())


def exact_score(response: str, answer: str) -> float:
    """1 for the exact answer, else 0 (no partial credit: a product's leading digits right by chance are noise)."""
    return float(response.strip() == answer.strip())


CALC_DIRECT_DEMOS = 0.5      # the share of `calc` demonstrations that answer without the tool


def calc_uses_tool(prompt: str) -> bool:
    """Whether the warm start demonstrates `prompt` with the calculator (stable: a CRC-32 of the prompt), or
    answers it directly (a CALC_DIRECT_DEMOS share of the prompts)."""
    return zlib.crc32(prompt.encode()) % 1000 >= CALC_DIRECT_DEMOS * 1000


def calc_turns(ex: Example) -> list[str]:
    """A `calc` demonstration: one calculator call (the Qwen3/Hermes format, `jaxrl.envs.tools`) then the
    answer, or for the rows `calc_uses_tool` says not, the answer alone."""
    if not calc_uses_tool(ex.prompt):
        return [ex.answer]
    expression = ex.prompt.split(" ", 1)[1]
    call = '{"name":"calculator","arguments":{"expression":"' + expression + '"}}'
    return [f"<tool_call>{call}</tool_call>", ex.answer]


# op -> (input kind, program template, expected output of (input line, k))
CODE_OPS: dict[str, tuple[str, str, Callable[[str, int], str]]] = {
    "add": ("int", "print(int(input())+{k})", lambda x, k: str(int(x) + k)),
    "mul": ("int", "print(int(input())*{k})", lambda x, k: str(int(x) * k)),
    "rep": ("str", "print(input()*{k})", lambda x, k: x * k),
    "head": ("str", "print(input()[:{k}])", lambda x, k: x[:k]),
    "rev": ("str", "print(input()[::-1])", lambda x, k: x[::-1]),
    "sort": ("str", "print(''.join(sorted(input())))", lambda x, k: "".join(sorted(x))),
    "len": ("str", "print(len(input()))", lambda x, k: str(len(x))),
}
CODE_CASES = 3


def _code(rng):
    op = sorted(CODE_OPS)[int(rng.integers(0, len(CODE_OPS)))]
    kind, template, fn = CODE_OPS[op]
    k = int(rng.integers(2, 10))
    inputs = [str(int(rng.integers(0, 100))) if kind == "int" else _letters(rng, int(rng.integers(1, 7)))
              for _ in range(CODE_CASES)]
    tests = [{"stdin": x + "\n", "stdout": fn(x, k) + "\n"} for x in inputs]
    prompt = f"py {op} {k}" if "{k}" in template else f"py {op}"
    return prompt, json.dumps({"tests": tests}, separators=(",", ":"))


def code_solution(ex: Example) -> str:
    """The reference program of a built-in code prompt ("py add 7" -> "print(int(input())+7)")."""
    _, op, *k = ex.prompt.split(" ")
    return CODE_OPS[op][1].format(k=k[0] if k else "")


def code_score(response: str, answer: str) -> float:
    """The "code" reward (`jaxrl.rewards.code`: the program run on the test cases in the sandbox)."""
    return float(code_reward(response, answer))


BUILTIN_TASKS: dict[str, Task] = {t.name: t for t in (
    Task("copy", "copy a string of letters", _copy),
    Task("reverse", "reverse a string of letters", _reverse),
    Task("sort", "sort the letters of a string", _sort),
    Task("repeat", "repeat a 1-2 letter unit n times", _repeat),
    Task("add", "add two non-negative integers", _add),
)}
OPT_IN_TASKS: dict[str, Task] = {t.name: t for t in (
    Task("code", "a one-line Python program over stdin, run on test cases", _code, code_score, code_solution),
    Task("calc", "multiply two 2-digit numbers with the calculator tool (multi-turn)", _calc, exact_score,
         turns=calc_turns),
    Task("arith", "add two 2-digit numbers, asked in English (for a pretrained chat model)", _arith,
         final_number_score),
)}
TASKS: dict[str, Task] = {**BUILTIN_TASKS, **OPT_IN_TASKS}   # every task `data.tasks` may name
DEFAULT_TASKS: tuple[str, ...] = tuple(sorted(BUILTIN_TASKS))   # what `data.tasks: []` means


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)}") from None


def score(task: str, response: str, answer: str) -> float:
    """Reward in [0, 1] of `response` (decoded text up to EOS) for a row of built-in task `task`."""
    return get_task(task).score(response, answer)


def builtin_reward(response: str, answer: str, task: str) -> float:
    """The "builtin" reward (`jaxrl.rewards.registry`): `score(task, response, answer)`, in the reward
    functions' argument order."""
    return float(score(task, response, answer))


def demonstration(ex: Example) -> str:
    """The ideal response for a built-in example (the supervised warm start's target)."""
    return get_task(ex.task).demonstration(ex)


def make_suite(names: Sequence[str], n: int, seed: int) -> list[Example]:
    """n examples cycling through `names` in order, from one seeded generator.

    Deterministic in (names, n, seed), and `make_suite(names, n, seed)` is a prefix of
    `make_suite(names, n + k, seed)`.
    """
    if isinstance(names, str):
        names = [names]
    tasks = [get_task(name) for name in names]
    if not tasks:
        raise ValueError("make_suite needs at least one task name")
    if n < 0:
        raise ValueError(f"make_suite: n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    return [tasks[i % len(tasks)].make(rng) for i in range(n)]
