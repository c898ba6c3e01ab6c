"""Held-out evaluation inside a training run (the `eval` section), as one component of the trainer.

    ev, dataset = PeriodicEval.build(cfg, tokenizer, dataset)   # (None, dataset) when eval is off
    if ev is not None and ev.due(step):
        metrics = ev.run(step, svc, pool, samples_log)            # eval/... scalars; worst/best to samples.jsonl

It evaluates before RL step `step` (after `step` updates: before step 0, every `eval.every` steps, after the
last), on the weights the rollout instances hold (with `trainer.max_staleness` = k they may be up to k versions
behind the trained ones; `eval/policy_version` says which). The trainer logs the metrics with step `step`'s
row of metrics.jsonl, and the final evaluation (step = `steps`) as a row of its own; every sample of an
evaluation goes to `run_dir/evals/step<N>.jsonl`. Each process evaluates
its own share of the prompts (every `process_count`-th); the metrics are summed over processes. A multi-turn run
(`rollout.env`) evaluates trajectories: each held-out sample stepped by its row's environment through the
trainer's own rollout path, its reward the environment's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import jax

from jaxrl.config.train import TrainConfig
from jaxrl.data import PromptDataset, encode_prompts
from jaxrl.rollout.params import prompt_seed
from jaxrl.train.distributed import global_sum
from jaxrl.train.rollout_components import RequestParams, TrajectoryScores
from jaxrl.train.rollout_loop import Requests, RolloutLoop
from jaxrl.train.trajectories import MultiTurn
from jaxrl.train.samples import SamplesLog

from .core import EvalResult, eval_engine, evaluate, metrics, sample_records
from .heldout import indexed, split_heldout

log = logging.getLogger("jaxrl.eval")


def heldout_rows(cfg: TrainConfig, tokenizer, dataset: PromptDataset) -> tuple[list[dict], PromptDataset]:
    """(the held-out rows that fit data.max_prompt_len, the training rows): `eval.data`'s, or `eval.split`'s."""
    e, d = cfg.eval, cfg.data
    if e.data is not None:
        if not os.path.isfile(e.data):
            raise ValueError(f"eval.data={os.path.abspath(e.data)}: no such file")
        rows = indexed(PromptDataset.from_file(e.data, prompt_key=d.prompt_key, answer_key=d.answer_key))
    else:
        dataset, rows = split_heldout(dataset, e.split, cfg.seed)
    lens = [len(p) for p in encode_prompts(rows, tokenizer, d.chat)]
    fit = [row for row, n in zip(rows, lens) if n <= d.max_prompt_len]
    if not fit:
        raise ValueError(f"eval: no held-out prompt fits data.max_prompt_len={d.max_prompt_len} (longest {max(lens)})")
    if len(fit) < len(rows):
        log.warning("eval: skipped %d of %d held-out prompts longer than data.max_prompt_len", len(rows) - len(fit),
                    len(rows))
    return fit[:e.max_prompts] if e.max_prompts else fit, dataset


class PeriodicEval:
    def __init__(self, cfg: TrainConfig, tokenizer, rows: list[dict]):
        self.cfg, self.section, self.steps, self.tokenizer = cfg, cfg.eval, cfg.steps, tokenizer
        self.max_new_tokens, self.rewards = cfg.rollout.max_new_tokens, cfg.rewards
        self.all_rows = rows
        self.rows = rows[jax.process_index()::jax.process_count()]      # this process's share
        self.prompts = encode_prompts(self.rows, tokenizer, cfg.data.chat)
        self.last: EvalResult | None = None
        self.out_dir = Path(cfg.run_dir) / "evals"

    @classmethod
    def build(cls, cfg: TrainConfig, tokenizer, dataset: PromptDataset) -> tuple[PeriodicEval | None, PromptDataset]:
        """The evaluator and the training rows (without the held-out prompts of a split); (None, dataset) when
        `eval` is off. ValueError (one line) on a held-out set that cannot be used."""
        if not cfg.eval.enabled:
            return None, dataset
        rows, dataset = heldout_rows(cfg, tokenizer, dataset)
        return cls(cfg, tokenizer, rows), dataset

    def due(self, step: int) -> bool:
        return self.section.due(step, self.steps)

    def run(self, step: int, svc, pool, samples: SamplesLog | None = None, version: int | None = None,
            turns: MultiTurn | None = None) -> dict:
        """Evaluate the weights `svc` holds; their worst and best completions to `samples` as of `step`. `turns`
        (multi-turn runs): each sample a trajectory stepped by its row's environment, as in training."""
        allsum = lambda xs: list(global_sum(xs, tag="eval"))      # noqa: E731
        if turns is None:
            self.last = evaluate(svc, pool, self.tokenizer, self.rows, self.prompts, self.section,
                                 max_new_tokens=self.max_new_tokens, rewards=self.rewards, allsum=allsum)
        else:
            self.last = self._trajectories(svc, pool, turns, allsum)
        m = dict(self.last.metrics)
        if version is not None:
            m["eval/policy_version"] = int(version)
        self._dump(step)
        if samples is not None and self.section.log_completions:
            worst, best = self.last.extremes(self.section.log_completions)
            samples.write(step, "eval_worst", worst)
            samples.write(step, "eval_best", best)
        if jax.process_index() == 0:
            ks = "".join(f", pass@{k} {m[f'eval/pass@{k}']:.3f}" for k in self.section.ks)
            print(f"[eval] after {step} updates: accuracy {m['eval/accuracy']:.3f}{ks} over {m['eval/prompts']} "
                  f"prompts x {self.section.samples}, mean length {m['eval/len_mean']:.1f} tokens "
                  f"({m['eval/seconds']:.1f} s)", flush=True)
        return m

    def _trajectories(self, svc, pool, turns: MultiTurn, allsum) -> EvalResult:
        """Multi-turn: the held-out prompts' trajectories through the trainer's own rollout path
        (`jaxrl.train.rollout_loop` with the run's environments), sampled as `eval` says."""
        s, t0 = self.section, time.perf_counter()

        def params(row, p):
            return dataclasses.replace(p, temperature=s.temperature, seed=prompt_seed(s.seed, int(row["index"])))

        with eval_engine(svc):
            loop = RolloutLoop(svc, Requests.from_config(self.cfg, 0, self.tokenizer.eos_ids, s.samples),
                               TrajectoryScores(turns.round(svc, self.rows)), hooks=[RequestParams(params)])
            comps, rewards, stats = loop.run(self.prompts, self.rows)
        done = {(i // s.samples, i % s.samples): (c, self.tokenizer.decode(c.tokens), float(r))
                for i, (c, r) in enumerate(zip(comps, rewards))}
        samples = sample_records(self.rows, done)
        return EvalResult(metrics(samples, len(self.rows), s, stats, allsum, time.perf_counter() - t0), samples)

    def _dump(self, step: int) -> None:
        """Every sample of this process's share to `run_dir/evals/step<N>.jsonl` (process k > 0: `.process<k>`)."""
        k = jax.process_index()
        path = self.out_dir / (f"step{step}.jsonl" if k == 0 else f"step{step}.process{k}.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(s) + "\n" for s in self.last.samples))
        os.replace(tmp, path)
