"""PAT's mid-generation switch keeps StreamRL's long/regular classes (`skew.Classes`): n'_long of the new
instances for the long class, each class dealt over its own by the least-loaded rule, everything merged on
one instance; the controller's prediction (`merge_and_redistribute`) is the relayout's own dealing
(`migration.deal`); on the real engine a switch with classes keeps the static layout's tokens and leaves
every long sequence on a long instance with its class's batch cap."""

import types

import numpy as np
import pytest

from jaxrl.rollout import RolloutService
from jaxrl.rollout.adaptive_tp import Live, Predictor, SwitchController, by_group, merge_and_redistribute
from jaxrl.rollout.migration import deal
from jaxrl.rollout.params import SamplingParams
from jaxrl.rollout.scheduler import SequenceState
from jaxrl.rollout.skew import Classes, deal_units
from jaxrl.rollout.tp_switch import AdaptiveTP
from tests.pat_profiles import forcing_profile
from tests.test_movable_state import CFG, SAMPLED, SERVICE, _same, prompts, static, weights  # noqa: F401


# ------------------------------------------------------------------------------------------ the rule
@pytest.mark.parametrize("placed_long, placed, n, has_long, has_reg, want", [
    (1, 4, 2, True, True, 1),      # max(1, round(0.5)) (half up)
    (1, 4, 8, True, True, 2),
    (2, 8, 4, True, True, 1),
    (3, 4, 2, True, True, 1),      # round(1.5) = 2, but one regular instance must be left
    (1, 4, 1, True, True, 0),      # one instance: merged
    (1, 4, 8, False, True, 0),     # no long sequence live: every instance regular
    (1, 4, 2, True, False, 2),     # no regular sequence live: every instance long
    (0, 4, 8, True, True, 1),      # (tags say long: at least one instance)
])
def test_long_instances_follow_the_placement_in_proportion(placed_long, placed, n, has_long, has_reg, want):
    assert Classes(placed_long, placed).long_instances(n, has_long, has_reg) == want


def test_tags_stay_with_the_request_through_switches():
    c = Classes(1, 4, cap_long=2, cap_reg=8)
    assert c.caps() == [2, 8, 8, 8]
    assert [c.tag(r, i) for r, i in ((0, 0), (1, 1), (2, 0), (3, 3))] == [True, False, True, False]
    one = c.to(1, [0, 1, 2, 3])
    assert (one.n_long, one.caps(), one.targets(True), one.targets(False)) == (0, [None], range(1), range(1))
    assert not one.tag(9, 0)                             # first seen while merged: regular
    two = one.to(2, [0, 1, 2, 3, 9])                     # split again: the tags restore the classes
    assert (two.n_long, two.caps(), two.targets(True), two.targets(False)) == (1, [2, 8], range(1), range(1, 2))
    assert two.tag(0, 1)                                 # tagged once: moving does not change a class
    with pytest.raises(ValueError, match="N_l < N"):
        Classes(4, 4)
    with pytest.raises(ValueError, match="classes on 2 instances"):
        deal_units([(5, True)], 4, two)


def _population(kv, seed=0, instances=4, placed_long=1):
    """Live sequences on `instances` instances (the first `placed_long` long), some sharing prompt pages, as
    the relayout detaches them (states) and as the controller sees them (live), plus their tagged classes."""
    rng = np.random.default_rng(seed)
    classes = Classes(placed_long, instances, cap_long=2, cap_reg=8)
    states, live = [], []
    for rid in range(30):
        inst, share = int(rng.integers(0, instances)), (rid // 3 if rid % 2 else None)
        ctx = int(rng.integers(10, 400))
        pages = (1, 2) if share is not None or rid % 4 == 0 else ()
        holds = pages if kv == "migrate" else ()
        states.append(SequenceState(rid, (1,) * 5, SamplingParams(), 0, share, (2,) * (ctx - 5), (0.0,) * (ctx - 5),
                                    pages=holds, instance=inst if holds else None))
        live.append(Live(ctx, 10, inst, rid, share if pages else None))
        classes.tag(rid, inst)
    return states, live, classes


@pytest.mark.parametrize("kv", ["migrate", "recompute"])
@pytest.mark.parametrize("seed", range(3))
def test_prediction_is_the_relayouts_class_aware_deal(kv, seed):
    """`merge_and_redistribute(..., classes=)` == `migration.deal(..., classes.to(n, live))` on every layout;
    for n' > 1 every long sequence lands on one of the first n'_long instances, every regular one after them;
    for n' = 1 everything merges."""
    states, live, classes = _population(kv, seed)
    rids = [x.rid for x in live]
    assert classes.long and len(classes.long) < len(live)
    for n in (1, 2, 4, 8):
        target = classes.to(n, rids)
        want = [[st.rid for st in g] for g in deal(sorted(states, key=lambda st: st.rid), n, target)]
        got = [[x.rid for x in g] for g in merge_and_redistribute(live, n, keep_shared=kv == "migrate",
                                                                  classes=classes)]
        assert got == want, n
        for j, g in enumerate(got):
            assert all((r in classes.long) == (j < target.n_long) for r in g) or n == 1, (n, j)
        assert target.n_long == {1: 0, 2: 1, 4: 1, 8: 2}[n]
        assert all(g for g in got), n                     # each class fills its own instances


def test_without_classes_the_deal_is_unchanged():
    """The class-aware deal is only taken with classes: without, it is the least-loaded deal over all."""
    states, live, classes = _population("migrate", 1)
    plain = [[x.rid for x in g] for g in merge_and_redistribute(live, 2)]
    kept = [[x.rid for x in g] for g in merge_and_redistribute(live, 2, classes=classes)]
    assert plain == [[st.rid for st in g] for g in deal(sorted(states, key=lambda st: st.rid), 2)]
    assert plain != kept and sorted(kept[0]) == sorted(classes.long)


def test_the_controller_predicts_with_the_classes():
    """Each candidate's remaining time is that of the class-aware deal the switch will run."""
    _, live, classes = _population("migrate", 2)
    pred = Predictor(forcing_profile("large"))
    ctl = SwitchController(pred, [2, 4, 8], 8, kv="migrate")
    d = ctl.decide(2, live, classes=classes)
    for c in d.candidates:
        if c.tp != 2:
            assert c.remaining_s == pytest.approx(pred.remaining_time(c.tp, merge_and_redistribute(
                live, 8 // c.tp, classes=classes)))
    assert d.current_s == pred.remaining_time(2, by_group(live))
    # with the classes the 2-instance layout is less balanced than the plain deal predicts
    plain = ctl.decide(2, live)
    c4k, c4p = (next(c for c in x.candidates if c.tp == 4) for x in (d, plain))
    assert c4k.remaining_s != c4p.remaining_s


def test_skew_step_hands_its_classes_to_pat():
    """`SkewStep.place` gives the placement's classes to the switch driver (none before the ranker learns)
    and `home` ends them; `instance_classes` follows the layout PAT runs."""
    import jax

    from jaxrl.config.skew import SkewSection
    from jaxrl.train.skew_step import SkewStep
    from models import init

    svc = RolloutService(CFG, init(jax.random.key(0), CFG), tp=2, instances=4, page_size=8, num_pages=32,
                         max_seq_len=40, max_batch=16)
    svc.adaptive = AdaptiveTP(SwitchController(Predictor(forcing_profile("large")), [2, 4], 8), check_every=3)
    sk = SkewStep(SkewSection(enabled=True, ptl_base_s=0.05, ptl_per_seq_s=0.001), max_prompt_len=16,
                  group_size=2, max_new_tokens=64, seed=0, tp=2)
    ps = [[1, 2, 3]] * 10
    sk.place(svc, ps)
    assert svc.adaptive.classes is None and sk.instance_classes(svc) is None
    sk.recent.extend([4] * 80 + [64] * 20)              # P50 = 4, P90 = 64: a long tail worth instances of its own
    sk.ranker = types.SimpleNamespace(trained=True, predict=lambda ps: [60.0, 58.0] + [4.0] * (len(ps) - 2))
    where, _ = sk.place(svc, ps)
    plan, c = sk.last_plan, svc.adaptive.classes
    assert plan.split.n_long >= 1 and (c.placed_long, c.placed) == (plan.split.n_long, 4)
    assert c.caps() == plan.caps and all(where[p] < plan.split.n_long for p in plan.long)
    c.tag(0, 0)
    c.tag(1, 3)
    svc.adaptive.classes = c.to(2, [0, 1])        # as after a switch to 2 instances (not run here: 4 remain)
    assert sk.instance_classes(svc) == {0: "long", 1: "regular", 2: "regular", 3: "regular"}
    svc.adaptive.home(svc, types.SimpleNamespace(tp=2, instances=4))
    assert svc.adaptive.classes is None


# ----------------------------------------------------------------------------------- the real engine
def test_switch_keeps_the_classes_on_the_engine(weights, prompts, static):  # noqa: F811
    """tp2x4 with prompts 1 and 4 placed on long instance 0 (cap 2) and the rest on instances 1-3 (cap 6); a
    forcing profile switches to tp4x2 at the first check, migrating the KV: instance 0 keeps every live long
    sequence (n'_long = max(1, round(1·2/4)) = 1) and the long cap, and the tokens equal a static layout's."""
    svc = RolloutService(CFG, weights, tp=2, instances=4, **SERVICE)
    svc.adaptive = AdaptiveTP(SwitchController(Predictor(forcing_profile("large")), [2, 4], 8, kv="migrate"),
                              check_every=3)
    place = {0: 1, 1: 0, 2: 2, 3: 3, 4: 0, 5: 1}
    svc.set_batch_caps([2, 6, 6, 6])
    svc.adaptive.classes = Classes(1, 4, cap_long=2, cap_reg=6)
    order = [rid for p, toks in enumerate(prompts) for rid in svc.add(toks, SAMPLED, instance=place[p])]
    long = {r for p in (1, 4) for r in order[p * SAMPLED.n:(p + 1) * SAMPLED.n]}
    seen, look = [], svc.adaptive.live
    svc.adaptive.live = lambda s: seen.append(look(s)) or seen[-1]       # what the controller saw
    got, after = {}, None
    while svc.has_work():
        for c in svc.step():
            got[c.request_id] = c
        if after is None and any(d.switch for d in svc.adaptive.decisions):
            after, before = svc.sequence_stats(), seen[-1]
    _same([got[r] for r in order], static["sampled"])
    d = next(d for d in svc.adaptive.decisions if d.switch)
    assert (d.current, d.tp, d.actual["long_instances"]) == (2, 4, 1) and svc.layout == [4, 4]
    assert svc.adaptive.classes.long == long                     # tagged from the instance each was placed on
    live_long = [s for s in after if s["request_id"] in long]
    assert live_long and all(s["instance"] == 0 for s in live_long)
    assert all(s["instance"] == 1 for s in after if s["request_id"] not in long)
    assert [i.sched.batch_cap for i in svc.instances] == [2, 6]
    # the controller's prediction is where the relayout put them; the plain deal would have mixed the classes
    predicted = {x.rid: g for g, xs in enumerate(merge_and_redistribute(before, 2, classes=svc.adaptive.classes))
                 for x in xs}
    assert {s["request_id"]: s["instance"] for s in after} == {r: g for r, g in predicted.items()
                                                                if r in {s["request_id"] for s in after}}
    plain = merge_and_redistribute(before, 2)
    assert any(x.rid in long for x in plain[1])
