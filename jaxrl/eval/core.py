"""One held-out evaluation: every prompt sampled through the rollout engine (the one generation path of
training and `python -m jaxrl.generate`), every sample scored by its row's reward in the reward pool.

    result = evaluate(svc, pool, tokenizer, rows, prompts, section, max_new_tokens=48, rewards=cfg.rewards)
    result.metrics       # {"eval/accuracy", "eval/pass@k", "eval/len_mean", ...}, over every process's prompts
    result.samples       # this process's samples: index, sample, prompt, answer, completion, reward, tokens

Metrics (summed over processes, then divided): `accuracy` is mean@n, the mean reward over every sample (with a
0/1 reward, the share right); `pass@k` the unbiased estimator 1 - C(n-c, k)/C(n, k) per prompt (Chen et al.
2021, eq. 1; c = the samples whose reward is above `pass_threshold`), averaged; `len_mean` the mean response
length in tokens; `truncated` the share of samples cut at max_new_tokens.

Sampling: prompt i samples with seed `prompt_seed(section.seed, row index)`, so an evaluation's samples do not
depend on which process evaluates which prompt. PAT's switch driver is off for the evaluation (its decisions
are agreed across processes at common ticks, and the processes hold different prompts here) and the rewards
go to the pool directly, not through the trainer's `RewardScheduler` (whose adaptive code timeouts would learn
from held-out responses).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import numpy as np

from jaxrl.rewards.registry import reward_fn_for, reward_item, reward_name
from jaxrl.rollout import RolloutService, SamplingParams
from jaxrl.rollout.params import prompt_seed


@dataclasses.dataclass
class EvalResult:
    metrics: dict[str, float]
    samples: list[dict]

    def extremes(self, n: int) -> tuple[list[dict], list[dict]]:
        """The `n` worst and the `n` best samples (by reward; ties by prompt index, then sample)."""
        order = sorted(self.samples, key=lambda s: (s["reward"], s["index"], s["sample"]))
        return order[:n], order[::-1][:n] if n else []


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `c` correct of `n` samples: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _generate(svc: RolloutService, rows: list[dict], prompts: list[list[int]], section, max_new_tokens: int,
              eos_ids, progress=None) -> dict[tuple[int, int], object]:
    """(prompt position, sample) -> Completion, every prompt queued at once (the engine batches them)."""
    where = {}
    for p, (row, ids) in enumerate(zip(rows, prompts)):
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=section.temperature, n=section.samples,
                                stop_token_ids=tuple(eos_ids), seed=prompt_seed(section.seed, int(row["index"])))
        for j, rid in enumerate(svc.add(ids, params)):
            where[rid] = (p, j)
    out = {}
    for c in svc.stream():
        if c.request_id in where:
            out[where[c.request_id]] = c
            if progress is not None:
                progress(len(out), len(where))
    return out


@contextlib.contextmanager
def eval_engine(svc: RolloutService):
    """The engine for an evaluation: idle before it (RuntimeError otherwise), PAT's switch driver off meanwhile
    (see the module docstring)."""
    if svc.has_work():
        raise RuntimeError("evaluate: the rollout engine has requests in flight; evaluate between rollouts")
    adaptive, svc.adaptive = svc.adaptive, None
    try:
        yield
    finally:
        svc.adaptive = adaptive


def evaluate(svc: RolloutService, pool, tokenizer, rows: list[dict], prompts: list[list[int]], section, *,
             max_new_tokens: int, rewards, allsum=None, progress=None) -> EvalResult:
    """Sample and score this process's held-out `rows` (dicts with prompt, answer, task, index; their token
    ids `prompts`). `pool`: a `RewardPool`; `rewards`: the `rewards` config section (fn, registry); `allsum`:
    sums a list of floats over processes (None: one process); `progress(done, total)` after each completion."""
    t0 = time.perf_counter()
    with eval_engine(svc):
        comps = _generate(svc, rows, prompts, section, max_new_tokens, tokenizer.eos_ids, progress)
    keys = sorted(comps)
    texts = {key: tokenizer.decode(comps[key].tokens) for key in keys}
    items = [reward_item(reward_name(rows[p], rewards.fn, rewards.registry, default=reward_fn_for), texts[p, j],
                         rows[p]) for p, j in keys]
    scores, stats = pool.score(items) if items else (np.zeros(0, np.float32), dict(timeouts=0, crashes=0))
    samples = sample_records(rows, {key: (comps[key], texts[key], float(r)) for key, r in zip(keys, scores)})
    return EvalResult(metrics(samples, len(rows), section, stats, allsum, time.perf_counter() - t0), samples)


def sample_records(rows: list[dict], done: dict) -> list[dict]:
    """One record per sample from {(prompt position, sample): (completion, its text, its reward)}."""
    return [dict(index=int(rows[p]["index"]), sample=j, prompt=rows[p]["prompt"], answer=rows[p]["answer"],
                 completion=text, reward=reward, tokens=len(c.tokens), finish_reason=c.finish_reason)
            for (p, j), (c, text, reward) in sorted(done.items())]


def metrics(samples: list[dict], n_prompts: int, section, stats: dict, allsum, seconds: float) -> dict:
    """The eval/ metrics of `samples` (this process's, of `n_prompts` prompts), summed over processes by `allsum`."""
    ks = section.ks
    correct: dict[int, int] = {}
    for s in samples:
        correct[s["index"]] = correct.get(s["index"], 0) + (s["reward"] > section.pass_threshold)
    local = [n_prompts, len(samples), sum(s["reward"] for s in samples), sum(s["tokens"] for s in samples),
             sum(s["finish_reason"] == "length" for s in samples), stats.get("timeouts", 0), stats.get("crashes", 0)]
    local += [sum(pass_at_k(section.samples, c, k) for c in correct.values()) for k in ks]
    total = list(allsum(local)) if allsum is not None else local
    prompts, n = total[0], max(total[1], 1)
    out = {"eval/prompts": int(prompts), "eval/samples": int(total[1]), "eval/accuracy": total[2] / n,
           "eval/len_mean": total[3] / n, "eval/truncated": total[4] / n, "eval/reward_timeouts": int(total[5]),
           "eval/reward_crashes": int(total[6]), "eval/seconds": seconds}
    for k, v in zip(ks, total[7:]):
        out[f"eval/pass@{k}"] = v / max(prompts, 1)
    return out
