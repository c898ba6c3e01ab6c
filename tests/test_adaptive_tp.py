"""PAT's predictor and switch controller (`jaxrl.rollout.adaptive_tp`): the predictor is exact at profiled
points and linear between them; the remaining time equals a step-by-step simulation; Eq. 1 and Eq. 3 by
hand; Algorithm 1 equals a brute-force oracle on recorded trajectories; negative controls never switch."""

import math

import numpy as np
import pytest

from jaxrl.rollout.adaptive_tp import (Live, LayoutProfile, Predictor, Profile, SwitchController, by_group,
                                       merge_and_redistribute)

BATCHES = [1, 4, 16, 64]
CONTEXTS = [16, 64, 256, 1024]


def synthetic(seed=0, *, tps=(1, 2, 4, 8), reshard=0.05, migrate=1e9, compile_s=2.0, control=0.01) -> Profile:
    """Latencies shaped like the paper's: a fixed part falling with TP (weights per device), a per-token
    part, a per-sequence part rising with TP (communication), plus noise so nothing is exactly linear."""
    rng = np.random.default_rng(seed)
    layouts = {}
    for tp in tps:
        dec = [(b, n, 0.010 / tp + 2e-7 * b * n / tp + 1e-4 * b * (1 + 0.3 * math.log2(tp)) + 1e-4 * rng.random())
               for b in BATCHES for n in CONTEXTS]
        pre = [(b, n, 0.005 / tp + 1e-6 * b * n / tp + 1e-9 * b * n * n / tp) for b in BATCHES for n in CONTEXTS]
        layouts[tp] = LayoutProfile(tp, dec, pre, compile_s)
    rs = {f"{a}->{b}": reshard for a in tps for b in tps if a != b}
    return Profile({"model": "synthetic"}, layouts, migrate, rs, layers=4, kv_bytes_per_token_layer=2 * 64 * 4,
                   control_seconds=control)


def test_exact_at_profiled_points_and_linear_between():
    prof = synthetic()
    pred = Predictor(prof)
    for tp, lp in prof.layouts.items():
        for b, n, s in lp.decode:
            assert pred.step_latency(tp, b, b * n) == pytest.approx(s, rel=1e-12)
        for b, n, s in lp.prefill:
            assert pred.prefill_latency(tp, b, n) == pytest.approx(s, rel=1e-12)
    # between two contexts of one batch: the chord; between two batches at the same T: linear in B
    d = {(b, n): s for b, n, s in prof.layouts[2].decode}
    t = 16 * (64 + 256) / 2
    assert pred.step_latency(2, 16, t) == pytest.approx((d[16, 64] + d[16, 256]) / 2, rel=1e-12)
    t = 4 * 256                                            # B=4 at L=256 and B=16 at L=64: the same T
    assert pred.step_latency(2, 10, t) == pytest.approx(d[4, 256] + (d[16, 64] - d[4, 256]) * (10 - 4) / 12, rel=1e-12)
    # clamped in B, extended linearly in T past the last point
    assert pred.step_latency(2, 100, 64 * 1024) == pytest.approx(d[64, 1024], rel=1e-12)
    slope = (d[1, 1024] - d[1, 256]) / 768
    assert pred.step_latency(2, 1, 2048) == pytest.approx(d[1, 1024] + slope * 1024, rel=1e-12)


def test_profile_json_round_trip(tmp_path):
    prof = synthetic()
    prof.save(tmp_path / "p.json")
    back = Profile.load(tmp_path / "p.json")
    assert back.to_json() == prof.to_json()
    bad = prof.to_json() | {"version": 0}
    with pytest.raises(ValueError, match="re-profile"):
        Profile.from_json(bad)


def simulate_group(pred, tp, contexts, remaining):
    """Step by step: every live sequence decodes one token per step until its bound."""
    ctx, rem, total = list(contexts), list(remaining), 0.0
    while any(r > 0 for r in rem):
        live = [i for i, r in enumerate(rem) if r > 0]
        total += float(pred.step_latency(tp, len(live), sum(ctx[i] for i in live), max(ctx[i] for i in live)))
        for i in live:
            ctx[i] += 1
            rem[i] -= 1
    return total


SHAPES = {"batch": [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64], "pages": [16, 32, 64], "page_size": 16}


def padded(seed=0) -> Profile:
    """`synthetic` with the XLA engine's padded decode shapes recorded (rows ladder, page-table widths)."""
    prof = synthetic(seed)
    for lp in prof.layouts.values():
        lp.shapes = SHAPES
    return prof


def test_padded_profile_predicts_the_shape_the_engine_runs():
    """With shapes, ℓ is a function of (rows bucket, page width of the longest sequence): exact at every
    profiled shape (the mean of the points that ran it), blind to the other rows' lengths, and stepping
    where the longest sequence needs a wider table."""
    prof = padded()
    pred = Predictor(prof)
    pad = pred.padded[2]
    runs = {}
    for b, n, s in prof.layouts[2].decode:
        runs.setdefault((int(pad.rows(b)), int(pad.width(n))), []).append(s)
    for b, n, s in prof.layouts[2].decode:
        want = np.mean(runs[int(pad.rows(b)), int(pad.width(n))])
        assert pred.step_latency(2, b, b * n) == pytest.approx(want, rel=1e-12)
    # widths: the page of the next position, rounded up to the ladder (16-token pages, widths 16/32/64 pages)
    assert [int(pad.width(n)) for n in (1, 255, 256, 300, 511, 512, 5000)] == [256, 256, 512, 512, 512, 1024, 1024]
    assert [int(pad.rows(b)) for b in (1, 3, 5, 7, 13, 64, 99)] == [1, 4, 6, 8, 16, 64, 64]
    # the rows' other lengths do not matter; the longest does
    assert pred.step_latency(2, 4, 4 * 100, 300) == pred.step_latency(2, 4, 4 * 300, 300)
    assert pred.step_latency(2, 4, 4 * 100, 600) != pred.step_latency(2, 4, 4 * 100, 300)
    back = Profile.from_json(prof.to_json())
    assert back.layouts[2].shapes == SHAPES


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("kind", ["sum", "padded"])
def test_remaining_time_equals_step_by_step(seed, kind):
    rng = np.random.default_rng(seed)
    pred = Predictor(synthetic(seed) if kind == "sum" else padded(seed))
    n = int(rng.integers(1, 30))
    ctx, rem = rng.integers(5, 900, n).tolist(), rng.integers(0, 80, n).tolist()
    for tp in (1, 8):
        assert pred.group_remaining(tp, ctx, rem) == pytest.approx(simulate_group(pred, tp, ctx, rem), rel=1e-9)
    assert pred.group_remaining(2, [], []) == 0.0


def test_eq1_eq2_and_eq3_eq4_by_hand():
    prof = synthetic(migrate=2e9)
    pred = Predictor(prof)
    live = [Live(100, 5, 0), Live(300, 5, 0), Live(50, 5, 1)]
    # Eq. 1: per-rank bytes of the largest source group = 2·M·ΣL·(H_kv/TP_src)·s; kv_bytes_per_token_layer = 2·H_kv·s
    t, nbytes = pred.move_seconds(2, by_group(live))
    want = 4 * (100 + 300) * (2 * 64 * 4) / 2
    assert nbytes == want and t == pytest.approx(want / 2e9)
    # Eq. 3–4: L_RMS = sqrt((100² + 300²) / 2) for group 0, the prefill of that equivalent batch
    groups = [[live[0], live[1]], [live[2]]]
    l_rms = math.sqrt((100 ** 2 + 300 ** 2) / 2)
    want = max(float(pred.prefill_latency(4, 2, l_rms)), float(pred.prefill_latency(4, 1, 50)))
    assert pred.recompute_seconds(4, groups) == pytest.approx(want)


def test_redistribution_deals_like_relayout():
    """Request-id order, each to the group with the fewest context tokens so far (ties: lower index)."""
    live = [Live(c, 1, 0, rid) for rid, c in zip((5, 0, 3, 1, 4, 2), (500, 400, 300, 200, 100, 100))]
    groups = merge_and_redistribute(live, 2)
    # loads (g0, g1): rid0 400 -> (400, 0); rid1 200 -> (400, 200); rid2 100 -> (400, 300); rid3 300 -> (400, 600);
    # rid4 100 -> (500, 600); rid5 500 -> (1000, 600)
    assert [[x.rid for x in g] for g in groups] == [[0, 4, 5], [1, 2, 3]]
    assert all(x.group == k for k, g in enumerate(groups) for x in g)


@pytest.mark.parametrize("kv", ["migrate", "recompute"])
def test_redistribution_is_the_relayouts_own_dealing(kv):
    """The predictor's dealing == `migration.deal` on the states a relayout detaches: a prompt's samples that
    share KV pages move as one unit when the KV migrates, one by one when it is recomputed (the controller
    used to deal shared samples one by one, predicted a balance the migrating relayout did not produce, and
    switched back and forth at every check)."""
    from jaxrl.rollout.migration import deal
    from jaxrl.rollout.params import SamplingParams
    from jaxrl.rollout.scheduler import SequenceState

    rng = np.random.default_rng(0)
    states, live = [], []
    for rid in range(24):
        inst, share = rid % 3, (rid // 6 if rid % 2 else None)          # some samples share pages, some do not
        ctx = int(rng.integers(10, 400))
        pages = (1, 2) if share is not None or rid % 4 == 0 else ()
        holds = pages if kv == "migrate" else ()                       # a recomputing relayout drops the KV
        states.append(SequenceState(rid, (1,) * 5, SamplingParams(), 0, share, (2,) * (ctx - 5), (0.0,) * (ctx - 5),
                                    pages=holds, instance=inst if holds else None))
        live.append(Live(ctx, 10, inst, rid, share if pages else None))
    for n in (1, 2, 4):
        want = [[st.rid for st in g] for g in deal(sorted(states, key=lambda st: st.rid), n)]
        got = [[x.rid for x in g] for g in merge_and_redistribute(live, n, keep_shared=kv == "migrate")]
        assert got == want, n


def oracle(pred, prof, current, live, candidates, devices, kv, warm):
    """Algorithm 1 written out: every candidate's remaining time by step-by-step simulation of each group,
    plus the switch cost's parts computed by hand; switch iff the best total beats continuing."""
    def rem(tp, groups):
        return max((simulate_group(pred, tp, [x.context for x in g], [x.remaining for x in g]) for g in groups),
                   default=0.0)
    cur_groups = by_group(live)
    t_cur = rem(current, cur_groups)
    best, best_t = current, math.inf
    for tp in candidates:
        if tp == current:
            total = t_cur
        else:
            dst = merge_and_redistribute(live, devices // tp)
            per_rank = max(sum(prof.layers * x.context * prof.kv_bytes_per_token_layer for x in g) / current
                           for g in cur_groups)
            move = per_rank / prof.migrate_bytes_per_s
            recomp = max((float(pred.prefill_latency(tp, len(g), math.sqrt(sum(x.context ** 2 for x in g) / len(g))))
                          for g in dst if g), default=0.0)
            state = {"migrate": move, "recompute": recomp, "auto": min(move, recomp)}[kv]
            total = (rem(tp, dst) + state + prof.reshard_seconds[f"{current}->{tp}"]
                     + (0.0 if warm(tp) else prof.layouts[tp].compile_seconds) + prof.control_seconds)
        if total < best_t:
            best, best_t = tp, total
    return best if best != current and t_cur > best_t else current


def trajectory(seed, devices=8, tp=2):
    """A recorded long-tail generation: 32 sequences on devices/tp groups, lengths log-normal; the live set
    every 16 decode steps."""
    rng = np.random.default_rng(seed)
    n, groups = 32, devices // tp
    prompt = rng.integers(20, 200, n)
    final = np.clip((30 * np.exp(1.2 * rng.standard_normal(n))).astype(int), 1, 600)
    out = []
    for step in range(0, int(final.max()), 16):
        out.append((step, [Live(int(prompt[i] + step), int(600 - step), i % groups) for i in range(n) if final[i] > step]))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kv", ["auto", "migrate", "recompute"])
def test_controller_equals_brute_force_oracle(seed, kv):
    prof = synthetic(seed, reshard=0.02, compile_s=0.5)
    pred = Predictor(prof)
    ctl = SwitchController(pred, [1, 2, 4, 8], 8, kv=kv)
    warm = (lambda tp: tp != 8) if seed % 2 else (lambda tp: True)
    switched = 0
    for step, live in trajectory(seed)[::3]:
        d = ctl.decide(2, live, step=step, warm=warm)
        assert d.tp == oracle(pred, prof, 2, live, [1, 2, 4, 8], 8, kv, warm), (step, len(live))
        assert d.current_s == pytest.approx(max(simulate_group(pred, 2, [x.context for x in g],
                                                               [x.remaining for x in g]) for g in by_group(live)))
        if d.switch:
            switched += 1
            assert d.kv in ("migrate", "recompute") and (kv == "auto" or d.kv == kv)
            chosen = next(c for c in d.candidates if c.tp == d.tp)
            assert chosen.total_s < d.current_s
        for c in d.candidates:                 # each switch cost's parts, recombined by hand
            if c.tp == 2:
                assert c.switch_s == 0.0
                continue
            state = {"migrate": c.move_s, "recompute": c.recompute_s, "auto": min(c.move_s, c.recompute_s)}[kv]
            assert c.kv == (kv if kv != "auto" else ("migrate" if c.move_s <= c.recompute_s else "recompute"))
            assert c.switch_s == pytest.approx(state + prof.reshard_seconds[f"2->{c.tp}"] + prof.control_seconds
                                               + (0.0 if warm(c.tp) else prof.layouts[c.tp].compile_seconds))
        rec = d.record()
        assert rec["switch"] == d.switch and len(rec["candidates"]) == 4
    assert switched > 0                      # the trajectories do reach a tail where a larger TP pays


def test_negative_controls_never_switch():
    live_sets = [live for _, live in trajectory(0)]
    huge = synthetic(reshard=1e6)                               # a switch never repays its cost
    ctl = SwitchController(Predictor(huge), [1, 2, 4, 8], 8)
    assert not any(ctl.decide(2, live).switch for live in live_sets)
    # a profile where TP 2 is fastest everywhere (others 3x slower): never leaves TP 2, at any cost
    best2 = synthetic(reshard=0.0, compile_s=0.0, control=0.0)
    for tp, lp in best2.layouts.items():
        base = best2.layouts[2].decode
        lp.decode = [(b, n, s * (1 if tp == 2 else 3)) for b, n, s in base]
    ctl = SwitchController(Predictor(best2), [1, 2, 4, 8], 8)
    assert not any(ctl.decide(2, live).switch for live in live_sets)


def test_controller_refusals():
    pred = Predictor(synthetic(tps=(1, 2)))
    with pytest.raises(ValueError, match="not in the profile"):
        SwitchController(pred, [1, 2, 4], 8)
    with pytest.raises(ValueError, match="does not divide"):
        SwitchController(Predictor(synthetic(tps=(1, 2, 4))), [4], 6)
    with pytest.raises(ValueError, match="kv="):
        SwitchController(pred, [1, 2], 8, kv="copy")


def test_min_gain_keeps_the_layout_unless_the_gain_is_worth_having():
    """`min_gain` (beyond the paper): a candidate that saves less than that fraction of the remaining time is
    not taken; with 0 (the paper's rule) the same decision switches."""
    prof = synthetic(0, reshard=0.0, compile_s=0.0)
    pred = Predictor(prof)
    for step, live in trajectory(0)[::3]:
        d = SwitchController(pred, [1, 2, 4, 8], 8).decide(2, live, step=step)
        if not d.switch:
            continue
        best = next(c for c in d.candidates if c.tp == d.tp)
        gain = 1 - best.total_s / d.current_s
        assert gain > 0
        above = SwitchController(pred, [1, 2, 4, 8], 8, min_gain=min(0.99, gain * 1.01)).decide(2, live, step=step)
        below = SwitchController(pred, [1, 2, 4, 8], 8, min_gain=gain * 0.99).decide(2, live, step=step)
        assert not above.switch and below.switch and below.tp == d.tp
        break
    else:
        pytest.fail("the trajectory never switched")
    with pytest.raises(ValueError, match="min_gain"):
        SwitchController(pred, [1, 2], 8, min_gain=1.0)
