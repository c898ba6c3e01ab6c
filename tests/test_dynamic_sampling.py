"""DAPO dynamic sampling on tail batching's race (`Race(filter_equal=True)`, `jaxrl.train.rounds`): the race
keeps the first P0 prompts whose kept group's rewards are not all equal, whatever the lags and on
several processes; a round that resolves short keeps all eligible prompts; waves refill a short round;
every drawn prompt is trained, queued or dropped, exactly once. Also: a process whose own requests are
all done keeps polling the race with the others (no deadlock)."""

import dataclasses
import threading

import jax
import numpy as np
import pytest

from jaxrl.config import ConfigError, load_config
from jaxrl.config.train import TrainConfig
from jaxrl.data import DataLoader
from jaxrl.rewards.pool import RewardPool
from jaxrl.rollout import Completion, RolloutService
from jaxrl.rollout.tail_batching import Race, TailBatcher
from jaxrl.train import rl
from jaxrl.train.rounds import equal_groups, tail_round
from models import PRESETS, init
from tests.test_tail_batching import barrier_gather, simulate


def oracle(lengths, rewards, keys, keep, accept):
    """First `keep` responses per prompt by (length, index); eligible = their rewards not all equal; the first
    `accept` eligible prompts by (keep-th length, key), or all eligible ones when fewer."""
    kept = {p: sorted(j for _, j in sorted((n, j) for j, n in enumerate(row))[:keep]) for p, row in enumerate(lengths)}
    eligible = [p for p in kept if len({rewards[p][j] for j in kept[p]}) > 1]
    order = sorted(eligible, key=lambda p: (max(lengths[p][j] for j in kept[p]), keys[p]))
    return sorted(order[:accept]), kept, sorted(set(kept) - set(eligible))


class Scoring:
    """Wraps a race: after each poll, every known prompt's group is scored (rewards[p][kept])."""

    def __init__(self, race, rewards):
        self.race, self.rewards = race, rewards

    def __getattr__(self, name):
        return getattr(self.race, name)

    def poll(self):
        for p in self.race.known:
            self.race.scored(p, [self.rewards[p][j] for j in self.race.kept(p)])
        return self.race.poll()


@pytest.mark.parametrize("seed", range(30))
def test_race_keeps_first_eligible_whatever_the_lags(seed):
    rng = np.random.default_rng(seed)
    procs = int(rng.integers(1, 3))
    n, m, keep = int(rng.integers(3, 7)), int(rng.integers(2, 5)), 2
    keep = min(keep, m)
    accept = int(rng.integers(1, procs * n + 1))
    lengths = [rng.integers(1, 12, size=(n, m)) for _ in range(procs)]
    rewards = [rng.integers(0, 2, size=(n, m)).astype(float) for _ in range(procs)]     # often all equal
    delays = [rng.integers(0, 6, size=(n, m)) * (rng.random((n, m)) < 0.4) for _ in range(procs)]
    keys = [[k * procs + r for k in range(n)] for r in range(procs)]
    gathers = barrier_gather(procs) if procs > 1 else [None]
    races = [Race(keys[r], m, keep, accept, gathers[r], filter_equal=True) for r in range(procs)]
    scoring = [Scoring(race, rw) for race, rw in zip(races, rewards)]
    simulate(scoring, lengths, delays)
    for _ in range(3):      # the last groups are scored after the last tick: poll on (as the idle loop does)
        threads = [threading.Thread(target=s.poll) for s in scoring]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    all_len = [row for L in lengths for row in L.tolist()]
    all_rw = [row for R in rewards for row in R.tolist()]
    want, kept, dropped = oracle(all_len, all_rw, [k for ks in keys for k in ks], keep, accept)
    for r, race in enumerate(races):
        assert race.decided
        assert race.accepted == [p - r * n for p in want if r * n <= p < (r + 1) * n], (seed, r)
        flat_keys = [k for ks in keys for k in ks]
        cut = max([(max(all_len[p][j] for j in kept[p]), flat_keys[p]) for p in want], default=None)
        local_dropped = [p - r * n for p in dropped if r * n <= p < (r + 1) * n]
        if len(want) < accept:                    # the round resolved short: every all-equal group dropped
            assert race.dropped == local_dropped
        else:                                     # the all-equal groups ahead of the cut-off
            assert race.dropped == [p for p in local_dropped
                                    if (max(all_len[r * n + p][j] for j in kept[r * n + p]), keys[r][p]) <= cut]
        for p in race.accepted:
            assert race.kept(p) == kept[r * n + p]
            assert len({rewards[r][p, j] for j in race.kept(p)}) > 1           # trained groups carry signal
    got = sum(len(race.accepted) for race in races)
    assert got == min(accept, len([p for p in kept if p not in dropped]))


def test_race_without_filter_ignores_rewards():
    race = Race([0, 1], 2, 2, 1)
    race.finished(0, 0, 3), race.finished(0, 1, 3)
    race.poll()
    assert race.known == [0] and not race.decided
    race.scored(0, [1.0, 1.0])
    race.finished(1, 0, 5), race.finished(1, 1, 5)
    race.poll()
    assert race.accepted == [0] and race.dropped == []
    with pytest.raises(ValueError, match="before its first"):
        Race([0], 2, 2, 1).scored(0, [0.0, 1.0])


def test_equal_groups():
    assert equal_groups(np.asarray([1, 1, 0, 1, 0, 0, 0.5, 0.5]), 2) == [0, 2, 3]


def test_config():
    cfg = load_config(TrainConfig, ["rollout.tail_batching.enabled=true", "rollout.tail_batching.dynamic_sampling=true",
                                    "rollout.tail_batching.max_waves=3"])
    assert cfg.rollout.tail_batching.max_waves == 3
    with pytest.raises(ConfigError, match="rollout.tail_batching.dynamic_sampling"):
        load_config(TrainConfig, ["rollout.tail_batching.dynamic_sampling=true"])
    with pytest.raises(ConfigError, match="max_waves"):
        load_config(TrainConfig, ["rollout.tail_batching.max_waves=0"])


# --------------------------------------------------------------- a process done early keeps polling
class LengthService:
    """Stands in for RolloutService: request (prompt p, sample j) decodes `lengths[p][j]` tokens, one per step."""

    def __init__(self, lengths):
        self.lengths, self.gen, self.req, self.live = lengths, {}, [], set()

    def add(self, ids, params):
        p = len(self.req) // len(self.lengths[0])
        rids = list(range(len(self.req), len(self.req) + params.n))
        self.req += [(p, j) for j in range(params.n)]
        self.live |= set(rids)
        self.gen.update({r: 0 for r in rids})
        return rids

    def has_work(self):
        return bool(self.live)

    def step(self):
        out = []
        for r in sorted(self.live):
            self.gen[r] += 1
            p, j = self.req[r]
            if self.gen[r] == self.lengths[p][j]:
                out.append(Completion(r, [1], [7] * self.gen[r], [], "stop", 0))
        self.live -= {c.request_id for c in out}
        return out

    def sequence_stats(self):
        return [{"request_id": r, "generated": self.gen[r]} for r in sorted(self.live)]

    def abort(self, rid):
        if rid not in self.live:
            return None
        self.live.discard(rid)
        return Completion(rid, [1], [7] * self.gen[rid], [], "abort", 0)


class _Tok:
    def decode(self, ids):
        return "x" * len(ids)


def test_a_process_done_early_keeps_polling_with_the_others():
    """Process 0's requests all finish in 2 steps, process 1's need up to 30: the race is not decided when
    process 0 runs out of work, so it must keep gathering until it is (before, it left the loop and
    process 1 waited forever). Both agree on the accepted prompts."""
    lengths = [[[2, 2]] * 2, [[30, 3], [4, 30]]]          # 2 processes x 2 prompts x 2 responses
    base = TrainConfig()
    cfg = dataclasses.replace(base, algo=dataclasses.replace(base.algo, group_size=2, prompts_per_step=4))
    gathers = barrier_gather(2)
    out = [None, None]

    def run(r):
        race = Race([0 + r, 2 + r], 2, 1, 3, gathers[r])
        rows = [{"index": 10 * r + p, "answer": "", "task": "copy", "reward": "tests.test_user_reward:length_reward"}
                for p in range(2)]
        with RewardPool(num_workers=0) as pool:
            _, _, st = rl.rollout_and_score(LengthService(lengths[r]), pool, _Tok(), cfg, [[1], [1]], rows, 0, (),
                                            race=race, responses=2)
        out[r] = st
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "deadlock: a process stopped polling the race"
    # keys: process 0's prompts 0, 2 (R0-th length 2, 2); process 1's 1, 3 (3, 4): first 3 = p0's both + p1's first
    assert out[0]["accepted"] == [0, 1] and out[1]["accepted"] == [0]


# ---------------------------------------------------------------------------- the real engine
STOP = tuple(range(100, 160))


def constant_reward(response: str, answer: str, task: str) -> float:
    return 0.5


def two_level_reward(response: str, answer: str, task: str) -> float:
    return float(len(response) >= 6)


def test_waves_on_the_engine(monkeypatch):
    """10 steps of P0=4 x R0=2 with a reward that is often equal within a group: every trained group has
    unequal rewards, short rounds draw more waves when short, and drawn = trained ⊎ queued ⊎ dropped."""
    monkeypatch.setattr(rl, "reward_fn_for", lambda task: "tests.test_dynamic_sampling:two_level_reward")
    cfg_m = PRESETS["tiny-qwen3"]
    base = TrainConfig()
    cfg = dataclasses.replace(base, algo=dataclasses.replace(base.algo, group_size=2, prompts_per_step=4),
                              rollout=dataclasses.replace(base.rollout, max_new_tokens=16, temperature=1.0))
    svc = RolloutService(cfg_m, init(jax.random.key(0), cfg_m), tp=1, instances=2, page_size=8, max_batch=16,
                         max_seq_len=48)
    rng = np.random.default_rng(0)
    dataset = [{"prompt_ids": rng.integers(200, 500, size=int(rng.integers(3, 9))).tolist(), "answer": "",
                "task": "copy"} for _ in range(400)]
    tb = TailBatcher(4, 2, 1.25, 1.25)
    loader = DataLoader(dataset, tb.launch, seed=1)
    drawn, trained, dropped, waves, kinds = [], [], [], [], []

    def draw():
        rows = next(loader)
        drawn.extend(row["index"] for row in rows)
        return rows

    with RewardPool(num_workers=0) as pool:
        def rollout(rows, race=None, responses=None):
            prompts = [row["prompt_ids"] for row in rows]
            comps, rewards, st = rl.rollout_and_score(svc, pool, _Tok(), cfg, prompts, rows, step, STOP,
                                                      race=race, responses=responses)
            dropped.extend(rows[p]["index"] for p in st["dropped"])
            return comps, rewards, st

        for step in range(10):
            queued_before = [i for _, i in tb.queue]
            got = tail_round(tb, draw, dataset, step, rollout, dynamic_sampling=True, max_waves=3)
            kinds.append(got.plan.kind)
            waves.append(got.stats["waves"])
            r = got.rewards.reshape(-1, 2)
            assert len(r) == len(got.rows) == 4 - got.stats["batch_short"]
            assert all(g[0] != g[1] for g in r)                        # only groups with signal train
            if got.plan.kind == "long":
                long_dropped = [row["index"] for row in got.plan.rows if row not in got.rows]
                dropped.extend(long_dropped)
                assert sorted(queued_before[:4]) == sorted(long_dropped + [row["index"] for row in got.rows])
            trained += [row["index"] for row in got.rows]
            assert sorted(drawn) == sorted(trained + [i for _, i in tb.queue] + dropped)
            assert len(set(trained)) == len(trained)
            assert not svc.has_work()
    assert max(waves) > 1 and "long" in kinds and dropped
