"""StreamRL's output-length ranker (jaxrl/rollout/ranker.py): metrics against brute force, learning a
monotone rule, exact state round trips, the history buffer and its stable split, pair files, and no
recompilation after the first refresh/predict."""

import itertools
import json
import math

import jax
import numpy as np
import pytest

from jaxrl.rollout.ranker import LengthRanker, kendall_tau, recall_top
from jaxrl.runtime import CompileCounter

SMALL = dict(d_model=32, layers=1, heads=2, batch=32, train_steps=100, buckets=64, lr=3e-3)
T = 24


def synthetic(n: int, seed: int):
    """length = 3 x (count of token 7) + noise in {0, 1}: a monotone rule a ranker must count to learn.
    (A predictor that knows the count but not the noise has tau ~ 0.87 here: within a count, its order
    against the noise is a coin flip.)"""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 8, size=int(rng.integers(4, T + 1))).tolist() for _ in range(n)]
    return prompts, [3 * p.count(7) + int(rng.integers(0, 2)) for p in prompts]


def brute_tau(x, y):
    c = d = tx = ty = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        a, b = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
        c, d = c + (a * b > 0), d + (a * b < 0)
        tx, ty = tx + (a == 0), ty + (b == 0)
    n0 = len(x) * (len(x) - 1) / 2
    return (c - d) / math.sqrt((n0 - tx) * (n0 - ty))


def test_kendall_tau_matches_brute_force_with_ties():
    rng = np.random.default_rng(0)
    for n in (2, 5, 40, 700):
        x, y = rng.integers(0, 6, n), rng.integers(0, 4, n) + 0.5 * rng.integers(0, 2, n)
        if len(set(x)) > 1 and len(set(y)) > 1:
            assert kendall_tau(x, y) == pytest.approx(brute_tau(x, y), abs=1e-12)
    x = rng.normal(size=50)
    assert kendall_tau(x, x) == pytest.approx(1.0) and kendall_tau(x, -x) == pytest.approx(-1.0)
    assert math.isnan(kendall_tau([1.0], [2.0])) and math.isnan(kendall_tau([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="3 values"):
        kendall_tau([1, 2, 3], [1, 2])


def test_recall_top_hand_cases():
    true = [1, 9, 3, 8, 2, 7, 4, 6, 5, 0]               # top 20% (k = 2): indices 1, 3
    assert recall_top([0, 5, 0, 4, 0, 0, 0, 0, 0, 0], true) == 1.0
    assert recall_top([0, 5, 0, 0, 0, 4, 0, 0, 0, 0], true) == 0.5
    assert recall_top(true, true, frac=0.3) == 1.0 and recall_top(true[::-1], true, frac=0.1) == 0.0
    # ties in true break by index: top-1 of [5, 5, 1] is index 0, so predicting index 1 scores 0
    assert recall_top([0, 1, 0], [5, 5, 1], frac=0.3) == 0.0 and recall_top([1, 0, 0], [5, 5, 1], frac=0.3) == 1.0
    assert recall_top([1, 2, 3], [1, 2, 3], frac=0.01) == 1.0            # k = ceil(0.03) = 1
    assert math.isnan(recall_top([], []))


def test_learns_monotone_rule_and_beats_random():
    r = LengthRanker(T, **SMALL, seed=1)
    assert not r.trained and np.all(r.predict([[7, 7], [3]]) == 0)     # untrained: zeros
    prompts, lengths = synthetic(600, 0)
    r.observe(prompts, lengths)
    r.refresh()
    stats = r.refresh()
    assert stats["refreshes"] == 2 and stats["pairs"] == 600 and 80 < stats["heldout"] < 160
    assert stats["kendall_tau"] > 0.8 and stats["recall_top20"] > 0.7, stats
    test_p, test_l = synthetic(300, 99)                                 # prompts never observed
    pred = r.predict(test_p)
    assert pred.dtype == np.float64 and pred.shape == (300,) and r.trained
    assert kendall_tau(pred, test_l) > 0.8
    rand = np.random.default_rng(0).random(300)
    assert kendall_tau(pred, test_l) > kendall_tau(rand, test_l) + 0.5
    assert recall_top(pred, test_l) > recall_top(rand, test_l)


def test_state_dict_round_trip_is_bit_identical():
    a = LengthRanker(T, **SMALL, seed=3)
    prompts, lengths = synthetic(300, 1)
    a.observe(prompts[:200], lengths[:200])
    a.refresh()
    b = LengthRanker(T, **SMALL, seed=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.trained and b.refreshes == a.refreshes and b.count == a.count
    assert np.array_equal(a.predict(prompts), b.predict(prompts))
    for r in (a, b):                                          # the next refresh continues identically
        r.observe(prompts[200:], lengths[200:])
    ma, mb = a.refresh(), b.refresh()
    assert {k: v for k, v in ma.items() if k != "seconds"} == {k: v for k, v in mb.items() if k != "seconds"}
    leaves = [jax.tree_util.tree_leaves((r.params, r.opt_state)) for r in (a, b)]
    for x, y in zip(*leaves):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    c = LengthRanker(T, **{**SMALL, "d_model": 16}, seed=3)
    with pytest.raises(ValueError, match="d_model=32"):
        c.load_state_dict(a.state_dict())


def test_history_ring_buffer_and_stable_split():
    r = LengthRanker(4, **SMALL, history=10)
    r.observe([[i, i + 1, i + 2, i + 3, i + 4] for i in range(15)], list(range(15)))
    serials, toks, lens = r.pairs()
    assert serials.tolist() == list(range(5, 15)) and lens.tolist() == list(range(5, 15))
    assert toks[0] == [6, 7, 8, 9]                      # truncation keeps the last max_prompt_len tokens
    with pytest.raises(ValueError, match="2 prompts but 1 lengths"):
        r.observe([[1], [2]], [3])
    with pytest.raises(ValueError, match="lengths must be ints >= 0"):
        r.observe([[1]], [-1])
    assert r.count == 15                                # rejected calls change nothing
    big = LengthRanker(4, **SMALL, history=100000, holdout=0.2)
    before = big.heldout_mask(np.arange(1000))
    after = big.heldout_mask(np.arange(5000))           # more pairs arrive: earlier ones keep their side
    assert np.array_equal(before, after[:1000]) and 0.17 < after.mean() < 0.23


def test_few_pairs_and_argument_checks():
    r = LengthRanker(T, **SMALL)
    r.observe([[1, 2], [3]], [4, 5])
    stats = r.refresh()
    assert math.isnan(stats["kendall_tau"]) and math.isnan(stats["recall_top20"]) and stats["refreshes"] == 0
    assert not r.trained and r.predict([[1]]).tolist() == [0.0]
    for bad, match in ((dict(heads=3), "divisible"), (dict(holdout=1.0), "holdout"), (dict(batch=0), "batch"),
                       (dict(lr=-1.0), "lr")):
        with pytest.raises(ValueError, match=match):
            LengthRanker(T, **{**SMALL, **bad})


def test_pairs_file_round_trip_and_bad_line(tmp_path):
    r = LengthRanker(T, **SMALL)
    prompts, lengths = synthetic(20, 2)
    r.observe(prompts, lengths)
    path = tmp_path / "pairs.jsonl"
    assert r.save_pairs(path) == 20
    s = LengthRanker(T, **SMALL)
    assert s.load_pairs(path) == 20
    assert s.pairs()[1] == prompts and s.pairs()[2].tolist() == lengths
    path.write_text('{"tokens": [1, 2], "length": 3, "task": "x"}\n\n{"tokens": [1], "length": 2}\n'
                    '{"tokens": [1, "a"], "length": 2}\n')
    with pytest.raises(ValueError, match=r"pairs.jsonl:4: bad pair row"):
        LengthRanker(T, **SMALL).load_pairs(path)
    path.write_text('{"tokens": [1], "length": 2}\n{"tokens": [1]}\n')
    with pytest.raises(ValueError, match=r"pairs.jsonl:2: .*KeyError"):
        LengthRanker(T, **SMALL).load_pairs(path)


def test_refresh_and_predict_do_not_recompile():
    r = LengthRanker(T, **{**SMALL, "train_steps": 5})
    prompts, lengths = synthetic(200, 3)
    r.observe(prompts[:100], lengths[:100])
    counter = CompileCounter()
    r.refresh()
    r.predict(prompts[:7])
    counter.take()
    r.observe(prompts[100:], lengths[100:])             # more pairs, other held-out size, other predict sizes
    r.refresh()
    r.predict(prompts[:45])
    r.predict(prompts[:1])
    late = counter.names()
    assert counter.take()["compiles"] == 0, late
