"""Code reward: run a response's Python program on a task's test cases in the sandbox.

    from jaxrl.rewards.code import code_reward
    answer = '{"tests": [{"stdin": "3\\n", "stdout": "9\\n"}, {"stdin": "5\\n", "stdout": "25\\n"}]}'
    code_reward("print(int(input())**2)", answer)                          # 1.0
    score, info = code_reward(program, answer, timeouts=[2.0, 2.0], details=True)
    info["cases"]   # [{"status": "ok", "reason": "", "seconds": 0.02, "correct": True}, ...]

**Test-case schema** (the row's `answer`). In a JSONL file of user code tasks each line is

    {"prompt": "Read n from stdin and print n squared.", "task": "code",
     "answer": {"tests": [{"stdin": "3\\n", "stdout": "9\\n"}, {"stdin": "5\\n", "stdout": "25\\n"}],
                "compare": "lines", "score": "all"}}

`answer` may be that object or the same JSON as a string (`jaxrl.data.dataset` serialises an object).
`tests` (required, at least one): each case's `stdin` (default "") and expected `stdout`. `compare`:
"lines" (default: each line's trailing whitespace and trailing blank lines ignored), "tokens" (equal
whitespace-separated tokens) or "exact". `score`: "all" (default, RollPacker's and most code RL's: 1 when
every case passes, else 0) or "fraction" (the fraction of cases passed). A bare list of cases is read as
`{"tests": [...]}`. `"task": "code"` selects this reward (`registry.reward_fn_for`); so does
`"reward": "code"` on a row of any task.

A response is a whole program reading stdin and writing stdout; when it contains a fenced block
(```python ... ```), the first block is the program. Each case runs in its own sandbox run
(`jaxrl.rewards.sandbox.run_tests`, a fresh directory per case) with its own timeout: `timeouts[i]`,
from the adaptive policy when the `RewardScheduler` submits it, else `DEFAULT_TIMEOUT_S`. After a case
that times out or hits a limit the remaining cases are not run (they fail too; with `score: all` so does
a runtime error): a program that hangs on one input would cost a full timeout per case.

Registered as "code" (`fn(response, answer, task) -> float`), so it also runs through a plain
`RewardPool`; then set `rewards.timeout_s` above cases × `DEFAULT_TIMEOUT_S`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Mapping, Sequence

from .sandbox import SandboxLimits, run_tests

DEFAULT_TIMEOUT_S = 2.0
COMPARES = ("lines", "tokens", "exact")
SCORINGS = ("all", "fraction")
_FENCE = re.compile(r"```[ \t]*[\w+-]*[ \t]*\n(.*?)```", re.S)


@dataclasses.dataclass(frozen=True)
class CodeCase:
    stdin: str
    stdout: str


@dataclasses.dataclass(frozen=True)
class CodeSpec:
    tests: tuple[CodeCase, ...]
    compare: str = "lines"
    score: str = "all"

    def to_json(self) -> str:
        """The compact answer string of this spec (what the built-in `code` task stores)."""
        obj = {"tests": [{"stdin": t.stdin, "stdout": t.stdout} for t in self.tests]}
        if self.compare != "lines":
            obj["compare"] = self.compare
        if self.score != "all":
            obj["score"] = self.score
        return json.dumps(obj, separators=(",", ":"))


def parse_spec(answer: str | Mapping | Sequence) -> CodeSpec:
    """The test cases of a code row's answer (see the module docstring); ValueError saying what is wrong."""
    obj = answer
    if isinstance(answer, str):
        try:
            obj = json.loads(answer)
        except json.JSONDecodeError as e:
            raise ValueError(f"code answer is not JSON ({e.msg}): {answer[:80]!r}") from None
    if isinstance(obj, list):
        obj = {"tests": obj}
    if not isinstance(obj, Mapping):
        raise ValueError(f"code answer must be an object with 'tests', got {type(obj).__name__}")
    unknown = set(obj) - {"tests", "compare", "score"}
    if unknown:
        raise ValueError(f"code answer has unknown keys {sorted(unknown)}; valid: tests, compare, score")
    tests = obj.get("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError("code answer needs a non-empty 'tests' list")
    cases = []
    for i, t in enumerate(tests):
        if not isinstance(t, Mapping) or not isinstance(t.get("stdout"), str) \
                or not isinstance(t.get("stdin", ""), str):
            raise ValueError(f"code test {i} must be {{'stdin': str, 'stdout': str}}, got {t!r}"[:200])
        cases.append(CodeCase(t.get("stdin", ""), t["stdout"]))
    compare, score = obj.get("compare", "lines"), obj.get("score", "all")
    if compare not in COMPARES:
        raise ValueError(f"code answer compare={compare!r}; valid: {', '.join(COMPARES)}")
    if score not in SCORINGS:
        raise ValueError(f"code answer score={score!r}; valid: {', '.join(SCORINGS)}")
    return CodeSpec(tuple(cases), compare, score)


def case_keys(answer: str) -> list[str]:
    """A stable key per test case of `answer` ("<digest of the test set>:<index>"), for the anchors of
    `jaxrl.rewards.timeouts.AdaptiveTimeouts`: the same test set gets the same keys in every step."""
    spec = parse_spec(answer)
    digest = hashlib.sha1(spec.to_json().encode()).hexdigest()[:16]
    return [f"{digest}:{i}" for i in range(len(spec.tests))]


def extract_program(response: str) -> str:
    """The first fenced code block of `response`, else the whole response (stripped)."""
    m = _FENCE.search(response)
    return (m.group(1) if m else response).strip()


def outputs_match(got: str, expected: str, compare: str = "lines") -> bool:
    if compare == "exact":
        return got == expected
    if compare == "tokens":
        return got.split() == expected.split()
    norm = lambda s: "\n".join(line.rstrip() for line in s.rstrip().splitlines())  # noqa: E731
    return norm(got) == norm(expected)


def run_code(program: str, spec: CodeSpec, timeouts: Sequence[float] | None = None, *,
             limits: SandboxLimits = SandboxLimits()) -> tuple[float, dict]:
    """(score, info) of `program` on `spec`'s cases. info: {"cases": [{"status", "reason", "seconds",
    "correct"} per case run], "passed", "total", "skipped"} — case i of `cases` is test i."""
    n = len(spec.tests)
    timeouts = [DEFAULT_TIMEOUT_S] * n if timeouts is None else [float(t) for t in timeouts]
    if len(timeouts) != n:
        raise ValueError(f"{len(timeouts)} timeouts for {n} test cases")
    if not program.strip():
        return 0.0, dict(cases=[], passed=0, total=n, skipped=n, empty=True)
    stop = ("timeout", "killed", "error") if spec.score == "all" else ("timeout", "killed")
    results = run_tests(program, [(t.stdin, timeouts[i]) for i, t in enumerate(spec.tests)], limits=limits,
                        stop_after=stop)
    cases = []
    for r, t in zip(results, spec.tests):
        correct = r.status == "ok" and outputs_match(r.stdout, t.stdout, spec.compare)
        cases.append(dict(status=r.status, reason=r.reason if r.status != "ok" or correct else "wrong_answer",
                          seconds=round(r.seconds, 6), correct=correct))
    passed = sum(c["correct"] for c in cases)
    score = passed / n if spec.score == "fraction" else float(passed == n)
    return score, dict(cases=cases, passed=passed, total=n, skipped=n - len(cases),
                       isolation=results[0].isolation if results else "")


def code_reward(response: str, answer: str, task: str = "code", *, timeouts: Sequence[float] | None = None,
                limits: SandboxLimits | Mapping | None = None, details: bool = False):
    """Score of `response` on the test cases in `answer`: a float, or `(score, info)` with `details`.
    `limits`: a `SandboxLimits` or its fields as a dict (what crosses the reward pool's pipe)."""
    if isinstance(limits, Mapping):
        limits = SandboxLimits(**limits)
    score, info = run_code(extract_program(response), parse_spec(answer), timeouts,
                           limits=limits or SandboxLimits())
    return (score, info) if details else score
