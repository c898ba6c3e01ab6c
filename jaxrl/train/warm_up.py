"""The warm-up before the first RL step: every executable the steps will run, compiled, so the RL steps
compile nothing (a step that compiles after warm-up is logged by name and counted in `compiles`).

    n = warm_up(update, rollout, balance=..., components=...)

What it compiles: the rollout instances' bounded step shapes (and PAT's other layouts when
engine.adaptive_tp.warm), the update over its fixed micro-batch shape (grad, apply, log-probs; the
rollout K/V path's staging and packed gather), the critic's value pass and update, the stream trainer's
executables on the devices it frees, the gradient stream's final sum, every spare instance of a scale-up,
the length ranker's step, and the weight sync. With `background` (`trainer.background_compile`, a run
starting at step 0) the update compiles on a thread (`background.py`; beside the supervised warm start when
`start_early` could start it, with the cover shapes step 0's rollout runs on), and the home instances' exact
buckets once step 0 is done.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl.config.distill import needs_reference
from jaxrl.rollout.executor import abstract
from jaxrl.rollout.service import truncate_variants

from . import corrections
from .background import BackgroundCompile
from .balance import ScaleUp
from .components import warm_all
from .batch import FIELDS, INT_FIELDS
from .context import UpdateContext
from .grad_stream import warm_sum
from .rollout_kv import export_pages
from .rollout_side import RolloutSide
from .update import needs_policy_logprobs


def micro_batch_abstract(uc: UpdateContext) -> dict:
    """The fixed micro-batch's fields as abstract arrays on the train mesh (what the update sees)."""
    cfg = uc.cfg
    sharding = NamedSharding(uc.mesh, P(("dp", "fsdp"), None))
    keys = list(FIELDS) + ["ref_logp"] * bool(uc.spec.kl_coef) + ["old_logp"] * (
        cfg.algo.mini_batches > 1 or cfg.trainer.max_staleness > 0) + ["behav_logp"] * (cfg.algo.objective == "decoupled")
    return {k: jax.ShapeDtypeStruct((uc.mb_rows, uc.pack_len), jnp.int32 if k in INT_FIELDS else jnp.float32,
                                    sharding=sharding) for k in keys}


def start_early(uc: UpdateContext, rs: RolloutSide, *, balance: ScaleUp | None, step: int) -> None:
    """Before the supervised warm start of a run starting at step 0 (`trainer.warmup` and
    `trainer.background_compile`): the background thread starts now, on jobs that need only abstract weights
    (the warm start changes their values, not their shapes or shardings): each home instance's cover shapes
    (compiled only; `warm_up` runs them), then the update's executables, and once step 0 is done the exact
    buckets (`BackgroundCompile.finish`). So what step 0 runs compiles beside the warm start. Not when the
    warm-up rebuilds the home instances (PAT's warmed layouts, a scale-up's spare instances): there `warm_up`
    starts the thread at its end."""
    cfg, svc, pol = uc.cfg, rs.svc, uc.policy
    if not (cfg.trainer.warmup and cfg.trainer.background_compile and step == 0) or balance is not None or (
            svc.adaptive is not None and cfg.engine.adaptive_tp.warm):
        return
    truncate = truncate_variants(rs.sampling_params())
    jobs = [job for inst in svc.instances for job in inst.compile_jobs(truncate, cover=True)]
    if uc.updater is not None:      # (the reference `start_reference` will copy: the policy's own layout)
        ref = pol.ref_params if pol.ref_params is not None else pol.params if needs_reference(cfg) else None
        jobs.append(_update_job(uc, ref))
    rs.background = BackgroundCompile.start(jobs, _exact_jobs(svc, truncate))


def _exact_jobs(svc, truncate) -> list:
    return [job for inst in svc.instances for job in inst.compile_jobs(truncate)]


def _update_job(uc: UpdateContext, ref_params):
    """The update's executables (the off-policy corrections', the gradient, apply and log-prob passes'), as a
    job of abstract inputs taken now: job(stop=None) -> compilations."""
    cfg, pol, mb, extra = uc.cfg, uc.policy, micro_batch_abstract(uc), {}
    if uc.stager:
        extra["kv"] = uc.stager.abstract(uc.mb_rows, uc.updater.padded_len(uc.pack_len))
    params, opt_state = abstract(pol.params), abstract(pol.opt_state)
    logp_params = [abstract(ref_params)] if ref_params is not None else []

    def job(stop=None) -> int:
        grad_mb, c = corrections.warm(uc, params, mb)        # the off-policy objective's inputs
        return c + uc.updater.warm(params, opt_state, grad_mb, own_logp=needs_policy_logprobs(cfg),
                                   logp_params=logp_params, **extra)
    return job


def warm_up(uc: UpdateContext, rs: RolloutSide, *, balance: ScaleUp | None, background: bool = False,
            components: dict | None = None) -> int:
    """Compile everything the RL steps run; returns how many rollout/update executables were compiled.
    `background`: the home layout's rollout instances compile only their cover shapes here, and the update's
    executables and the exact buckets go to a thread (`rs.background`, `jaxrl.train.background`; already
    running when `start_early` started it)."""
    svc, pol, cfg, sampling = rs.svc, uc.policy, uc.cfg, rs.sampling_params()
    early = background and rs.background is not None
    jobs, n = [], 0 if background else svc.warm(sampling)      # (background: the cover shapes at the end)
    if svc.adaptive is not None and cfg.engine.adaptive_tp.warm:   # PAT: a switch compiles nothing
        n += svc.adaptive.warm_layouts(svc, sampling)
    if uc.updater is not None:
        mb = micro_batch_abstract(uc)
        if uc.stager:          # the rollout K/V path: staging writes, the packed gather, the block step on it
            uc.stager.warm(*export_pages(cfg), uc.mb_rows, uc.updater.padded_len(uc.pack_len))
        if not background:
            n += _update_job(uc, pol.ref_params)()
        elif not early:
            jobs.append(_update_job(uc, pol.ref_params))
        n += warm_all(components or {}, mb, pol)    # the registered components' (PPO's critic, OPD's teacher)
        if rs.stream:        # the freed devices' gradient / reference executables
            n += rs.stream.warm(pol.params, pol.opt_state, pol.ref_params, svc=svc)
        if rs.gstream:       # the final sum's add program (plain jitted: counted by the compile counter)
            warm_sum(rs.gstream, pol.params)
    if balance:              # every spare instance's step set, so a scale-up compiles nothing
        k = len(svc.instances)
        svc.relayout(cfg.engine.tp, cfg.stage_balance.max_instances, weights=pol.params)
        n += svc.warm(sampling)
        if svc.adaptive is not None and cfg.engine.adaptive_tp.warm:    # PAT's layouts on the grown pool too
            ctl = svc.adaptive.controller
            configured, ctl.devices = ctl.devices, cfg.engine.tp * cfg.stage_balance.max_instances
            n += svc.adaptive.warm_layouts(svc, sampling)
            ctl.devices = configured
        if rs.stream and uc.updater is not None:     # the devices a shrink frees on each grown pool
            n += rs.stream.warm_grown(pol.params, svc, range(k + 1, cfg.stage_balance.max_instances + 1))
        svc.relayout(cfg.engine.tp, k, weights=pol.params)
    if rs.skew:              # the length ranker's train step and forward
        rs.skew.ranker.warm()
    svc.update_weights(pol.params)
    if background:     # the home instances as they are now (PAT's layouts and a scale-up rebuild them); early:
        n += svc.warm(sampling, cover=True)       # their cover shapes are compiled or compiling on the thread
        if not early:
            rs.background = BackgroundCompile.start(jobs, _exact_jobs(svc, truncate_variants(sampling)))
    return n
