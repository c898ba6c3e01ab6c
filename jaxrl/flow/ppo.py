"""PPO's nodes (the `ppo` graph, algo.advantage=gae): the critic's values of the step's sequences, the
reward's per-token KL penalty (algo.kl_in_reward) and the critic's update. The GAE advantages are the
advantage node's (`nodes.advantage`), the policy update is the usual `update` node.

    (critic, model_inference)  values         V(s_t) of every response token -> data.values
    reward_kl (named)          role reference  KL(π_θ ‖ π_ref) per response token (estimator
                                               algo.kl_estimator) -> data.kl
    (critic, model_train)      critic_update  the clipped value loss on the GAE returns, the critic's AdamW

The sequences are packed into the update's fixed micro-batches once per step on this process
(`sequences`); per-token outputs come back per sample from this process's rows (`local_rows` +
`batch.unpack`): nothing crosses processes but the micro-batch counts.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxrl import algos
from jaxrl.train import rl
from jaxrl.train.batch import Sample, unpack
from jaxrl.train.distributed import global_sum, local_rows

from .context import FlowContext, TrainContext
from .data import StepData
from .nodes import any_samples
from .registry import register


def sequences(tc: TrainContext, data: StepData):
    """(micro-batches, packing, samples) of the step's (prompt, response) sequences, packed once per step."""
    if "sequences" not in data.cache:
        uc, G = tc.update, data.group_size
        seqs = [Sample(data.prompts[k // G], c.tokens) for k, c in enumerate(data.completions)]
        mbs, rows = rl.micro_batches(seqs, uc.cfg, uc.mesh, uc.pack_len, uc.cfg.rollout.max_new_tokens, uc.mb_rows,
                                     with_rows=True)
        data.cache["sequences"] = (mbs, rows, seqs)
    return data.cache["sequences"]


def per_response(tc: TrainContext, data: StepData, arrays: list) -> list[np.ndarray]:
    """One [rows, L] global array per micro-batch of `sequences` -> each sample's values at its response
    tokens (this process's samples, in order)."""
    mbs, rows, seqs = sequences(tc, data)
    sharding = mbs[0]["tokens"].sharding          # how the rows were assembled (there is always one micro-batch)
    return unpack(np.concatenate([local_rows(x, sharding) for x in arrays]), rows, seqs)


@register("critic", "model_inference", name="values")
def values(ctx: FlowContext, data: StepData) -> None:
    """The critic's value of each response token's state, at rollout time (GAE's V and the clip's V_old)."""
    tc = ctx.train
    mbs, _, _ = sequences(tc, data)
    data.values = per_response(tc, data, [tc.critic.values(mb) for mb in mbs])


@functools.partial(jax.jit, static_argnames="kind")
def _token_kl(logp, ref_logp, mask, kind: str):
    return algos.kl_penalty(logp, ref_logp, kind, mask=mask)


@register(name="reward_kl")
def reward_kl(ctx: FlowContext, data: StepData) -> None:
    """algo.kl_in_reward: each response token's KL estimate between the policy that sampled it (the weights
    the trainer holds: on-policy) and the reference, for the advantage node's token rewards."""
    tc = ctx.train
    kind, upd, pol = tc.cfg.algo.kl_estimator, tc.update.updater, tc.policy
    mbs, _, _ = sequences(tc, data)
    kl = [_token_kl(upd.logprobs(pol.params, mb), upd.logprobs(pol.ref_params, mb), mb["loss_mask"], kind)
          for mb in mbs]
    data.kl = per_response(tc, data, kl)
    total, tokens = global_sum([float(sum(x.sum() for x in data.kl)), float(sum(len(x) for x in data.kl))])
    data.metrics["reward_kl"] = total / max(tokens, 1.0)      # mean KL per response token, all processes


@register("critic", "model_train", name="critic_update")
def critic_update(ctx: FlowContext, data: StepData) -> None:
    """algo.mini_batches updates of the critic on the GAE returns (clipped around the rollout-time values);
    its metrics (critic/...) join the step's."""
    tc, cfg = ctx.train, ctx.train.cfg
    if not any_samples(data):
        return
    _, _, seqs = sequences(tc, data)
    mini, uc = cfg.algo.mini_batches, tc.update
    mbs = rl.micro_batches(seqs, cfg, uc.mesh, uc.pack_len, cfg.rollout.max_new_tokens, uc.mb_rows, mini,
                           token_fields={"returns": data.returns, "old_values": data.values})
    per = len(mbs) // mini
    for k in range(mini):
        m = tc.critic.update(mbs[k * per:(k + 1) * per])
    data.metrics.update(m)
