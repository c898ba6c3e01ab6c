"""Carried partial responses (`jaxrl.rollout.partial_carry`) and the long-prompt queue that holds them
(`TailBatcher(carry_partial=True)`): which responses a deferred prompt carries, the staleness rule, the packed
form the processes gather and the checkpoint's form, against values written out by hand. The engine side
(`RolloutService.resume`) is tested in tests/test_weight_swap.py, the train runs in tests/test_carry_runs.py."""

import json
import threading

import numpy as np
import pytest

from jaxrl.rollout.partial_carry import Partial, apply_staleness, from_state, pack, select, to_state, unpack
from jaxrl.rollout.tail_batching import TailBatcher


def part(j, n, finished="", version=0):
    return Partial(j, tuple(range(10 + j, 10 + j + n)), tuple(-0.5 * k - j for k in range(n)), (version,) * n,
                   finished)


def test_select_takes_finished_shortest_first_then_the_longest_unfinished():
    got = {0: part(0, 4), 1: part(1, 7, "stop"), 2: part(2, 3, "length"), 3: part(3, 9), 4: part(4, 9)}
    assert [p.sample for p in select(got, 4)] == [2, 1, 3, 4]
    assert [p.sample for p in select(got, 2)] == [2, 1]
    assert select({}, 3) == []


def test_staleness_rule_drops_or_keeps_and_counts():
    fresh, old = part(0, 3, version=5), Partial(1, (1, 2, 3), (-1.0, -1.0, -1.0), (2, 2, 4))
    assert apply_staleness([fresh, old], 6, 2, "drop") == ([fresh], {"dropped": 1, "corrected": 0})
    assert apply_staleness([fresh, old], 6, 2, "correct") == ([fresh, old], {"dropped": 0, "corrected": 1})
    assert apply_staleness([fresh, old], 6, 4, "drop") == ([fresh, old], {"dropped": 0, "corrected": 0})
    with pytest.raises(ValueError, match="stale_samples='keep'; valid choices: drop, correct"):
        apply_staleness([fresh], 6, 2, "keep")


def test_pack_unpack_and_the_checkpoint_form_round_trip_exactly():
    parts = [part(3, 5, "stop"), Partial(1, (7, 8), (-0.1234567891234, -2.0), (0, 1))]
    ints, floats = pack(parts, 4, 6)
    assert ints.shape == (4, 15) and floats.shape == (4, 6) and list(ints[:, 0]) == [3, 1, -1, -1]
    assert unpack(ints, floats) == parts
    assert from_state(json.loads(json.dumps(to_state(parts)))) == parts
    assert parts[1].spans() == [(0, 0), (1, 1)]
    with pytest.raises(ValueError, match="7 tokens > max_tokens=6"):
        pack([part(0, 7)], 4, 6)
    with pytest.raises(ValueError, match="2 tokens, 1 log-probs and 2 versions"):
        Partial(0, (1, 2), (0.0,), (0, 0))




def test_the_queue_carries_each_prompts_partials_to_the_long_round_in_every_process():
    """P0 = 4, 2 processes: each short round defers prompts on both; the long round deals the queue by position,
    and each dealt prompt comes with the partials the other process may have sampled, and its deferral step."""
    rows = [{"index": i} for i in range(100)]
    dataset = {i: {"q": i} for i in range(100)}
    calls, buf = [], {}
    tails = [TailBatcher(4, 2, eta_prompts=2.0, eta_responses=1.0, process_index=r, process_count=2,
                         carry_partial=True, max_tokens=8) for r in range(2)]
    draws = {0: [rows[0:4], rows[8:12]], 1: [rows[4:8], rows[12:16]]}
    plans = [t.plan(lambda r=r: draws[r].pop(0), dataset, 0) for r, t in enumerate(tails)]
    assert [p.kind for p in plans] == ["short", "short"] and plans[0].carried is None
    # rank 0 keeps its prompts 0 and 2 and defers 1 and 3; rank 1 keeps 1 and 2 and defers 0 and 3
    partials = [{1: [part(0, 2, version=0)], 3: [part(1, 8, "stop", version=0), part(0, 1, version=0)]},
                {0: [part(1, 3, version=0)], 3: []}]
    accepted = [[0, 2], [1, 2]]
    # the two settles run side by side: each gather returns both ranks' arrays once both arrived
    results = [None, None]
    barrier = threading.Barrier(2)

    def settle(r):
        def g(a):
            barrier.wait()
            key = ("g", len([c for c in calls if c[0] == r]))
            calls.append((r, key))
            buf.setdefault(key, {})[r] = np.asarray(a)
            barrier.wait()
            return np.stack([buf[key][0], buf[key][1]])
        tails[r].gather = g
        results[r] = tails[r].settle(plans[r], accepted[r], 0, partials=partials[r])
    threads = [threading.Thread(target=settle, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert results[0] == results[1] == [1, 3, 4, 7]            # global, by dataset index
    for t in tails:
        assert t.queue == [(0, 1), (0, 3), (0, 4), (0, 7)]
        assert t.carried == [partials[0][1], partials[0][3], partials[1][0], []]
        assert [from_state(c) for c in json.loads(json.dumps(t.state_dict()))["carried"]] == t.carried
    longs = [t.plan(lambda: pytest.fail("a long round draws nothing"), dataset, 1) for t in tails]
    assert [p.kind for p in longs] == ["long", "long"]
    assert [r["index"] for r in longs[0].rows] == [1, 4] and [r["index"] for r in longs[1].rows] == [3, 7]
    assert longs[0].carried == [(0, partials[0][1]), (0, partials[1][0])]
    assert longs[1].carried == [(0, partials[0][3]), (0, [])]
    fresh = TailBatcher(4, 2, eta_prompts=2.0, eta_responses=1.0, carry_partial=True, max_tokens=8)
    fresh.load_state_dict({"queue": [[0, 5]], "rounds": {"short": 1, "long": 0}})     # an older checkpoint
    assert fresh.carried == [[]]
