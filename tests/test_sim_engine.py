"""The simulated engine makes the real engine's scheduling decisions.

The same requests (every response runs to its own max_new_tokens, no stop tokens, so the real model's
tokens cannot end one early) go to a real `RolloutService` (tiny model, 8 fake CPU devices) and to a
`SimService` with the same engine shape. After every engine step both logs must be equal: which requests
finished (with their reason, length, instance and preemption count), and every live sequence's instance,
state, context length and pages — i.e. the same admissions, page allocations, preemptions and retirements.
PAT's switch (a forcing profile: the decision depends only on the live batch), a preempting pool with
recomputation, and a tail-batching race through `rl.rollout_and_score` are compared the same way."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl.rollout import RolloutService, SamplingParams
from jaxrl.rollout.adaptive_tp import Predictor, SwitchController
from jaxrl.rollout.tail_batching import Race
from jaxrl.rollout.tp_switch import AdaptiveTP
from jaxrl.sim.cost import AnalyticCost
from jaxrl.sim.engine import Clock, SimService
from jaxrl.sim.hardware import gpu
from models import PRESETS, init
from tests.pat_profiles import forcing_profile

CFG = PRESETS["tiny-qwen3"]
LENGTHS = (7, 19, 3, 26, 12, 9, 30, 15)             # each prompt's max_new_tokens (its responses' length)
PROMPT_LENS = (3, 9, 16, 17, 30, 5, 11, 22)


@pytest.fixture(scope="module")
def weights():
    return init(jax.random.key(0), CFG)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(3, CFG.vocab_size, n).tolist() for n in PROMPT_LENS]


def _sim(**kw):
    cost = AnalyticCost(CFG, gpu("h100"), dtype_bytes=4)
    return SimService(CFG, cost, Clock(), devices=8, lengths=lambda p, params: [params.max_new_tokens] * params.n,
                      **kw)


def _params(k, n):
    return SamplingParams(max_new_tokens=LENGTHS[k], temperature=1.0, n=n, seed=k, stop_token_ids=())


def _log(svc, prompts, n, moves=None):
    """Add every prompt, step to the end; one entry per engine step: completions and live sequences."""
    for k, p in enumerate(prompts):
        svc.add(p, _params(k, n))
    log, step = [], 0
    while svc.has_work():
        done = sorted((c.request_id, c.finish_reason, len(c.tokens), c.instance, c.preemptions) for c in svc.step())
        live = sorted((s["request_id"], s["instance"], s["state"], s["context_len"], s["pages"], s["preemptions"])
                      for s in svc.sequence_stats())
        log.append((step, tuple(svc.layout), done, live))
        if moves and step in moves:
            moves[step](svc)
        step += 1
    return log


@pytest.mark.parametrize("case", [
    ("tp1x2, preempting pool", dict(tp=1, instances=2, page_size=4, num_pages=24, max_seq_len=64, max_batch=8), 3),
    ("tp2x4, overlap off", dict(tp=2, instances=4, page_size=8, num_pages=32, max_seq_len=64, overlap=False), 2),
], ids=lambda c: c[0])
def test_same_admissions_pages_preemptions_and_completions(weights, prompts, case):
    _, shape, n = case
    real = _log(RolloutService(CFG, weights, **shape), prompts, n)
    sim = _log(_sim(**shape), prompts, n)
    assert sim == real
    preempted = max(entry[3][k][5] for entry in real for k in range(len(entry[3]))) if real else 0
    if shape["num_pages"] == 24:
        assert preempted > 0, "the pool was meant to preempt"


def test_same_pat_switches(weights, prompts):
    """PAT's controller on both engines (a forcing profile): the same decisions at the same steps, the
    same layouts and logs afterwards (KV migrated)."""
    shape = dict(tp=2, instances=4, page_size=8, num_pages=48, max_seq_len=64)
    logs, decisions = [], []
    for svc in (RolloutService(CFG, weights, **shape), _sim(**shape)):
        svc.adaptive = AdaptiveTP(SwitchController(Predictor(forcing_profile("large")), [2, 8], 8, kv="migrate"),
                                  check_every=3)
        logs.append(_log(svc, prompts, 2))
        decisions.append([(d.step, d.current, d.tp, d.kv, d.batch, d.tokens) for d in svc.adaptive.decisions])
    assert logs[0] == logs[1]
    assert decisions[0] == decisions[1] and any(d[1] != d[2] for d in decisions[0])


class _NoRewards:
    """A reward pool nothing is submitted to (score=False)."""

    def poll(self, timeout=0.0):
        return []


def test_same_tail_batching_race(weights, prompts):
    """`rl.rollout_and_score` with a tail-batching race (5 prompts x 3 responses, keep 2 of 3, accept 3
    prompts): the same aborts, accepted prompts, kept responses and engine steps on both engines."""
    from jaxrl.config.train import AlgoSection, TrainConfig
    from jaxrl.config.train_rollout import TrainSamplingSection
    from jaxrl.train import rl

    cfg = TrainConfig(algo=AlgoSection(group_size=2, prompts_per_step=3),
                      rollout=TrainSamplingSection(max_new_tokens=max(LENGTHS)))
    rows = [{"index": k, "answer": "", "task": "copy"} for k in range(5)]

    def params_fn(row, params):
        return dataclasses.replace(params, max_new_tokens=LENGTHS[row["index"]], stop_token_ids=())

    shape = dict(tp=1, instances=2, page_size=8, num_pages=48, max_seq_len=64)
    out = []
    for svc in (RolloutService(CFG, weights, **shape), _sim(**shape)):
        race = Race(range(5), responses=3, keep=2, accept=3)
        comps, _, st = rl.rollout_and_score(svc, _NoRewards(), None, cfg, prompts[:5], rows, 0, (), race=race, responses=3,
                                            params_fn=params_fn, score=False)
        out.append(([(c.request_id, len(c.tokens)) for c in comps], st["accepted"], st["aborted"],
                    st["aborted_tokens"], st["engine_steps"], st["wasted_tokens"]))
    assert out[0] == out[1]
    assert out[0][2] > 0, "the race was meant to abort responses"
