"""Built-in tasks: deterministic generation, verifiable rewards with partial credit, long-tailed lengths."""

import pickle
import string
import subprocess
import sys

import numpy as np
import pytest

from jaxrl.data import tasks
from jaxrl.data.tasks import BUILTIN_TASKS, Example, make_suite, prefix_score, score
from models.tokenizer import CharTokenizer

NAMES = sorted(BUILTIN_TASKS)


@pytest.fixture(scope="module")
def suites():
    return {name: make_suite([name], 2000, seed=7) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_make_is_deterministic_by_seed(name):
    t = BUILTIN_TASKS[name]
    a = [t.make(np.random.default_rng(3)) for _ in range(5)]
    b = [t.make(np.random.default_rng(3)) for _ in range(5)]
    assert a == b
    assert make_suite([name], 50, 1) == make_suite([name], 50, 1)
    assert make_suite([name], 50, 1) != make_suite([name], 50, 2)
    assert all(ex.task == name for ex in a)


def test_suite_cycles_tasks_and_is_a_prefix():
    s = make_suite(NAMES, 30, 0)
    assert [ex.task for ex in s] == [NAMES[i % len(NAMES)] for i in range(30)]
    assert make_suite(NAMES, 20, 0) == s[:20]
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        make_suite(["nope"], 3, 0)


@pytest.mark.parametrize("name", NAMES)
def test_demonstration_scores_one_and_wrong_scores_less(name, suites):
    t = BUILTIN_TASKS[name]
    for ex in suites[name][:200]:
        demo = t.demonstration(ex)
        assert score(name, demo, ex.answer) == 1.0
        assert score(name, f"  {demo}\n", ex.answer) == 1.0          # whitespace is stripped
        assert score(name, demo + "x", ex.answer) < 1.0               # does not stop
        assert score(name, demo[:-1], ex.answer) < 1.0                # stops early
        wrong = demo[:-1] + ("0" if demo[-1] != "0" else "1")
        assert 0.0 <= score(name, wrong, ex.answer) < 1.0
        assert score(name, "", ex.answer) == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_partial_credit_is_monotone_in_correct_prefix(name, suites):
    ex = max(suites[name], key=lambda e: len(e.answer))
    a = ex.answer
    scores = [score(name, a[:k] + "".join("#" for _ in a[k:]), a) for k in range(len(a) + 1)]
    assert scores[0] == 0.0 and scores[-1] == 1.0
    assert all(x < y for x, y in zip(scores, scores[1:]))
    assert all(0.0 <= s <= 1.0 for s in scores)


@pytest.mark.parametrize("name", NAMES)
def test_answers_are_correct(name, suites):
    for ex in suites[name][:300]:
        word, *args = ex.prompt.split(" ")
        expected = {
            "copy": lambda: args[0],
            "reverse": lambda: args[0][::-1],
            "sort": lambda: "".join(sorted(args[0])),
            "repeat": lambda: args[0] * int(args[1]),
            "add": lambda: str(sum(int(x) for x in args[0].split("+"))),
        }[name]()
        assert ex.answer == expected, ex


@pytest.mark.parametrize("name", NAMES)
def test_response_lengths_are_long_tailed(name, suites):
    lengths = np.array([len(ex.answer) for ex in suites[name]])
    med, p99 = np.median(lengths), np.percentile(lengths, 99)
    assert 2 <= med <= 10
    assert p99 >= 4 * med, (name, med, p99)
    assert lengths.max() <= tasks.MAX_ANSWER_CHARS


@pytest.mark.parametrize("name", NAMES)
def test_all_chars_in_char_tokenizer_vocab(name, suites):
    tok = CharTokenizer()
    allowed = set(string.printable) - set("\t\n\r\x0b\x0c")
    for ex in suites[name]:
        assert set(ex.prompt) <= allowed and set(ex.answer) <= allowed, ex
        assert tok.decode(tok.encode(ex.prompt + ex.answer)) == ex.prompt + ex.answer


def test_score_is_picklable_and_needs_no_jax():
    assert pickle.loads(pickle.dumps(score)) is score
    code = ("import sys, jaxrl.data.tasks as t; "
            "assert t.score('copy', 'ab', 'ab') == 1.0; "
            "assert 'jax' not in sys.modules, 'jaxrl.data pulled in jax'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_score_unknown_task_and_prefix_edge_cases():
    with pytest.raises(KeyError, match="built-in tasks"):
        score("math", "4", "4")
    assert prefix_score("", "") == 1.0
    assert prefix_score("abc", "abd") == pytest.approx(2 / 3)
    assert prefix_score("abcdef", "abc") == pytest.approx(0.5)
    assert Example("p", "a", "copy") == Example("p", "a", "copy")
