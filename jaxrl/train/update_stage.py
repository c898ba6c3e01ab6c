"""The update stage of an RL step (the policy's state in, new params and opt_state out), over an
`UpdateContext` `uc`'s mesh, update and micro-batch shape (`jaxrl.train.context`):

    mbs, caches = prepare(uc, samples, kvs)    # host: pack, agree on counts across processes
    m = run(uc, mbs, caches)                   # devices: [reference / old log-probs], mini_batches updates
    m = fused(uc, batch)                       # trainer.micro_batch_tokens=null: one bucketed fused step

The graph's reference node (`jaxrl.flow.nodes.reference`) fills `ref_logp` in the packed batch where it
runs on this thread; `run` and `fused` compute whatever log-probs are still missing.

`prepare` and `run` are split so StreamRL's one-step-async can pack on the main thread and run the
device half on the train pool's thread (`pipeline.TrainWorker`) while the next rollout runs.
"""

from __future__ import annotations

import jax

from jaxrl.config.train import check_rollout_kv_processes

from . import corrections, rl
from .context import UpdateContext


def prepare(uc: UpdateContext, samples, kvs=None):
    """The host half of the update (packing; agrees on counts across processes): (micro-batches, caches).
    Asynchronous steps pack the rollout's log-probs as the behaviour policy (`old_logp`, or `behav_logp` for
    the decoupled objective: `corrections`)."""
    cfg, mini = uc.cfg, uc.cfg.algo.mini_batches
    mbs, rows = rl.micro_batches(samples, cfg, uc.mesh, uc.pack_len, cfg.rollout.max_new_tokens, uc.mb_rows,
                                 mini, with_rows=True, behaviour=corrections.behaviour_as_old(cfg),
                                 token_fields=corrections.packed_fields(cfg, samples))
    caches = None
    if kvs is not None:          # the rollout's K/V, packed like each micro-batch (on the train mesh)
        check_rollout_kv_processes(cfg.trainer, jax.process_count())     # (a count from the environment)
        offsets = uc.stager.stage(kvs)          # this process's sequences; `rows` is its own packing
        cached, lengths = [kv.length for kv in kvs], [len(s.prompt) + len(s.response) for s in samples]
        row_len = uc.updater.padded_len(uc.pack_len)
        local = uc.mb_rows // jax.process_count()       # its rows of each micro-batch (as rl.micro_batches)
        caches = [uc.stager.packed(uc.stager.index(rows, offsets, cached, lengths, j * local, local, row_len))
                  for j in range(len(mbs))]
    return mbs, caches


def run(uc: UpdateContext, mbs, caches) -> dict:
    """The device half of the update: log-prob passes and the updates; returns the metrics on the devices."""
    mini, own = uc.cfg.algo.mini_batches, corrections.own_old_logp(uc.cfg)
    for mb in mbs:
        if uc.spec.kl_coef and "ref_logp" not in mb:
            mb["ref_logp"] = uc.updater.logprobs(uc.policy.ref_params, mb)
        if (mini > 1 or own) and "old_logp" not in mb:
            mb["old_logp"] = uc.updater.logprobs(uc.policy.params, mb)
    extra = corrections.importance(uc, mbs)         # decoupled: the importance weights
    per = len(mbs) // mini
    uc.updater.reset_counts()
    for k in range(mini):
        part = slice(k * per, (k + 1) * per)
        kw = {"kv": caches[part]} if caches is not None else {}
        pol = uc.policy
        corrections.sequence_ratios(uc, pol.params, mbs[part], fresh=own and k == 0)     # gspo
        pol.params, pol.opt_state, m = uc.updater.update(pol.params, pol.opt_state, mbs[part], **kw)
    m.update(uc.updater.counts())        # the update says that it ran (blockwise/... metrics)
    m.update(extra)
    return m


def fused(uc: UpdateContext, batch) -> dict:
    """trainer.micro_batch_tokens=null: one bucketed batch (`rl.global_batch`), one fused step per mini-batch."""
    cfg = uc.cfg
    if uc.spec.kl_coef and "ref_logp" not in batch:
        batch["ref_logp"] = uc.fused.logprobs(uc.policy.ref_params, batch)
    mb = cfg.algo.mini_batches
    if mb > 1:
        batch["old_logp"] = uc.fused.logprobs(uc.policy.params, batch)
    else:   # on-policy, one update: old log-probs are the current ones (ratio 1, exact)
        batch["old_logp"] = None
    rows_per = batch["tokens"].shape[0] // mb
    for k in range(mb):
        part = {n: v[k * rows_per:(k + 1) * rows_per] for n, v in batch.items() if v is not None}
        pol = uc.policy
        pol.params, pol.opt_state, m = uc.fused.step(pol.params, pol.opt_state, part, 1.0)
    return jax.device_get(m)
