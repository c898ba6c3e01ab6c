"""StreamRL skew-aware scheduling: LPT against the brute-force optimum, Algorithm 2's N_l against a
brute-force minimum of the cost model, the scheduler's LPT admission, and the same outputs whatever the
placement (per-request seeds)."""

import itertools
import math

import jax
import numpy as np
import pytest

from jaxrl.rollout import RolloutService, SamplingParams, Scheduler
from jaxrl.rollout.scheduler import Sequence
from jaxrl.rollout.skew import (choose_split, fcfs_makespan, instance_latency, length_estimates, linear_ptl,
                                lpt_makespan, optimal_makespan, plan_placement, random_placement, split_long)
from models import PRESETS, init


# ---------------------------------------------------------------------------------------------- LPT
@pytest.mark.parametrize("seed", range(40))
def test_lpt_makespan_within_four_thirds_of_the_optimum(seed):
    rng = np.random.default_rng(seed)
    slots = int(rng.integers(2, 4))
    jobs = rng.integers(1, 60, size=int(rng.integers(slots + 1, 9))).tolist()
    opt = optimal_makespan(jobs, slots)
    lpt = lpt_makespan(jobs, slots)
    assert opt <= lpt <= (4 / 3 - 1 / (3 * slots)) * opt + 1e-9     # Graham's bound


def test_lpt_beats_fcfs_when_the_long_job_arrives_last():
    jobs = [5] * 6 + [30]
    assert lpt_makespan(jobs, 2) == optimal_makespan(jobs, 2) == 30
    assert fcfs_makespan(jobs, 2) == 45


def _drive(sched: Scheduler, lengths: dict[int, int]) -> int:
    """Decode steps until every sequence has produced its length (no device: tokens are 0, never a stop)."""
    steps = 0
    while sched.waiting or sched.running:
        groups = sched.admit()
        for g in groups:
            for s in g:
                s.computed = len(s) - 1
        sched.start(groups)
        sched.ensure_pages()
        b = sched.decode_batch()
        steps += 1
        sched.take_tokens(b.seqs, np.zeros(len(b.seqs), np.int32), np.zeros(len(b.seqs), np.float32))
        for s in list(sched.running):
            assert len(s.out) <= lengths[s.rid]
    return steps


@pytest.mark.parametrize("seed", range(6))
def test_scheduler_lpt_admission_runs_the_lpt_list_schedule(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, size=12).tolist()
    cap = 3
    steps = {}
    for order in ("fcfs", "lpt"):
        sched = Scheduler(200, 8, max_batch=8, order=order)
        sched.set_batch_cap(cap)
        for rid, n in enumerate(lengths):     # exact predictions: priority = length
            sched.add([Sequence(rid, [1, 2, 3], SamplingParams(max_new_tokens=n), seed=rid, priority=float(n))])
        steps[order] = _drive(sched, dict(enumerate(lengths)))
    assert steps["lpt"] == lpt_makespan(lengths, cap)
    assert steps["fcfs"] == fcfs_makespan(lengths, cap)
    assert steps["lpt"] <= steps["fcfs"]


def test_lpt_is_stable_and_keeps_groups_together():
    sched = Scheduler(100, 8, max_batch=8, order="lpt")
    p = SamplingParams(max_new_tokens=4, n=2)
    sched.add([Sequence(0, [1], p, seed=0, group=0, priority=5.0), Sequence(1, [1], p, seed=1, group=0, priority=5.0)])
    sched.add([Sequence(2, [1], p, seed=2, group=1, priority=9.0), Sequence(3, [1], p, seed=3, group=1, priority=9.0)])
    sched.add([Sequence(4, [1], SamplingParams(max_new_tokens=4), seed=4, priority=5.0)])
    assert [s.rid for s in sched.waiting] == [2, 3, 0, 1, 4]


def test_batch_cap_is_checked():
    sched = Scheduler(100, 8, max_batch=8)
    with pytest.raises(ValueError, match="1..8"):
        sched.set_batch_cap(9)
    with pytest.raises(ValueError, match="order"):
        Scheduler(100, 8, order="sjf")


# ---------------------------------------------------------------------------------------------- Algorithm 2
def test_split_long_takes_the_top_alpha():
    long, reg = split_long([3, 9, 1, 9, 4, 2, 8, 7, 5, 6], alpha=0.2)
    assert long == [1, 3] and reg == [0, 2, 4, 5, 6, 7, 8, 9]
    assert split_long([1, 2, 3], 0.0) == ([], [0, 1, 2])
    assert length_estimates([], 7) == (7.0, 7.0)
    assert length_estimates(list(range(1, 101)), 0) == pytest.approx((50.5, 90.1))


def _brute_force(long_seqs, reg_seqs, instances, cap, ptl, l_long, l_reg):
    """min over every (N_l, BS_l, BS_r) of the slower class's time, by the paper's formula written out."""
    best = math.inf
    for n_l in range(0, min(instances - 1, long_seqs) + 1):
        n_r = instances - n_l
        for bl, br in itertools.product(range(1, cap + 1), repeat=2):
            if n_l == 0:
                if bl != br:
                    continue
                ml, mr = -(-long_seqs // n_r), -(-reg_seqs // n_r)
                m = ml + mr
                b = min(bl, m)
                t = ptl(b) * (l_long * -(-ml // b) + l_reg * (-(-m // b) - -(-ml // b))) if m else 0.0
            else:
                ml, mr = -(-long_seqs // n_l), -(-reg_seqs // n_r)
                tl = ptl(min(bl, ml)) * l_long * -(-ml // min(bl, ml))
                tr = ptl(min(br, mr)) * l_reg * -(-mr // min(br, mr)) if mr else 0.0
                t = max(tl, tr)
            best = min(best, t)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_choose_split_is_the_brute_force_minimum(seed):
    rng = np.random.default_rng(seed)
    instances, cap = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    long_seqs, reg_seqs = int(rng.integers(0, 12)), int(rng.integers(1, 40))
    a, b = float(rng.uniform(0.001, 0.02)), float(rng.uniform(0.0, 0.004))
    ptl = linear_ptl(a, b)
    l_reg = float(rng.uniform(2, 20))
    l_long = l_reg * float(rng.uniform(1, 8))
    best, costs = choose_split(long_seqs, reg_seqs, instances, cap, ptl, l_long, l_reg)
    assert best.seconds == pytest.approx(_brute_force(long_seqs, reg_seqs, instances, cap, ptl, l_long, l_reg),
                                         rel=1e-9)
    assert best.seconds == min(c.seconds for c in costs)
    assert 0 <= best.n_long <= min(instances - 1, long_seqs)
    capped, capped_costs = choose_split(long_seqs, reg_seqs, instances, cap, ptl, l_long, l_reg, max_long=1)
    assert capped.n_long <= 1 and capped.seconds == min(c.seconds for c in costs if c.n_long <= 1)
    assert capped_costs == [c for c in costs if c.n_long <= 1]


def test_dedicated_long_instances_win_when_batch_slows_decoding():
    """The paper's Figure 6 case: PTL grows with batch, a few long samples; splitting them off is faster."""
    ptl = linear_ptl(0.01, 0.002)
    best, costs = choose_split(long_seqs=8, reg_seqs=56, instances=4, cap=32, ptl=ptl, l_long=60, l_reg=8)
    assert best.n_long >= 1
    assert best.seconds < costs[0].seconds
    assert best.bs_long <= best.bs_reg
    assert instance_latency(ptl, 0, 16, 16, 60, 8) == pytest.approx(ptl(16) * 8)


def test_plan_placement_sends_the_long_prompts_to_dedicated_instances():
    predicted = [5, 6, 50, 4, 7, 5, 60, 3, 6, 5]
    plan = plan_placement(predicted, instances=3, group_size=4, cap=16, ptl=linear_ptl(0.01, 0.003),
                          lengths=[5] * 80 + [55] * 20, alpha=0.2)
    assert plan.long == [6, 2]
    n_l = plan.split.n_long
    assert n_l >= 1
    assert all(plan.instance[p] < n_l for p in plan.long)
    assert all(plan.instance[p] >= n_l for p in range(10) if p not in plan.long)
    assert len(plan.caps) == 3 and plan.priority == [float(x) for x in predicted]


# ---------------------------------------------------------------------------------------------- same outputs
CFG = PRESETS["tiny-qwen3"]


def test_skew_aware_placement_gives_the_outputs_of_random_placement():
    """Placement and admission order change where and when a request runs, never its tokens."""
    weights = init(jax.random.key(0), CFG)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, CFG.vocab_size, int(n)).tolist() for n in rng.integers(3, 12, size=8)]
    lens = rng.integers(2, 14, size=8).tolist()
    outs = {}
    for mode in ("random", "skew"):
        svc = RolloutService(CFG, weights, tp=1, instances=4, page_size=8, num_pages=48, max_seq_len=40,
                             max_batch=8, order="lpt" if mode == "skew" else "fcfs")
        if mode == "skew":
            plan = plan_placement(lens, instances=4, group_size=2, cap=8, ptl=linear_ptl(0.01, 0.002),
                                  lengths=lens, alpha=0.25)
            svc.set_batch_caps(plan.caps)
            where, prio = plan.instance, plan.priority
        else:
            where, prio = random_placement(len(prompts), 4, seed=0), [0.0] * len(prompts)
        rids = [svc.add(p, SamplingParams(max_new_tokens=n, temperature=1.0, n=2, seed=100 + i), instance=w,
                        priority=q) for i, (p, n, w, q) in enumerate(zip(prompts, lens, where, prio))]
        got = {c.request_id: c for c in svc.stream()}
        outs[mode] = [[(got[r].tokens, got[r].logprobs) for r in group] for group in rids]
    for a, b in zip(outs["random"], outs["skew"]):
        for (ta, la), (tb, lb) in zip(a, b):
            assert ta == tb
            np.testing.assert_allclose(la, lb, atol=1e-5)


# ---------------------------------------------------------------------------------------------- the train step
def test_skew_config_composes_with_what_moves_requests():
    """PAT's switch keeps the long/regular classes (tests/test_pat_skew.py) and the stream trainer's shrink
    moves within them: both load with skew placement; a bad alpha is still refused."""
    from jaxrl.config.base import ConfigError
    from jaxrl.config.loading import load_config
    from jaxrl.config.train import TrainConfig

    load_config(TrainConfig, ["rollout.skew.enabled=true", "engine.adaptive_tp.enabled=true",
                              "engine.adaptive_tp.profile=p.json"])
    load_config(TrainConfig, ["rollout.skew.enabled=true", "trainer.stream.enabled=true", "engine.instances=2"])
    with pytest.raises(ConfigError, match="alpha"):
        load_config(TrainConfig, ["rollout.skew.alpha=1.5"])


def test_skew_step_places_after_the_ranker_learns(tmp_path):
    """Before its first refresh the router places (no caps); after, the predicted-long prompts go to the
    dedicated instances, caps are set, the pairs log and the warm-start file round-trip."""
    from jaxrl.config.skew import RankerSection, SkewSection
    from jaxrl.train.skew_step import SkewStep

    weights = init(jax.random.key(0), CFG)
    svc = RolloutService(CFG, weights, tp=1, instances=4, page_size=8, num_pages=48, max_seq_len=40, max_batch=16)
    sec = SkewSection(enabled=True, ptl_base_s=0.01, ptl_per_seq_s=0.004,
                      ranker=RankerSection(refresh_every=1, train_steps=150, d_model=32, batch=32))
    sk = SkewStep(sec, max_prompt_len=16, group_size=2, max_new_tokens=64, seed=0, tp=1)
    rng = np.random.default_rng(0)

    def draw(n):       # the length is 4 x the count of token 7 (a rule the ranker can learn)
        ps = [rng.integers(1, 7, size=8).tolist() + [7] * int(k) for k in rng.integers(0, 8, size=n)]
        return ps, [[4 * p.count(7) + 1] * 2 for p in ps]

    ps, ls = draw(10)
    assert sk.place(svc, ps) == ([None] * 10, [0.0] * 10)
    assert [i.sched.batch_cap for i in svc.instances] == [16] * 4
    for _ in range(6):
        ps, ls = draw(40)
        sk.observe(ps, ls, log=tmp_path / "pairs.jsonl")
    m = sk.finish(step=0)
    assert m["skew/kendall_tau"] > 0.7 and m["skew/pairs"] == 240
    ps, ls = draw(10)
    where, prio = sk.place(svc, ps)
    plan = sk.last_plan
    assert plan is not None and plan.split.n_long >= 1
    assert all(where[p] < plan.split.n_long for p in plan.long)
    assert [i.sched.batch_cap for i in svc.instances] == plan.caps
    assert prio == plan.priority
    assert sk.finish(step=1)["skew/active"] == 1.0
    again = SkewStep(sec, max_prompt_len=16, group_size=2, max_new_tokens=64, seed=0, tp=1)
    assert again.load_pairs(tmp_path / "pairs.jsonl") == 240 and again.ranker.trained
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2], "length": 3}\n{"prompt": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        again.load_pairs(bad)
