"""RollPacker's parallelism planner: the rule (table-driven), candidates, checkpoint state, the config section,
and a real run whose pool is small enough to preempt at TP1: TP goes up, and down again after 4 calm steps,
with the same tokens as a static-layout run."""

import dataclasses
import json
import logging

import jax
import numpy as np
import pytest

from jaxrl.config import ConfigError, decode
from jaxrl.config.planner import PlannerSection
from jaxrl.rollout import RolloutService, SamplingParams
from jaxrl.rollout.memory import page_bytes_per_device
from jaxrl.rollout.migration import buffers
from jaxrl.rollout.planner import Decision, RolloutLayout, TPPlanner, apply, candidate_tps, total_preemptions
from models import PRESETS, init
from sharding import Layout

CFG = PRESETS["tiny-qwen3"]                               # 8 heads, 2 kv heads (replicated beyond tp=2)
SIX_HEADS = dataclasses.replace(CFG, num_heads=6)         # heads 6: tp 4 and 8 do not divide
LOGPROB_ATOL_F32 = 1e-4

# Each row: (id, pool devices, model, start_tp, max_tp, steps); a step is (round type, preemptions,
# expected TP of that round type's next step, a word of the logged reason).
RULE_TABLE = [
    ("first-step-preempting-is-a-rise", 8, CFG, 1, None, [("short", 3, 2, "rose")]),
    ("first-step-calm", 8, CFG, 1, None, [("short", 0, 1, "1/4 calm")]),
    ("rise-must-exceed-1.05x", 8, CFG, 2, None,
     [("short", 100, 4, "rose"), ("short", 105, 4, "not > 1.05x"), ("short", 111, 8, "rose")]),
    ("falling-but-nonzero-holds", 8, CFG, 2, None,
     [("short", 10, 4, "rose"), ("short", 8, 4, "stays"), ("short", 8, 4, "stays"), ("short", 9, 8, "rose")]),
    ("four-calm-steps-halve-then-four-more", 8, CFG, 4, None,
     [("short", 0, 4, "1/4"), ("short", 0, 4, "2/4"), ("short", 0, 4, "3/4"), ("short", 0, 2, "4 consecutive"),
      ("short", 0, 2, "1/4"), ("short", 0, 2, "2/4"), ("short", 0, 2, "3/4"), ("short", 0, 1, "4 consecutive"),
      ("short", 0, 1, "1/4"), ("short", 0, 1, "2/4"), ("short", 0, 1, "3/4"), ("short", 0, 1, "smallest")]),
    ("a-preemption-restarts-the-calm-count", 8, CFG, 2, None,
     [("short", 0, 2, "1/4"), ("short", 0, 2, "2/4"), ("short", 0, 2, "3/4"), ("short", 1, 4, "rose"),
      ("short", 0, 4, "1/4"), ("short", 0, 4, "2/4"), ("short", 0, 4, "3/4"), ("short", 0, 2, "4 consecutive")]),
    ("halving-that-preempts-doubles-back", 8, CFG, 2, None,
     [("short", 0, 2, "1/4"), ("short", 0, 2, "2/4"), ("short", 0, 2, "3/4"), ("short", 0, 1, "4 consecutive"),
      ("short", 2, 2, "rose")]),
    ("at-pool-size-no-rise", 8, CFG, 8, None, [("short", 10, 8, "largest"), ("short", 20, 8, "largest")]),
    ("max-tp-caps", 8, CFG, 2, 2, [("short", 5, 2, "largest")]),
    ("round-types-independent", 8, CFG, 1, None,
     [("short", 5, 2, "rose"), ("long", 0, 1, "1/4 calm"), ("short", 5, 2, "not > 1.05x"), ("long", 1, 2, "rose"),
      ("long", 3, 4, "rose"), ("short", 6, 4, "rose"), ("sync", 0, 1, "1/4 calm")]),
    ("heads-that-do-not-divide", 8, SIX_HEADS, 2, None, [("short", 4, 2, "largest")]),
    ("pool-of-six", 6, CFG, 1, None, [("short", 4, 2, "rose"), ("short", 9, 2, "largest")]),
]


@pytest.mark.parametrize("row", RULE_TABLE, ids=[r[0] for r in RULE_TABLE])
def test_rule_table(row, caplog):
    _, devices, cfg, start, max_tp, steps = row
    planner = TPPlanner(devices, cfg, start, max_tp=max_tp)
    tps = {}
    with caplog.at_level(logging.INFO, logger="jaxrl.rollout.planner"):
        for round_type, count, want_tp, word in steps:
            before = tps.get(round_type, start)
            assert planner.layout_for(round_type).tp == before
            d = planner.decide(round_type, count)
            assert (d.tp, d.instances, d.changed) == (want_tp, devices // want_tp, want_tp != before), d
            assert word in d.reason, d.reason
            mine = [r for r in caplog.records if r.name == "jaxrl.rollout.planner"]
            assert d.reason in mine[-1].getMessage()
            tps[round_type] = want_tp
            assert planner.layout_for(round_type) == RolloutLayout(want_tp, devices // want_tp)
    assert len([r for r in caplog.records if r.name == "jaxrl.rollout.planner"]) == len(steps)


def test_candidates():
    assert candidate_tps(8, CFG) == [1, 2, 4, 8]                     # kv heads replicate beyond 2
    assert candidate_tps(8, SIX_HEADS) == [1, 2]                     # 6 heads: 4 does not divide
    assert candidate_tps(8, PRESETS["qwen2.5-7b"]) == [1, 2, 4]      # 28 heads
    assert candidate_tps(6, CFG) == [1, 2]                           # 4 does not divide the pool
    assert candidate_tps(8, CFG, max_tp=4) == [1, 2, 4]
    with pytest.raises(ValueError, match=r"start_tp=4 .*candidates for 8 devices and this model: \[1, 2\]"):
        TPPlanner(8, SIX_HEADS, 4)
    with pytest.raises(ValueError, match="divide the pool's 6 devices"):
        TPPlanner(6, CFG, 4)
    with pytest.raises(ValueError, match="non-negative int"):
        TPPlanner(8, CFG, 1).decide("short", -1)


def test_layouts_whose_pool_cannot_hold_a_request_are_not_candidates():
    """`fits`: the calm rule stops at the smallest TP whose instance holds one max_seq_len request (the
    simulator found TP2 -> TP1 on a 32B model leaving a pool of 588 pages for a 2064-page request); the
    memory check is `rollout.memory.holds_request` on abstract weights."""
    import jax

    from jaxrl.rollout.memory import holds_request

    planner = TPPlanner(8, CFG, 2, fits=lambda tp: tp >= 2)
    assert planner.candidates == [2, 4, 8]
    for _ in range(4):
        d = planner.decide("short", 0)
    assert d.tp == 2 and "smallest candidate" in d.reason
    with pytest.raises(ValueError, match="cannot hold a max_seq_len request"):
        TPPlanner(8, CFG, 1, fits=lambda tp: tp >= 2)
    # the engine's own count: tiny-qwen3 in float32 is 0.66 MB of weights
    kw = dict(page_size=16, dtype="float32", max_seq_len=1024)
    one, two = jax.devices()[:1], jax.devices()[:2]
    budget = 1_000_000                    # tp 1: 21 pages of 16 tokens; tp 2 (half the weights, half a page): 83
    assert not holds_request(CFG, one, budget=budget, **kw) and holds_request(CFG, two, budget=budget, **kw)


def test_state_dict_resumes_identically():
    counts = [("short", 4), ("long", 0), ("short", 0), ("short", 0), ("long", 2), ("short", 0), ("short", 0),
              ("short", 7), ("long", 0)]
    whole = TPPlanner(8, CFG, 1)
    want = [whole.decide(rt, n) for rt, n in counts]
    first = TPPlanner(8, CFG, 1)
    got = [first.decide(rt, n) for rt, n in counts[:5]]
    resumed = TPPlanner(8, CFG, 1)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += [resumed.decide(rt, n) for rt, n in counts[5:]]
    assert got == want
    assert resumed.state_dict() == whole.state_dict() and resumed.metrics() == whole.metrics()
    with pytest.raises(ValueError, match="candidates"):
        TPPlanner(8, CFG, 1, max_tp=1).load_state_dict(whole.state_dict())   # short and long are at TP 2


def test_metrics():
    planner = TPPlanner(8, CFG, 2)
    assert planner.metrics() == {}
    planner.decide("short", 3)
    planner.decide("long", 0)
    assert planner.metrics() == {"planner/tp": 2, "planner/instances": 4, "planner/changed": 0,
                                 "planner/preemptions": 0,
                                 "planner/long/tp": 2, "planner/long/instances": 4, "planner/long/calm_steps": 1,
                                 "planner/long/preemptions": 0,
                                 "planner/short/tp": 4, "planner/short/instances": 2, "planner/short/calm_steps": 0,
                                 "planner/short/preemptions": 3}


def test_config_section():
    s = decode(PlannerSection, {"enabled": True, "rise": 1.1, "calm_steps": 3, "max_tp": 4})
    assert s == PlannerSection(enabled=True, rise=1.1, calm_steps=3, max_tp=4)
    assert TPPlanner.from_config(PlannerSection(), 8, CFG, 1) is None
    p = TPPlanner.from_config(s, 8, CFG, 2)
    assert (p.rise, p.calm_steps, p.candidates) == (1.1, 3, [1, 2, 4])
    for bad, key in (({"rise": 0.9}, "rise"), ({"calm_steps": 0}, "calm_steps"), ({"max_tp": 0}, "max_tp"),
                     ({"enabled": 1}, "enabled"), ({"tp_max": 2}, "tp_max")):
        with pytest.raises(ConfigError) as e:
            decode(PlannerSection, bad)
        assert e.value.key == key


# ---------------------------------------------------------------------- a real run on a small pool
PROMPT_LENS = (3, 9, 16, 17, 30, 5)
# Seed 12 is the one tests/test_movable_state.py found free of float32 knife-edge draws across layouts.
PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, n=3, seed=12)
STEPS = 6


def test_small_pool_raises_tp_then_lowers_it():
    """Two devices; the budget leaves a TP1 instance 11 pages (18 sequences over two instances preempt) and
    the TP2 instance ~100 (its weight shard halves and its KV heads shard): the planner goes 1 -> 2 after
    the first step, back to 1 after 4 calm steps, and up again when TP1 preempts. Each step syncs weights
    (two variants, alternating) through `apply`; every step's tokens equal a static TP1 run's with the same
    weights (which preempts throughout)."""
    devs = jax.devices()[:2]
    ws = [init(jax.random.key(k), CFG) for k in (0, 1)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in PROMPT_LENS]
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(ws[0]))
    page = page_bytes_per_device(CFG, Layout(tp=1).make_mesh(devs[:1]), 8, ws[0].embed.dtype)
    service = dict(devices=devs, page_size=8, max_seq_len=48, max_batch=16, page_buckets=1, batch_buckets_per_octave=1,
                   kv_bytes_per_device=weight_bytes + 12 * page)

    def rollout(svc):
        order = [rid for p in prompts for rid in svc.add(p, PARAMS)]
        by_id = {c.request_id: c for c in svc.stream()}
        return [by_id[r] for r in order]

    static = RolloutService(CFG, ws[0], tp=1, instances=2, **service)
    ref = []
    for w in ws:
        static.update_weights(w)
        ref.append(rollout(static))
    assert sum(c.preemptions for c in ref[0]) > 0                  # TP1 preempts
    assert [c.tokens for c in ref[0]] != [c.tokens for c in ref[1]]   # so a step with stale weights would show

    svc = RolloutService(CFG, ws[0], tp=1, instances=2, **service)
    given = buffers(ws)
    syncs = []                                  # update_weights calls: none on a step whose layout changes
    update_weights = svc.update_weights

    def counted(w, **kw):
        syncs.append(w)
        return update_weights(w, **kw)

    svc.update_weights = counted
    planner = TPPlanner(2, CFG, start_tp=1)
    ran, counts, decided, switches = [], [], [], 0
    for k in range(STEPS):
        layout = planner.layout_for("short")
        old = [inst.weights for inst in svc.instances]
        report = apply(svc, layout, ws[k % 2])                     # the weight sync, and the relayout on change
        assert svc.layout == [layout.tp] * layout.instances
        switched = bool(ran) and ran[-1] != layout.tp
        switches += switched
        assert (report is not None) == switched
        assert len(syncs) == k + 1 - switches      # a switch syncs the weights by its relayout alone
        if switched:                                # every old rollout copy freed, save what aliases a caller array
            assert not [x for w in old for x in jax.tree.leaves(w) if not x.is_deleted() and not buffers(x) & given]
        del old
        before = total_preemptions(svc)
        outs = rollout(svc)
        n = total_preemptions(svc) - before
        assert n == sum(c.preemptions for c in outs)
        d = planner.decide("short", n)
        ran.append(layout.tp)
        counts.append(n)
        decided.append(d.tp)
        assert [c.tokens for c in outs] == [r.tokens for r in ref[k % 2]], f"step {k} at tp {layout.tp}"
        for o, r in zip(outs, ref[k % 2]):
            np.testing.assert_allclose(o.logprobs, r.logprobs, atol=LOGPROB_ATOL_F32)
    assert ran == [1, 2, 2, 2, 2, 1]
    assert decided == [2, 2, 2, 2, 1, 2]
    assert counts[0] > 0 and counts[5] > 0 and counts[1:5] == [0, 0, 0, 0]
    assert not any(x.is_deleted() for w in ws for x in jax.tree.leaves(w))   # the caller's weights stay whole
    assert planner.metrics()["planner/short/tp"] == 2


def test_apply_refuses_live_sequences():
    svc = RolloutService(CFG, init(jax.random.key(0), CFG), tp=1, instances=2, devices=jax.devices()[:2],
                         page_size=8, max_seq_len=48, page_buckets=1, batch_buckets_per_octave=1)
    svc.add([1, 2, 3], SamplingParams(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="between steps"):
        apply(svc, Decision(2, 1, True, "test"), None)
