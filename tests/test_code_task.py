"""The built-in `code` task (opt-in, learnable by the char model) and the JSONL schema of user code tasks."""

import contextlib
import io
import json

import pytest

from jaxrl.data import PromptDataset
from jaxrl.data.tasks import (BUILTIN_TASKS, CODE_OPS, DEFAULT_TASKS, TASKS, demonstration, get_task, make_suite,
                              score)
from jaxrl.rewards import case_keys, code_reward, parse_spec, resolve, reward_fn_for, reward_name
from jaxrl.rewards.code import CodeCase, CodeSpec, extract_program, outputs_match
from models.tokenizer import CharTokenizer


def run_in_process(program: str, stdin: str) -> str:
    """The trusted reference programs, run without the sandbox (fast, for many examples)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(program, {"input": lambda: stdin.rstrip("\n")})   # the programs read one line
    return out.getvalue()


def test_code_is_opt_in_and_routes_to_the_code_reward():
    assert DEFAULT_TASKS == ("add", "copy", "repeat", "reverse", "sort") == tuple(sorted(BUILTIN_TASKS))
    assert "code" not in BUILTIN_TASKS and "code" in TASKS and get_task("code").name == "code"
    rows = list(PromptDataset.builtin(["code"], 6, seed=0))
    assert {r["task"] for r in rows} == {"code"}
    assert reward_fn_for("code") == "code" and reward_name(rows[0]) == "code"
    assert reward_fn_for("copy") == "builtin" and reward_fn_for("math") == "math"


def test_demonstrations_are_correct_on_every_generated_case():
    suite = make_suite(["code"], 300, seed=1)
    assert {ex.prompt.split()[1] for ex in suite} == set(CODE_OPS)
    for ex in suite:
        program = demonstration(ex)
        for t in parse_spec(ex.answer).tests:
            assert run_in_process(program, t.stdin) == t.stdout, (ex, program, t)


def test_prompts_and_demonstrations_fit_the_char_model():
    tok = CharTokenizer()
    for ex in make_suite(["code"], 200, seed=2):
        demo = demonstration(ex)
        assert len(ex.prompt) <= 10 and len(demo) <= 32
        assert tok.decode(tok.encode(ex.prompt + demo)) == ex.prompt + demo


def test_demonstration_scores_one_wrong_scores_zero():
    seen = {}
    for ex in make_suite(["code"], 40, seed=3):
        seen.setdefault(ex.prompt.split()[1], ex)
    assert set(seen) == set(CODE_OPS)
    for ex in seen.values():
        demo = demonstration(ex)
        assert score("code", demo, ex.answer) == 1.0, ex
        assert score("code", f"```python\n{demo}\n```", ex.answer) == 1.0      # fenced responses too
        assert resolve("builtin")(demo, ex.answer, "code") == 1.0              # the task scorer agrees
    ex = seen["add"]
    assert resolve("code")("print(int(input())+100)", ex.answer, "code") == 0.0    # wrong program
    assert resolve("code")("print(int(input()+", ex.answer, "code") == 0.0        # does not parse
    assert resolve("code")("", ex.answer, "code") == 0.0


def test_jsonl_user_code_tasks(tmp_path):
    tests = [{"stdin": "3\n", "stdout": "9\n"}, {"stdin": "5\n", "stdout": "25\n"}]
    lines = [
        {"prompt": "Print n squared.", "task": "code", "answer": {"tests": tests}},                 # object
        {"prompt": "Same, as a string.", "task": "code", "answer": json.dumps({"tests": tests})},    # JSON text
        {"prompt": "Bare list, fraction.", "reward": "code", "task": "sq", "answer": tests},
    ]
    path = tmp_path / "code.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    ds = PromptDataset.from_jsonl(path)
    assert ds.skipped == 0 and [reward_name(r) for r in ds] == ["code"] * 3
    assert parse_spec(ds[0]["answer"]) == parse_spec(ds[1]["answer"]) == parse_spec(ds[2]["answer"]) == \
        CodeSpec((CodeCase("3\n", "9\n"), CodeCase("5\n", "25\n")))
    assert case_keys(ds[0]["answer"]) == case_keys(ds[1]["answer"]) and len(set(case_keys(ds[0]["answer"]))) == 2
    assert code_reward("print(int(input())**2)", ds[0]["answer"]) == 1.0
    half = json.dumps({"tests": tests, "score": "fraction"})
    assert code_reward("n = int(input())\nprint(9 if n == 3 else 0)", half) == 0.5
    assert code_reward("n = int(input())\nprint(9 if n == 3 else 0)", ds[0]["answer"]) == 0.0


@pytest.mark.parametrize("answer, message", [
    ("not json", "not JSON"), ('{"tests": []}', "non-empty 'tests'"), ('{"tests": [{"stdin": "1"}]}', "test 0"),
    ('{"tests": [{"stdout": "1"}], "cmp": "x"}', "unknown keys"),
    ('{"tests": [{"stdout": "1"}], "compare": "fuzzy"}', "compare='fuzzy'"), ('"text"', "must be an object"),
])
def test_schema_errors_say_what_is_wrong(answer, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(answer)


def test_output_comparison_and_program_extraction():
    assert outputs_match("1 \n2\n\n", "1\n2", "lines") and not outputs_match("1\n2", "2\n1", "lines")
    assert outputs_match("1  2\n3", "1 2 3", "tokens") and not outputs_match("1 2", "1 2\n", "exact")
    assert extract_program("Here:\n```python\nprint(1)\n```\nthen ```py\nprint(2)\n```") == "print(1)"
    assert extract_program("  print(3)\n") == "print(3)"
    spec = parse_spec('{"tests": [{"stdout": "x"}], "compare": "exact", "score": "fraction"}')
    assert parse_spec(spec.to_json()) == spec and spec.tests[0].stdin == ""
