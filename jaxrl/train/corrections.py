"""The off-policy objective's inputs per micro-batch (`algo.objective`; the math in `jaxrl.algos.offpolicy`,
the config in `jaxrl.config.objective`). The gradient step reads them as per-token constants, so every path
that runs it (full or blockwise backward, fused or chunked loss) computes the same objective:

    fields = packed_fields(cfg, samples)      # decoupled: each token's sampling log-prob, packed as "behav_logp"
    m = importance(uc, mbs)                   # decoupled: "is_weight" from the proximal pass ("old_logp") and it
    sequence_ratios(uc, params, part, first)  # gspo: "seq_ratio", each sequence's ratio at the weights updated next

Which log-probs are the ratio's denominator ("old_logp"):
  * ppo: the rollout's (the behaviour policy) when generation runs ahead (trainer.max_staleness >= 1), a pass on
    the step's weights with several mini-batches, else none (on-policy: ratio 1);
  * decoupled: always a pass on the step's weights (π_prox), and the importance weight π_prox/π_behav;
  * gspo: as ppo, but with one mini-batch on-policy a pass too (s_i is then exactly 1).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxrl import algos
from jaxrl.rollout.executor import abstract, out_abstract

from .batch import FIELDS


def own_old_logp(cfg) -> bool:
    """Whether "old_logp" comes from a log-prob pass on the step's weights (before the first update)."""
    a = cfg.algo
    if a.objective == "decoupled":
        return True
    return cfg.trainer.max_staleness == 0 and (a.mini_batches > 1 or a.objective == "gspo")


def behaviour_as_old(cfg) -> bool:
    """Whether the rollout's log-probs are packed as "old_logp" (generation ran ahead, objective ppo or gspo)."""
    return cfg.trainer.max_staleness > 0 and cfg.algo.objective != "decoupled"


def grad_keys(cfg) -> list[str]:
    """The per-token fields the gradient step reads beyond `batch.FIELDS` and "ref_logp"."""
    keys = ["old_logp"] * (own_old_logp(cfg) or behaviour_as_old(cfg))
    return keys + ["is_weight"] * (cfg.algo.objective == "decoupled") + ["seq_ratio"] * (cfg.algo.objective == "gspo")


def packed_fields(cfg, samples) -> dict[str, list] | None:
    """`batch.pack`'s token_fields: decoupled packs each token's sampling log-prob (the behaviour policy)."""
    if cfg.algo.objective != "decoupled":
        return None
    missing = [i for i, s in enumerate(samples) if s.logprobs is None or len(s.logprobs) != len(s.response)]
    if missing:
        raise ValueError(f"algo.objective=decoupled: samples {missing[:5]} have no sampling log-prob per token")
    return {"behav_logp": [np.asarray(s.logprobs, np.float32) for s in samples]}


@functools.partial(jax.jit, static_argnames=("cap", "mode"))
def _weights(prox, behav, mask, *, cap, mode):
    w, _ = algos.importance_weights(prox, behav, mask, cap=cap, mode=mode)
    valid = mask > 0
    raw = jax.numpy.where(valid, jax.numpy.exp(prox - behav), 0.0)
    sums = {"w": raw.sum(), "max": raw.max(), "over": ((raw > cap) & valid).sum(), "tokens": valid.sum()}
    return w, sums


_ratio = jax.jit(algos.packed_sequence_ratio)


def importance(uc, mbs: list[dict]) -> dict:
    """decoupled: each micro-batch's "is_weight" from its "old_logp" (π_prox, already computed) and the packed
    "behav_logp" (removed: the gradient step never sees it). Returns the step's async/ metrics (host floats):
    the weight's mean and max before the correction and the fraction of tokens above the cap."""
    a = uc.cfg.algo
    if a.objective != "decoupled":
        return {}
    sums = []
    for mb in mbs:
        mb["is_weight"], s = uc.updater.cache("is_weights", _weights, mb["old_logp"], mb.pop("behav_logp"),
                                              mb["loss_mask"], cap=a.is_cap, mode=a.is_correction)
        sums.append(s)
    sums = jax.device_get(sums)
    tokens = max(sum(float(s["tokens"]) for s in sums), 1.0)
    return {"async/is_weight_mean": sum(float(s["w"]) for s in sums) / tokens,
            "async/is_weight_max": max(float(s["max"]) for s in sums),
            "async/is_truncated_frac": sum(float(s["over"]) for s in sums) / tokens if a.is_correction != "none"
            else 0.0}


def sequence_ratios(uc, params, mbs: list[dict], *, fresh: bool) -> None:
    """gspo: each micro-batch's "seq_ratio" (s_i per token) at `params`, the weights about to be updated.
    `fresh`: "old_logp" was just computed from these very weights (s_i = 1 exactly; no second pass)."""
    if uc.cfg.algo.objective != "gspo":
        return
    for mb in mbs:
        cur = mb["old_logp"] if fresh else uc.updater.logprobs(params, mb)
        mb["seq_ratio"] = uc.updater.cache("seq_ratio", _ratio, cur, mb["old_logp"], mb["segment_ids"], mb["loss_mask"])


def warm(uc, params, mb: dict) -> tuple[dict, int]:
    """Compile the corrections' executables for the abstract micro-batch `mb` (what `warm_up` packs) and the
    log-prob pass's output on `params`; returns (the micro-batch as the gradient step will see it: each field with
    the sharding its producer gives it, the number of compilations)."""
    cfg, cache, before = uc.cfg, uc.updater.cache, uc.updater.cache.compiles
    a, mb = cfg.algo, dict(mb)
    if a.objective == "ppo":
        return mb, 0
    pass_out = out_abstract(cache.compile("logp", uc.updater.logp, abstract(params), {k: mb[k] for k in FIELDS}))
    if own_old_logp(cfg):
        mb["old_logp"] = pass_out
    if a.objective == "decoupled":
        exe = cache.compile("is_weights", _weights, pass_out, mb["behav_logp"], mb["loss_mask"], cap=a.is_cap,
                            mode=a.is_correction)
        mb["is_weight"] = out_abstract(exe)[0]
        del mb["behav_logp"]
    if a.objective == "gspo":
        cache.compile("seq_ratio", _ratio, mb["old_logp"], mb["old_logp"], mb["segment_ids"], mb["loss_mask"])
        exe = cache.compile("seq_ratio", _ratio, pass_out, mb["old_logp"], mb["segment_ids"], mb["loss_mask"])
        mb["seq_ratio"] = out_abstract(exe)
    return mb, cache.compiles - before
