"""PAT with several processes: one decision for all, at the same tick (`AdaptiveTP.agree`).

Each process drives the pool of its own devices; at a check tick the processes exchange their predictions
and every one applies the decision that minimises the slowest pool's predicted time. Here two pools of 4
devices in one process stand for two processes, each driven from its own thread through
`rl.rollout_and_score` (the train run's rollout loop), with a barrier for the key-value-store exchange; the
decision rule itself is checked against a fake other process's prediction."""

import dataclasses
import threading

import jax
import numpy as np
import pytest

from jaxrl.config.train import TrainConfig
from jaxrl.rewards.pool import RewardPool
from jaxrl.rollout import RolloutService
from jaxrl.rollout.adaptive_tp import Predictor, SwitchController
from jaxrl.rollout.tp_switch import AdaptiveTP
from jaxrl.train import rl
from tests.pat_profiles import forcing_profile
from tests.test_movable_state import CFG, GREEDY, SAMPLED, SERVICE, _same, prompts, static, weights  # noqa: F401


class Exchange:
    """What `distributed.exchange` does between processes, between threads: every caller's array, in order."""

    def __init__(self, n: int):
        self.barrier, self.slots, self.calls = threading.Barrier(n, timeout=120), [None] * n, 0

    def member(self, k: int):
        def agree(x):
            self.slots[k] = np.asarray(x)
            self.barrier.wait()
            out = list(self.slots)
            if k == 0:
                self.calls += 1
            self.barrier.wait()
            return out
        return agree


def _driver(prefer="large", check_every=3):
    return AdaptiveTP(SwitchController(Predictor(forcing_profile(prefer)), [2, 4], 4, kv="migrate"),
                      check_every=check_every)


def _pool(weights, devices):  # noqa: F811
    svc = RolloutService(CFG, weights, tp=2, instances=2, devices=devices, **SERVICE)
    svc.adaptive = _driver()
    return svc


@pytest.mark.parametrize("other_tp4_s, switch", [(1e-3, True), (1e6, False)])
def test_the_decision_minimises_the_slowest_pools_time(weights, prompts, static, other_tp4_s, switch):  # noqa: F811
    """This pool's prediction wants TP 4 (the forcing profile); the other process predicts `other_tp4_s` for
    TP 4 and 1 s for staying at TP 2. The agreed cost of each candidate is the larger of the two, so a slow
    TP 4 on the other pool keeps both at TP 2; either way the tokens are the static layout's."""
    svc = _pool(weights, jax.devices()[:4])
    seen = []

    def agree(mine):
        # work while this pool has (done together), 5 live, current 1 s, TP 2 1 s, TP 4 other_tp4_s
        other = np.asarray([mine[0], 5, 1.0, 1.0, other_tp4_s])
        seen.append(mine)
        return [mine, other]

    svc.adaptive.agree = agree
    svc.adaptive.begin()
    order = [rid for p in prompts for rid in svc.add(p, SAMPLED)]
    got = {}
    while svc.has_work() or svc.adaptive.pending():
        if not svc.has_work():
            svc.adaptive.idle_tick(svc)
            continue
        for c in svc.step():
            got[c.request_id] = c
    _same([got[r] for r in order], static["sampled"])
    d = svc.adaptive.decisions[0]
    mine = seen[0]
    assert d.step == 3 and d.actual["agreed"]["processes"] == 2
    assert d.actual["agreed"]["cost"] == {2: max(mine[3], 1.0), 4: max(mine[4], other_tp4_s)}
    assert d.actual["agreed"]["current_s"] == max(mine[2], 1.0)
    assert d.switch == switch and svc.layout == ([4] if switch else [2, 2])
    assert not any(x.switch for x in svc.adaptive.decisions[1:])      # TP 4 is the largest candidate
    assert seen[-1][0] == 0.0                                         # the last exchange: this pool is done


def test_two_pools_switch_at_the_same_tick_and_a_pool_without_work_takes_part(weights, prompts, static):  # noqa: F811
    """Pool 0 (devices 0-3) generates every prompt; pool 1 (devices 4-7) got no prompt this round (a long
    round of tail batching can leave a process none). Both run `rl.rollout_and_score`: pool 1 keeps ticking
    with pool 0, both switch to TP 4 at the first check (tick 3), and both leave the loop at the same
    exchange; pool 0's (greedy) tokens are the static layout's."""
    base = TrainConfig()
    cfg = dataclasses.replace(base, algo=dataclasses.replace(base.algo, group_size=2),     # greedy: the static twin
                              rollout=dataclasses.replace(base.rollout, max_new_tokens=GREEDY.max_new_tokens,
                                                          temperature=0.0))
    pools = [_pool(weights, jax.devices()[:4]), _pool(weights, jax.devices()[4:])]
    ex = Exchange(2)
    for k, svc in enumerate(pools):
        svc.adaptive.agree = ex.member(k)
    work = [prompts, []]
    out, errors = [None, None], []

    def run(k):
        rows = [{"index": i, "task": "copy", "answer": ""} for i in range(len(work[k]))]
        try:
            with RewardPool(num_workers=0) as pool:
                out[k] = rl.rollout_and_score(pools[k], pool, None, cfg, work[k], rows, 0, (), score=False)
        except BaseException as e:      # (re-raised below, in the test's thread)
            errors.append(e)
            ex.barrier.abort()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    comps, _, stats = out[0]
    assert len(comps) == 2 * len(prompts) and out[1][0] == []
    d0, d1 = (p.adaptive.decisions for p in pools)
    assert [d.step for d in d0] == [d.step for d in d1]             # every check, on both
    assert [(d.step, d.tp) for d in d0 if d.switch] == [(d.step, d.tp) for d in d1 if d.switch] == [(3, 4)]
    assert d0[0].batch > 0 and all(d.batch == 0 for d in d1)        # pool 1 had nothing live, and took part
    assert pools[0].layout == pools[1].layout == [4]
    assert ex.calls == len(d0) + 1                                    # the last exchange: both done
    assert all(not p.adaptive.pending() for p in pools)
    _same(comps[0::2], static["greedy"])     # prompt-major, 2 greedy samples each: the static generation's
    _same(comps[1::2], static["greedy"])


@pytest.mark.processes
def test_two_process_train_run_agrees_on_every_switch(tmp_path):
    """`python -m jaxrl.train` on 2 processes with PAT on a forcing profile: each process's pool (tp1x2 on its
    own 2 devices) switches to tp2x1 in every step, and both processes' decision records (process 0's
    pat_decisions.jsonl, process 1's pat_decisions.process1.jsonl) show the same checks, at the same ticks,
    with the same choices, agreed between 2 processes."""
    import json
    import subprocess
    import sys

    from tests.train_runs import ROOT, TINY, _env, _metrics

    prof = forcing_profile("large")
    prof.key["devices"] = 2
    prof.save(tmp_path / "prof.json")
    run = tmp_path / "run"
    cmd = [str(ROOT / "scripts" / "launch_local.sh"), "2", sys.executable, "-m", "jaxrl.train", f"run_dir={run}",
           *TINY, "steps=2", "warm_start.steps=0", "save_every=null", "engine.tp=1", "engine.instances=2",
           "train_layout.fsdp=4",
           "engine.adaptive_tp.enabled=true", f"engine.adaptive_tp.profile={tmp_path / 'prof.json'}",
           "engine.adaptive_tp.candidates=[1, 2]", "engine.adaptive_tp.check_every=4",
           "engine.adaptive_tp.kv=recompute"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    assert [r["pat/switches"] for r in _metrics(run)] == [1, 1]
    recs = [[json.loads(line) for line in (run / name).read_text().splitlines()]
            for name in ("pat_decisions.jsonl", "pat_decisions.process1.jsonl")]
    seen = [[(r["rl_step"], r["step"], r["current"], r["tp"], r["switch"]) for r in rs] for rs in recs]
    assert seen[0] == seen[1] and seen[0]
    assert all(r["actual"]["agreed"]["processes"] == 2 for rs in recs for r in rs)
    assert [(s, cur, tp) for s, _, cur, tp, sw in seen[0] if sw] == [(0, 1, 2), (1, 1, 2)]


def test_committed_forcing_profile_is_current(tmp_path):
    """tests/golden/pat_forcing_large.json (the profile `test_processes_equal_one[pat_kv_two]` names by path)
    is `forcing_profile("large")` as saved today."""
    import json

    from tests.train_runs import PAT_PROFILE

    forcing_profile("large").save(tmp_path / "now.json")
    assert json.loads(PAT_PROFILE.read_text()) == json.loads((tmp_path / "now.json").read_text())
