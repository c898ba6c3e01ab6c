"""jaxrl.rewards: math verifier (math-verify), registry, and the process pool's timeout/crash handling.

One module-scoped pool (2 workers, 1 s timeout) serves the pool tests; the misbehaving functions live in
`jaxrl.rewards._testing` because worker processes must import them. Wall-time bounds below are guards
against a hang, not performance assertions.
"""

import time

import numpy as np
import pytest

from jaxrl.data import tasks
from jaxrl.rewards import REWARD_FNS, RewardPool, RewardResult, math_reward, resolve, reward_fn_for

T = "jaxrl.rewards._testing:"
TIMEOUT_S = 1.0
SLACK_S = 5.0


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=TIMEOUT_S) as p:
        yield p


# ------------------------------------------------------------------------------------- math verifier
@pytest.mark.parametrize("response, answer, expected", [
    ("\\boxed{0.5}", "1/2", 1.0),                                      # numeric equivalence
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("The answer is 42", "42", 1.0),                                    # no \boxed: answer pattern
    ("We get 3, then 5, so the answer is 8.", "8", 1.0),
    ("The answer is 41", "42", 0.0),                                    # wrong
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),                              # symbolic equivalence
    ("so it is $x^2+2x+1$", "(x+1)^2", 1.0),
    ("\\boxed{x^2+2x}", "(x+1)^2", 0.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("The final answer is 5. Actually \\boxed{7}", "7", 1.0),           # \boxed{} wins over other patterns
    ("\\boxed{7}", "$7$", 1.0),                                         # gold with delimiters as given
    ("\\boxed{x = 3}", "3", 1.0),                                       # equation vs value
    ("\\boxed{\\pi}", "3.14159265", 1.0),
    ("\\boxed{3.14}", "\\pi", 0.0),
    ("asdf qwer", "42", 0.0),                                           # garbage / empty / malformed
    ("", "42", 0.0),
    ("\\boxed{{", "1", 0.0),
    ("\\boxed{1}", "}{", 0.0),                                          # unparsable gold
])
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_math_reward_outside_main_thread():
    """math-verify's signal timeouts need the main thread; elsewhere they are switched off, not raised."""
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("\\boxed{\\frac{1}{2}}", "0.5")))
    t.start()
    t.join()
    assert out == [1.0]


# ------------------------------------------------------------------------------------- registry
def test_registry():
    assert set(REWARD_FNS) == {"math", "builtin", "code"}
    assert reward_fn_for("math") == "math"
    assert reward_fn_for("copy") == reward_fn_for("add") == "builtin"
    assert resolve("math")("\\boxed{2}", "2", "math") == 1.0
    assert resolve(T + "raise_error").__name__ == "raise_error"
    with pytest.raises(KeyError, match="unknown reward 'mathh'; registered: builtin, code, math"):
        resolve("mathh")
    with pytest.raises(KeyError, match="has no function 'no_such_fn'"):
        resolve("jaxrl.rewards._testing:no_such_fn")
    with pytest.raises(KeyError, match="cannot import module 'jaxrl.no_such_module'"):
        resolve("jaxrl.no_such_module:fn")


def test_builtin_fn_matches_task_scorer():
    fn = resolve(reward_fn_for("reverse"))
    assert fn("cba", "cba", "reverse") == 1.0
    for response in ["cb", "cbx", ""]:
        assert fn(response, "cba", "reverse") == pytest.approx(tasks.score("reverse", response, "cba"))


# ------------------------------------------------------------------------------------- pool
def test_pool_scores_match_in_process(pool):
    items = [("math", "\\boxed{0.5}", "1/2", "math"), ("math", "The answer is 41", "42", "math"),
             ("math", "\\boxed{x^2+2x+1}", "(x+1)^2", "math"), ("math", "garbage", "7", "math"),
             ("builtin", "cba", "cba", "reverse"), ("builtin", "cbx", "cba", "reverse")]
    expected = np.asarray([resolve(f)(r, a, t) for f, r, a, t in items], np.float32)
    np.testing.assert_allclose(expected, [1, 0, 1, 0, 1, tasks.score("reverse", "cbx", "cba")], rtol=1e-6)
    t0 = time.monotonic()
    scores, stats = pool.score(items)
    wall = time.monotonic() - t0
    assert scores.dtype == np.float32 and scores.shape == (len(items),)
    np.testing.assert_allclose(scores, expected)
    assert stats["timeouts"] == 0 and stats["crashes"] == 0 and 0 < stats["seconds"] <= wall   # this call's time
    assert pool.score([])[0].shape == (0,)


def test_pool_hang_times_out_and_pool_recovers(pool):
    t0, c0 = pool.total_timeouts, pool.total_crashes
    start = time.monotonic()
    # one worker hangs; the other keeps scoring the rest of the batch meanwhile
    items = [(T + "sleep_forever", "", "", "")] + [("math", "\\boxed{2}", "2", "math")] * 4
    scores, stats = pool.score(items)
    wall = time.monotonic() - start
    assert wall < TIMEOUT_S + SLACK_S, f"hang guard: {wall:.1f}s"
    assert wall >= TIMEOUT_S * 0.9  # it really waited for the timeout, no earlier
    assert scores.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert stats["timeouts"] == 1 and stats["crashes"] == 0
    assert (pool.total_timeouts, pool.total_crashes) == (t0 + 1, c0)
    # the killed worker was replaced: both workers serve again
    scores, stats = pool.score([("math", "\\boxed{3}", "3", "math")] * 4)
    assert scores.tolist() == [1.0] * 4 and stats["timeouts"] == stats["crashes"] == 0


@pytest.mark.parametrize("fn", ["crash_exit", "segfault", "raise_error", "return_nan"])
def test_pool_crash_scores_zero_and_pool_recovers(pool, fn):
    t0, c0 = pool.total_timeouts, pool.total_crashes
    start = time.monotonic()
    scores, stats = pool.score([(T + fn, "", "", ""), ("math", "\\boxed{2}", "2", "math")])
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S
    assert scores.tolist() == [0.0, 1.0]
    assert stats["crashes"] == 1 and stats["timeouts"] == 0
    assert (pool.total_timeouts, pool.total_crashes) == (t0, c0 + 1)
    scores, _ = pool.score([("math", "\\boxed{5}", "5", "math")] * 3)
    assert scores.tolist() == [1.0] * 3


def test_pool_results_carry_the_cause(pool):
    """A failed result says why (the trainer reports the first one when every reward of a step fails)."""
    want = {"crash_exit": "worker died (exit code 3)", "segfault": "worker died (killed by SIGSEGV)",
            "raise_error": "RuntimeError: deliberate failure in a reward fn",
            "return_nan": "ValueError: non-finite score nan"}
    ids = {pool.submit((T + fn, "", "", "")): fn for fn in want}
    ids[pool.submit((T + "sleep_forever", "", "", ""), timeout_s=0.2)] = "sleep_forever"
    ids[pool.submit(("math", "\\boxed{2}", "2", "math"))] = "math"
    got = []
    start = time.monotonic()
    while pool.num_pending and time.monotonic() - start < TIMEOUT_S + SLACK_S:
        got += pool.poll(timeout=0.2)
    errors = {ids[r.id]: (r.status, r.error) for r in got}
    assert errors == {**{fn: ("crash", e) for fn, e in want.items()},
                      "sleep_forever": ("timeout", "timed out after 0.2s"), "math": ("ok", "")}


def test_pool_streaming(pool):
    # (the workers replaced after the earlier tests' timeouts up first: a fast item waiting for a worker
    # that is still starting finished after the 0.6 s one, twice on a loaded 2-core VM)
    assert pool.wait_ready()
    slow = pool.submit((T + "sleep_then_one", "0.6", "", ""))
    fast = pool.submit((T + "sleep_then_one", "0.0", "", ""))
    hang = pool.submit((T + "sleep_forever", "", "", ""), timeout_s=0.3)  # per-item timeout
    ok = pool.submit(("math", "\\boxed{1/2}", "0.5", "math"))
    assert pool.num_pending == 4
    got: list[RewardResult] = []
    start = time.monotonic()
    while pool.num_pending and time.monotonic() - start < TIMEOUT_S + SLACK_S:
        got += pool.poll(timeout=0.2)
    assert pool.num_pending == 0 and len(got) == 4
    by_id = {r.id: r for r in got}
    assert by_id[slow] == (slow, 1.0, "ok", "") and by_id[fast] == (fast, 1.0, "ok", "")
    assert by_id[hang] == (hang, 0.0, "timeout", "timed out after 0.3s") and by_id[ok] == (ok, 1.0, "ok", "")
    order = [r.id for r in got]
    assert order.index(fast) < order.index(slow)  # completion order, not submission order
    assert pool.poll() == []


def test_pool_trickled_submits_start_at_once(pool):
    """Items submitted one by one while results stream back (the trainer's pattern) are each picked up
    at once: a lost wake-up of the dispatcher leaves items waiting for its 1 s tick instead."""
    sent, latency = {}, []
    for k in range(150):
        sent[pool.submit(("builtin", "abc", "abc", "copy"))] = time.monotonic()
        for r in pool.poll():
            latency.append(time.monotonic() - sent.pop(r.id))
        time.sleep(0.002 * (k % 3))
    while sent:
        for r in pool.poll(timeout=0.2):
            latency.append(time.monotonic() - sent.pop(r.id))
    assert max(latency) < 0.5, f"slowest item waited {max(latency):.2f} s"


def test_pool_streaming_and_batch_do_not_steal_results(pool):
    i = pool.submit(("math", "\\boxed{9}", "9", "math"))
    scores, _ = pool.score([("math", "\\boxed{8}", "9", "math")])
    assert scores.tolist() == [0.0]
    got = []
    while pool.num_pending:
        got += pool.poll(timeout=0.2)
    assert got == [RewardResult(i, 1.0, "ok")]


def test_pool_rejects_bad_input(pool):
    with pytest.raises(KeyError, match="unknown reward 'nope'"):
        pool.submit(("nope", "", "", ""))
    with pytest.raises(ValueError, match="timeout_s"):
        pool.submit(("math", "", "", ""), timeout_s=0)
    with pytest.raises(ValueError, match="not 'fork'"):
        RewardPool(start_method="fork")
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool(num_workers=-1)


def test_in_process_pool():
    with RewardPool(num_workers=0) as p:
        scores, stats = p.score([("math", "\\boxed{2}", "2", "math"), (T + "raise_error", "", "", ""),
                                 (T + "return_nan", "", "", "")])
        assert scores.tolist() == [1.0, 0.0, 0.0] and stats["crashes"] == 2 and p.total_crashes == 2
        i = p.submit(("math", "\\boxed{3}", "3", "math"))
        assert p.poll() == [RewardResult(i, 1.0, "ok")]


def test_close_kills_workers_and_refuses_work():
    p = RewardPool(num_workers=1, timeout_s=30.0).start()
    p.submit((T + "sleep_forever", "", "", ""))  # in flight at close: dropped, its worker killed
    time.sleep(0.2)
    procs = [w.proc for w in p._workers]
    start = time.monotonic()
    p.close()
    assert time.monotonic() - start < SLACK_S
    assert not any(pr.is_alive() for pr in procs)
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(("math", "", "", ""))
    p.close()  # idempotent
