"""Tail batching (RollPacker §3): the race that picks the first finishers, the long-prompt queue, and
many rounds on the real engine (kept = the first R0 finishers of the first P0 prompts, every drawn
prompt trained exactly once or still queued)."""

import dataclasses
import threading

import jax
import numpy as np
import pytest

from jaxrl.config import ConfigError, load_config
from jaxrl.config.generate import GenerateConfig
from jaxrl.config.train import TrainConfig
from jaxrl.data import DataLoader
from jaxrl.rewards.pool import RewardPool
from jaxrl.rollout import RolloutService
from jaxrl.rollout.tail_batching import Race, TailBatcher, launch_counts
from jaxrl.train import rl
from models import PRESETS, init


def oracle(lengths, keys, keep, accept):
    """The definition: a prompt's first `keep` responses by (length, sample index); the first `accept`
    prompts by (their keep-th length, key)."""
    kept = {p: sorted(j for _, j in sorted((n, j) for j, n in enumerate(row))[:keep]) for p, row in enumerate(lengths)}
    order = sorted(range(len(lengths)), key=lambda p: (max(lengths[p][j] for j in kept[p]), keys[p]))
    return sorted(order[:accept]), kept


def simulate(races, lengths, delays):
    """Lock-step decoding: response (p, j) of race r starts `delays[r][p][j]` ticks late and then gains a
    token per tick until its length; every race polls after every tick (as processes do, in step)."""
    states = []
    for race, L in zip(races, lengths):
        states.append({"gen": np.zeros_like(L), "done": np.zeros(L.shape, bool), "aborted": np.zeros(L.shape, bool)})
    for tick in range(1, 10_000):
        for race, L, D, st in zip(races, lengths, delays, states):
            live = ~st["done"] & ~st["aborted"]
            st["gen"][live & (tick > D)] += 1
            for p, j in zip(*np.nonzero(live)):
                if st["gen"][p, j] == L[p, j]:
                    st["done"][p, j] = True
                    race.finished(p, j, int(L[p, j]))
                else:
                    race.progress(p, j, int(st["gen"][p, j]))
        results = [None] * len(races)

        def poll(k):
            results[k] = races[k].poll()
        threads = [threading.Thread(target=poll, args=(k,)) for k in range(len(races))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for st, out in zip(states, results):
            for p, j in out:
                assert not st["done"][p, j], "a finished response was aborted"
                st["aborted"][p, j] = True
        if all(not (~st["done"] & ~st["aborted"]).any() for st in states):
            return tick
    raise AssertionError("did not finish")


def barrier_gather(n):
    """`gather` for n threads standing in for n processes (every one calls it at the same point)."""
    slots, barrier = [None] * n, threading.Barrier(n)

    def make(rank):
        def gather(a):
            slots[rank] = np.asarray(a)
            barrier.wait()
            out = np.stack(slots)
            barrier.wait()
            return out
        return gather
    return [make(r) for r in range(n)]


@pytest.mark.parametrize("seed", range(60))
def test_race_keeps_first_finishers_whatever_the_lags(seed):
    """Random lengths (ties included), random start lags (preemption, admission), one or two processes:
    the kept responses and accepted prompts are exactly the definition's."""
    rng = np.random.default_rng(seed)
    P, M, keep, procs = int(rng.integers(3, 9)), int(rng.integers(2, 6)), 0, int(rng.integers(1, 3))
    keep = int(rng.integers(1, M + 1))
    accept = int(rng.integers(1, P + 1))
    P -= P % procs
    accept = min(accept, P)
    lengths = rng.integers(1, 12, size=(P, M))
    delays = rng.integers(0, 4, size=(P, M)) * (rng.random((P, M)) < 0.3)
    keys = list(range(P))
    want_accepted, want_kept = oracle(lengths.tolist(), keys, keep, accept)
    gathers = barrier_gather(procs) if procs > 1 else [None]
    mine = [list(range(r, P, procs)) for r in range(procs)]          # prompt k of process r = global r + k*procs
    races = [Race([keys[p] for p in mine[r]], M, keep, accept, gather=gathers[r]) for r in range(procs)]
    simulate(races, [lengths[mine[r]] for r in range(procs)], [delays[mine[r]] for r in range(procs)])
    got = sorted(mine[r][p] for r in range(procs) for p in races[r].accepted)
    assert got == want_accepted
    for r in range(procs):
        for p in races[r].accepted:
            assert races[r].kept(p) == want_kept[mine[r][p]]


def test_race_aborts_as_soon_as_decided():
    """Lock-step, no lags: the round is decided at the tick the accept-th prompt completes, and every
    response still running then is aborted at that tick."""
    lengths = np.array([[2, 3, 9], [4, 5, 9], [7, 8, 9], [3, 12, 12]])
    race = Race([0, 1, 2, 3], 3, 2, 2)
    ticks = simulate([race], [lengths], [np.zeros_like(lengths)])
    assert race.accepted == [0, 1]             # prompt 3's 2nd response (12) loses to prompt 1's (5)
    assert race.kept(0) == [0, 1] and race.kept(1) == [0, 1]
    assert ticks == 5                          # prompt 1's 2nd response finishes at 5: nothing runs after
    assert race.aborted.sum() == 7              # 1 + 1 extras, all 3 of prompt 2, 2 of prompt 3


def test_launch_counts():
    assert launch_counts(16, 8, 1.25, 1.25) == (20, 10)
    assert launch_counts(8, 4, 1.25, 1.25, process_count=2) == (5, 5)
    assert launch_counts(6, 4, 1.25, 1.0, process_count=4) == (2, 4)     # ceil(7.5) = 8 -> 2 each
    assert launch_counts(8, 4, 1.0, 1.0) == (8, 4)


def test_queue_state_and_dealing():
    """Long rounds deal the P0 oldest queued prompts by position; the queue is global and round-trips."""
    tb = [TailBatcher(4, 2, 1.5, 1.0, process_index=r, process_count=2) for r in range(2)]
    for t in tb:
        t.queue = [(0, 10), (0, 11), (1, 12), (1, 13), (2, 14)]
    plans = [t.plan(lambda: None, {i: {"prompt": str(i)} for i in range(20)}, 3) for t in tb]
    assert all(p.kind == "long" for p in plans)
    assert [r["index"] for r in plans[0].rows] == [10, 12] and [r["index"] for r in plans[1].rows] == [11, 13]
    assert plans[0].keys == [0, 2] and plans[1].keys == [1, 3]
    assert tb[0].queue == [(2, 14)]
    fresh = TailBatcher(4, 2, 1.5, 1.0)
    fresh.load_state_dict(tb[0].state_dict())
    assert fresh.queue == tb[0].queue


def test_config_keys():
    cfg = load_config(TrainConfig, ["rollout.tail_batching.enabled=true", "rollout.tail_batching.eta_prompts=1.5"])
    assert cfg.rollout.tail_batching.enabled and cfg.rollout.tail_batching.eta_prompts == 1.5
    with pytest.raises(ConfigError, match="eta_responses"):
        load_config(TrainConfig, ["rollout.tail_batching.eta_responses=0.9"])
    with pytest.raises(ConfigError, match="tail_batching"):          # generate has no rounds: not accepted
        load_config(GenerateConfig, ["sampling.tail_batching.enabled=true"])


# ------------------------------------------------------------------------------ the real engine
STOP = tuple(range(100, 140))          # 40 of 512 tokens stop a random model's samples: varied lengths


def length_reward(response: str, answer: str, task: str) -> float:
    return len(response) / 10.0


class _Tok:
    eos_ids = STOP

    def decode(self, ids):
        return "x" * len(ids)


def test_many_rounds_on_the_engine(monkeypatch):
    """12 steps of P0=4 prompts x R0=3 (eta 1.25: 5 x 4 launched) on a tiny random model: each short round
    keeps exactly the first R0 finishers of the first P0 prompts (checked against the same requests run
    to completion), with the same tokens; long rounds fire when the queue reaches P0; every drawn
    prompt is trained once or still queued, none twice, none lost."""
    monkeypatch.setattr(rl, "reward_fn_for", lambda task: "tests.test_tail_batching:length_reward")
    cfg_m = PRESETS["tiny-qwen3"]
    base = TrainConfig()
    cfg = dataclasses.replace(base, algo=dataclasses.replace(base.algo, group_size=3, prompts_per_step=4),
                              rollout=dataclasses.replace(base.rollout, max_new_tokens=24, temperature=1.0))
    svc = RolloutService(cfg_m, init(jax.random.key(0), cfg_m), tp=1, instances=2, page_size=8, max_batch=16,
                         max_seq_len=64)
    rng = np.random.default_rng(0)
    dataset = [{"prompt_ids": rng.integers(200, 500, size=int(rng.integers(3, 9))).tolist(), "answer": "",
                "task": "copy"} for _ in range(200)]
    tb = TailBatcher(4, 3, 1.25, 1.25)
    loader = DataLoader(dataset, tb.launch, seed=1)
    drawn, trained, kinds = [], [], []
    with RewardPool(num_workers=0) as pool:
        for step in range(12):
            queue_before = len(tb.queue)
            plan = tb.plan(lambda: next(loader), dataset, step)
            kinds.append(plan.kind)
            assert plan.kind == ("long" if queue_before >= 4 else "short")
            prompts = [row["prompt_ids"] for row in plan.rows]
            if plan.kind == "short":
                drawn += [row["index"] for row in plan.rows]
                race = Race(plan.keys, plan.responses, plan.keep, plan.accept)
                comps, rewards, st = rl.rollout_and_score(svc, pool, _Tok(), cfg, prompts, plan.rows, step, STOP,
                                                          race=race, responses=plan.responses)
                full, _, _ = rl.rollout_and_score(svc, pool, _Tok(), cfg, prompts, plan.rows, step, STOP,
                                                  responses=plan.responses)
                lengths = [[len(full[p * 4 + j].tokens) for j in range(4)] for p in range(5)]
                want_accepted, want_kept = oracle(lengths, plan.keys, 3, 4)
                assert st["accepted"] == want_accepted, step
                want = [full[p * 4 + j].tokens for p in want_accepted for j in want_kept[p]]
                assert [c.tokens for c in comps] == want, step
                np.testing.assert_allclose(rewards, [len(t) / 10.0 for t in want], rtol=1e-6)
                # every response either finished (at its full run's length) or was aborted live, short of it;
                # wasted = the finished ones not kept, whole, + the aborted ones' partial tokens
                done = race.final >= 0
                assert (done != race.aborted).all() and st["aborted"] == race.aborted.sum()
                assert all(race.final[p, j] == lengths[p][j] for p, j in zip(*np.nonzero(done)))
                unkept = sum(lengths[p][j] for p, j in zip(*np.nonzero(done))
                             if p not in want_accepted or j not in want_kept[p])
                assert st["wasted_tokens"] == st["aborted_tokens"] + unkept, (st, unkept)
                assert st["aborted_tokens"] <= sum(lengths[p][j] - 1 for p, j in zip(*np.nonzero(race.aborted)))
            else:
                comps, rewards, st = rl.rollout_and_score(svc, pool, _Tok(), cfg, prompts, plan.rows, step, STOP)
                assert st["accepted"] == [0, 1, 2, 3] and st["aborted"] == 0 and len(comps) == 12
            trained += [plan.rows[p]["index"] for p in st["accepted"]]
            tb.settle(plan, st["accepted"], step)
            assert sorted(drawn) == sorted(trained + [i for _, i in tb.queue])     # drawn = trained + queued
            assert len(set(trained)) == len(trained)                              # none trained twice
            assert not svc.has_work() and svc.stats()[0]["pages_used"] <= 1       # aborted pages freed
    assert kinds.count("long") >= 2 and kinds[:4] == ["short"] * 4 and kinds[4] == "long"
