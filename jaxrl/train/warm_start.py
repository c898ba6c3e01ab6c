"""The supervised warm start: NLL steps on demonstrations before RL, so the policy sometimes succeeds: the
built-in tasks' ideal responses (with an environment, `rollout.env`: each task's demonstration turns played
against it, the observations masked), or the `warm_start.response_key` column of each row (e.g. a teacher's
sampled responses). Skipped, with one line, for data of other tasks without that column."""

from __future__ import annotations

import dataclasses

import jax
from tqdm import tqdm

from jaxrl.config.train import TrainConfig
from jaxrl.data import DataLoader, encode_demonstrations, encode_prompts
from jaxrl.data.tasks import TASKS, Example, get_task
from jaxrl.envs.registry import env_name, make_env
from jaxrl.envs.render import ObservationFormat, demonstration

from . import rl
from .batch import Sample
from .optim import init_state, make_optimizer
from .step import LossSpec, make_train_step
from .update import Updater


def demonstrations(rows: list[dict], tokenizer, cfg: TrainConfig) -> list[Sample]:
    """One training sample per row: its `warm_start.response_key` column (+ EOS), else its task's ideal response;
    with an environment (rollout.env) the task's ideal turns played against it, the observations masked out
    (`jaxrl.envs.render.demonstration`)."""
    key = cfg.warm_start.response_key
    if key is not None:
        prompts = encode_prompts(rows, tokenizer, cfg.data.chat)
        return [Sample(p, tokenizer.encode(row[key]) + [tokenizer.eos_ids[0]], 1.0) for p, row in zip(prompts, rows)]
    if getattr(cfg.rollout, "env", None) is None:
        return [Sample(p, r, 1.0) for p, r in encode_demonstrations(rows, tokenizer, cfg.data.chat)]
    fmt, out = ObservationFormat(tokenizer, cfg.data.chat), []
    for row in rows:
        turns = get_task(row["task"]).demonstration_turns(Example(row["prompt"], row["answer"], row["task"]))
        opening, response, mask = demonstration(make_env(env_name(row, cfg.rollout.env)), row, turns, tokenizer,
                                                fmt, tokenizer.eos_ids[0])
        prompt = encode_prompts([{**row, "prompt": row["prompt"] + opening}], tokenizer, cfg.data.chat)[0]
        out.append(Sample(prompt, response, 1.0, mask=mask))
    return out


def loss_spec(cfg: TrainConfig, rl_spec: LossSpec | None) -> LossSpec:
    """The warm start's loss: the NLL (`kind="sft"`), or the RL update's own `rl_spec` where its gradient at
    advantage 1 (every demonstration's: `demonstrations`) is the NLL's bit for bit: on-policy the ratio is
    exp(logp - sg(logp)) = 1 and unclipped, so the term's derivative in logp is -A = -1, the NLL's; with
    temperature 1, no KL and no entropy term, nothing else enters (tests/test_bounded_shapes.py). Then the
    warm start and the RL update run one gradient program (`step.make_grad_step`), compiled once: ~3-4 s of
    the quickstart's cold start. Only the "loss" sum differs: the warm start reports the "nll" one."""
    sft = LossSpec.from_config(cfg.algo, temperature=1.0, trainer=cfg.trainer, kind="sft")
    # the same spec but for the kind and the clip range (unused at ratio 1): temperature 1, no KL, entropy or dual clip
    same = rl_spec is not None and rl_spec.kind == "rl" and \
        dataclasses.replace(rl_spec, kind="sft", clip_low=sft.clip_low, clip_high=sft.clip_high) == sft
    return rl_spec if same else sft


def supervised_warm_start(cfg: TrainConfig, dataset, tokenizer, params, shardings, mesh, pack_len: int,
                          mb_rows: int | None, model_cfg, metrics, *, is_main: bool = True,
                          rl_spec: LossSpec | None = None):
    """`cfg.warm_start.steps` NLL steps (token-mean, its own optimizer) from `params`; returns the new
    params. `mb_rows`: the fixed micro-batch rows of the RL update (None: the fused whole-batch step).
    `rl_spec`: the RL update's loss, whose gradient program the warm start shares where it can (`loss_spec`)."""
    w = cfg.warm_start
    if w.response_key is not None:
        bad = next((row for row in dataset if not isinstance(row.get(w.response_key), str)), None)
        if bad is not None:
            raise SystemExit(f"warm_start.response_key={w.response_key}: a row of data.source has no string "
                             f"{w.response_key!r} column (its prompt: {bad['prompt'][:60]!r}); every row needs its "
                             "demonstration")
    other = sorted({row["task"] for row in dataset} - set(TASKS)) if w.response_key is None else []
    if other:
        if is_main:
            print(f"[train] warm start skipped: it supervises the built-in tasks only, and the data has task "
                  f"{other[0]!r} (set warm_start.steps=0 to silence this)", flush=True)
        return params
    tx, _ = make_optimizer(w.optim, w.steps)
    opt = init_state(tx, params, shardings, mesh)
    sft = loss_spec(cfg, rl_spec)
    updater = Updater(model_cfg, sft, tx) if mb_rows else None
    step_fn = None if updater else make_train_step(model_cfg, sft, tx, 1)
    if w.batch_size % jax.process_count():
        raise SystemExit(f"warm_start.batch_size={w.batch_size} must divide over {jax.process_count()} processes")
    loader = DataLoader(dataset, w.batch_size // jax.process_count(), process_index=jax.process_index(),
                        process_count=jax.process_count(), seed=cfg.seed + 1)
    sft_cfg = dataclasses.replace(cfg, algo=dataclasses.replace(  # NLL: token-mean, one update per batch
        cfg.algo, agg="token-mean", micro_batches=1, mini_batches=1, objective="ppo"),
        trainer=dataclasses.replace(cfg.trainer, stale_samples="drop"),        # (no rollout: nothing carried)
        rollout=dataclasses.replace(cfg.rollout, tail_batching=dataclasses.replace(cfg.rollout.tail_batching,
                                                                                   carry_partial=False)))
    bar = tqdm(range(w.steps), desc="warm start", disable=not is_main)
    for i in bar:
        samples = demonstrations(next(loader), tokenizer, cfg)
        if updater:
            mbs = rl.micro_batches(samples, sft_cfg, mesh, pack_len, cfg.rollout.max_new_tokens, mb_rows)
            params, opt, m = updater.update(params, opt, mbs)
        else:
            batch = rl.global_batch(samples, sft_cfg, mesh, pack_len, cfg.rollout.max_new_tokens)
            params, opt, m = step_fn(params, opt, batch, 1.0)   # weights carry the denominator
        if i % 10 == 0 or i == w.steps - 1:
            nll = float(m["nll"])
            bar.set_postfix(nll=f"{nll:.3f}")
            metrics.log_tb("warm_start/nll", nll, i)
    return params
