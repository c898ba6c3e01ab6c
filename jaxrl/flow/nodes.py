"""The built-in nodes: the trainer's existing stage functions, registered by (role, type).

    (actor, model_inference)      rollout      prompts -> completions (`RolloutSide.collect`: tail batching's
                                               rounds, skew placement, PAT switches live there)
    (reward, compute)             reward       completions -> rewards; streamed: scored as each response
                                               finishes, inside the rollout's loop
    (advantage, compute)          advantage    rewards -> per-token advantages -> training samples (GAE from
                                               the critic's values with algo.advantage=gae: `jaxrl.flow.ppo`)
    (reference, model_inference)  reference    reference log-probs of the packed batch (kl_coef > 0)
    (actor, model_train)          update       samples -> [old log-probs] -> optimizer update(s)
    filter (named)                drop_equal_groups   DAPO's group filter, without the over-sampling

Streamed update (RollPacker's stream trainer, StreamRL's pipelining): reward, advantage, reference and
update are all streamed consumers of the rollout; the rollout wires their per-group work into its loop
(`RolloutSide.collect`'s hooks) and each node's function then finishes what is left after the stream.

Packing into the update's micro-batches happens once per step (`train_batches`), after the databuffer's
repartition when `trainer.repartition=tokens` (`jaxrl.flow.databuffer`).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxrl.data import encode_prompts
from jaxrl.train import critic, rl
from jaxrl.train import update_stage as stage
from jaxrl.train.batch import Sample, trained_mask
from jaxrl.train.distributed import global_sum
from jaxrl.train.pipeline import check_staleness
from jaxrl.train.weight_swap import MidRolloutSwap

from .context import FlowContext, TrainContext
from .data import StepData
from .registry import register


@register("actor", "model_inference", name="rollout")
def rollout(ctx: FlowContext, data: StepData) -> None:
    """Step `data.step`'s rollout (or one-step-async's prefetched one) on the weights the engine holds."""
    tc = ctx.train
    got = tc.rollout.take(data.step, score=ctx.rewards_streamed)
    data.rows, data.completions, data.rewards, data.stats = got.rows, got.completions, got.rewards, got.stats
    data.plan, data.version, data.group_size = got.plan, got.version, tc.cfg.algo.group_size
    data.prompts = encode_prompts(data.rows, tc.tokenizer, tc.cfg.data.chat)     # the trained prompts, in order
    if tc.rollout.turns is not None:    # multi-turn: as generated, an environment's opening text in them
        data.prompts = [list(data.completions[k * data.group_size].prompt) for k in range(len(data.rows))]


@register("reward", "compute", name="reward", stream=True)
def reward(ctx: FlowContext, data: StepData) -> None:
    """Rewards of the step's completions. Streamed (the default graphs): already scored while the rollout
    ran. Otherwise the whole batch is scored now, through the same reward scheduler."""
    tc = ctx.train
    if ctx.streamed or tc.rollout.turns is not None:    # (multi-turn: the environments scored the rollout)
        return
    data.rewards, got = rl.score_batch(tc.rewards, tc.tokenizer, tc.cfg, data.rows, data.completions, data.group_size)
    data.stats.update(got)
    data.stats["reward_s"] = got["seconds"]
    tc.reward_guard.update(data.stats)


@register("advantage", "compute", name="advantage", stream=True)
def advantage(ctx: FlowContext, data: StepData, estimator: str | None = None) -> None:
    """Per-token advantages (`algo.advantage`; a graph that names `estimator` is checked against it when the
    plan is built) and one training sample per completion."""
    cfg = ctx.train.cfg
    kl = data.kl
    if cfg.algo.kl_in_reward and kl is None:
        raise RuntimeError(f"node {ctx.node.id!r}: algo.kl_in_reward needs the per-token KL (data.kl) from a "
                           "reference node before the advantages (the built-in reward_kl)")
    if cfg.algo.advantage == "gae":      # PPO: GAE from the critic's values (the `ppo` graph's values node)
        data.advantages, data.returns = critic.gae(cfg, data.rewards, data.lens, data.values, kl)
    else:
        data.advantages = rl.advantages(cfg, data.rewards, data.lens, kl=kl)
    data.samples = make_samples(data)


def make_samples(data: StepData) -> list[Sample]:
    """One training sample per completion, from its prompt, tokens, `data.advantages` and sampling log-probs."""
    G = data.group_size
    return [Sample(data.prompts[k // G], c.tokens, data.advantages[k], c.logprobs, data.version, mask=trained_mask(c))
            for k, c in enumerate(data.completions)]


@register(name="drop_equal_groups")
def drop_equal_groups(ctx: FlowContext, data: StepData) -> None:
    """DAPO's group filter: groups whose rewards are all equal carry no signal and are dropped
    (`flow/groups_dropped`, over all processes). Without over-sampling: the batch shrinks."""
    r = np.asarray(data.rewards).reshape(-1, data.group_size)
    dropped = data.keep_groups(r.max(axis=1) > r.min(axis=1))
    data.metrics["flow/groups_dropped"] = int(global_sum([dropped])[0])


def any_samples(data: StepData) -> bool:
    return bool(int(global_sum([len(data.samples or [])])[0]))


def update_samples(tc: TrainContext, data: StepData) -> list:
    """This process's samples for the update: after the databuffer's repartition when
    `trainer.repartition=tokens` (its metrics go to the step's), else the rollout's own."""
    if tc.databuffer is None:
        return data.samples
    samples, m = tc.databuffer.repartition(data.samples)
    data.metrics.update(m)
    return samples


def train_batches(tc: TrainContext, data: StepData):
    """The update's fixed-shape micro-batches (and the rollout K/V caches), packed once per step; with
    `trainer.repartition=tokens` the samples are first repartitioned over the processes by tokens."""
    if "mbs" not in data.cache:
        kvs = [c.kv for c in data.completions] if tc.update.stager else None     # MetroRLHF kv_source=rollout
        data.cache["mbs"] = stage.prepare(tc.update, update_samples(tc, data), kvs)
    return data.cache["mbs"]


def whole_batch(tc: TrainContext, data: StepData) -> dict:
    """trainer.micro_batch_tokens=null: the one bucketed global batch, packed once per step."""
    if "batch" not in data.cache:
        uc = tc.update
        data.cache["batch"] = rl.global_batch(update_samples(tc, data), uc.cfg, uc.mesh, uc.pack_len,
                                              uc.cfg.rollout.max_new_tokens)
    return data.cache["batch"]


@register("reference", "model_inference", name="reference", stream=True)
def reference(ctx: FlowContext, data: StepData) -> None:
    """The reference policy's log-probs of the packed batch. Where the update does not run on this thread
    from packed micro-batches (a streamed update computes them per group; the train pool's thread computes
    them beside the update), the update computes them instead."""
    tc = ctx.train
    uc = tc.update
    if not uc.spec.kl_coef or ctx.streamed or tc.worker is not None or not any_samples(data):
        return            # (no KL loss term: algo.kl_in_reward puts the KL in the rewards, node reward_kl)
    if uc.fused is None:
        mbs, _ = train_batches(tc, data)
        for mb in mbs:
            mb["ref_logp"] = uc.updater.logprobs(uc.policy.ref_params, mb)
    else:
        batch = whole_batch(tc, data)
        batch["ref_logp"] = uc.fused.logprobs(uc.policy.ref_params, batch)


@register("actor", "model_train", name="update", stream=True)
def update(ctx: FlowContext, data: StepData) -> None:
    """The policy update from the step's samples: the stream trainer's or the pipelined gradient stream's
    final update, one-step-async's update on the train pool (the next rollout is collected meanwhile), or
    the colocated update; sets `data.train_metrics` (host values)."""
    tc, cfg = ctx.train, ctx.train.cfg
    uc, pol, rs = tc.update, tc.policy, tc.rollout
    check_staleness(data.step, [data.version], cfg.trainer.max_staleness)
    if not any_samples(data):         # every group was dropped (dynamic sampling, a group filter)
        waves = f", dynamic sampling's {data.stats['waves']} waves" if "waves" in data.stats else ""
        tc.log.warning("step %d: every group's rewards were all equal (or filtered out%s); nothing to train, "
                       "no update", data.step, waves)
        data.train_metrics = {"kl": 0.0, "entropy": 0.0, "clip_frac": 0.0, "grad_norm": 0.0, "loss": 0.0,
                              "skipped": 0}
        if cfg.trainer.max_staleness:       # generation still runs ahead
            rs.run_ahead(data.step, cfg.trainer.max_staleness, score=ctx.rewards_streamed)
        return
    if tc.stream or tc.gstream:    # gradients (partly) computed during the rollout: the rest, sums combined, one
        t = time.perf_counter()    # update (RollPacker's stream trainer, StreamRL's sync pipelining on the train pool)
        finish = tc.stream.finish if tc.stream else tc.gstream.apply
        if tc.worker is None:
            pol.params, pol.opt_state, m = finish(pol.params, pol.opt_state)
        else:
            pol.params, pol.opt_state, m = tc.worker.submit("update", finish, pol.params, pol.opt_state).result()
        m, data.train_wait_s = jax.device_get(m), time.perf_counter() - t
    elif cfg.trainer.max_staleness:     # asynchronous: the next rollouts run while this trains (StreamRL: k = 1)
        fut = tc.worker.submit("update", stage.run, uc, *train_batches(tc, data))
        swap = None
        if cfg.trainer.swap_step is not None:      # partial rollouts: the update enters the next rollout mid-way
            staged = tc.worker.submit("stage", lambda: rs.svc.stage(pol.params, adapters_only=True))
            swap = MidRolloutSwap(rs.svc, staged, version=data.step + 1, at_step=cfg.trainer.swap_step,
                                  kv=cfg.trainer.swap_kv)
        rs.run_ahead(data.step, cfg.trainer.max_staleness, score=ctx.rewards_streamed, swap=swap)
        if swap is not None:
            data.metrics.update(swap.metrics())
        t = time.perf_counter()
        m, data.train_wait_s = jax.device_get(fut.result()), time.perf_counter() - t
    elif tc.worker is not None:       # disaggregated, several processes: after the rollout, on the train pool
        m = jax.device_get(tc.worker.submit("update", stage.run, uc, *train_batches(tc, data)).result())
    elif uc.fused is None:
        m = jax.device_get(stage.run(uc, *train_batches(tc, data)))
    else:
        m = stage.fused(uc, whole_batch(tc, data))
    data.train_metrics = m
