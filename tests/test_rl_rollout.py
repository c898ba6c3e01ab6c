"""Rollout with streamed reward scoring equals rollout-then-score, prompt-major, with the stats."""

import dataclasses
import time

import jax
import numpy as np
import pytest

from jaxrl.config.train import TrainConfig
from jaxrl.rewards.pool import RewardPool
from jaxrl.rollout import RolloutService
from jaxrl.train import rl
from models import PRESETS, init
from models.tokenizer import CharTokenizer

CFG = PRESETS["tiny-char"]


def length_reward(response: str, answer: str, task: str) -> float:
    """A reward that varies with the sample (random weights rarely earn the built-in task rewards)."""
    return len(response) / 10.0 + (0.5 if answer and response.startswith(answer[:1]) else 0.0)


@pytest.mark.parametrize("workers,fn", [(0, "tests.test_rl_rollout:length_reward"), (1, None)])
def test_rollout_and_score_equals_scoring_afterwards(workers, fn, monkeypatch):
    if fn:
        monkeypatch.setattr(rl, "reward_fn_for", lambda task: fn)
    base = TrainConfig()
    cfg = dataclasses.replace(base, algo=dataclasses.replace(base.algo, group_size=3),
                              rollout=dataclasses.replace(base.rollout, max_new_tokens=12, temperature=1.0))
    tok = CharTokenizer()
    texts = [("abcab", "copy"), ("hello", "reverse"), ("zz", "repeat"), ("a long prompt here", "copy")]
    rows = [{"index": i, "task": task, "answer": text[::-1]} for i, (text, task) in enumerate(texts)]
    prompts = [tok.encode(text) for text, _ in texts]
    svc = RolloutService(CFG, init(jax.random.key(0), CFG), page_size=8, num_pages=64, max_batch=8)
    with RewardPool(num_workers=workers, timeout_s=10.0) as pool:
        t0 = time.perf_counter()
        comps, rewards, stats = rl.rollout_and_score(svc, pool, tok, cfg, prompts, rows, 0, tok.eos_ids)
        wall = time.perf_counter() - t0
        items = [(rl.reward_fn_for(rows[k // 3]["task"]), tok.decode(c.tokens), rows[k // 3]["answer"],
                  rows[k // 3]["task"]) for k, c in enumerate(comps)]
        want, _ = pool.score(items)
    assert len(comps) == 12 and all(c.prompt == prompts[k // 3] for k, c in enumerate(comps))
    assert [c.request_id for c in comps] == sorted(c.request_id for c in comps)   # prompt-major
    np.testing.assert_array_equal(rewards, want)
    if fn:
        assert len(set(rewards.tolist())) > 1
    assert stats["items"] == len(comps) and stats["timeouts"] == 0 and stats["crashes"] == 0
    assert stats["seconds"] <= wall            # the wait for the last scores: part of the call
