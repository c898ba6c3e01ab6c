"""The jitted pieces of a training update: per-token log-probs, the RL loss, and the optimizer step.

Log-probs come from the model's final hidden states through `kernels.logprobs.token_logprobs`
(chunked vocabulary projection with a custom VJP), so no [tokens, vocab] logits are materialised.
The loss is `sum(weights * token_loss)` with the aggregation folded into the host-computed weights
(`jaxrl.train.batch`), so micro-batch accumulation is an exact sum. A non-finite loss or gradient
norm skips the update: params and optimizer state are returned untouched and `skipped` is 1.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from jaxrl import algos
from kernels.logprobs import token_logprobs
from models import ModelConfig, forward, lm_head


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """Static (hashable) loss hyper-parameters."""

    kind: str = "rl"                 # "rl" (clipped policy gradient) or "sft" (negative log-likelihood)
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    temperature: float = 1.0


def token_logp(params, cfg: ModelConfig, batch, temperature: float = 1.0):
    """log p(targets) and entropy per token [R, L] for a packed batch."""
    h = forward(params, cfg, batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                return_hidden=True)
    return token_logprobs(h, lm_head(params), batch["targets"], temperature=temperature)


def make_logprob_fn(cfg: ModelConfig, temperature: float):
    """Jitted `(params, batch) -> logp [R, L]` (old-policy and reference log-probs)."""
    return jax.jit(lambda params, batch: token_logp(params, cfg, batch, temperature)[0])


def loss_fn(params, cfg: ModelConfig, spec: LossSpec, mb):
    logp, ent = token_logp(params, cfg, mb, spec.temperature)
    mask, w = mb["loss_mask"].astype(jnp.float32), mb["weights"]
    if spec.kind == "sft":
        tok = -logp
        clipped = jnp.zeros_like(mask)
    else:
        old = mb["old_logp"] if "old_logp" in mb else jax.lax.stop_gradient(logp)  # on-policy: ratio == 1
        ratio = jnp.exp(logp - old)
        tok, clipped, _ = algos.ppo_clip_token_loss(ratio, mb["advantages"], clip_low=spec.clip_low,
                                                    clip_high=spec.clip_high, dual_clip=spec.dual_clip)
    kl = jnp.zeros_like(logp)
    if spec.kl_coef:
        kl = algos.kl_penalty(logp, mb["ref_logp"], spec.kl_estimator)
        tok = tok + spec.kl_coef * kl
    if spec.entropy_coef:
        tok = tok - spec.entropy_coef * ent
    loss = jnp.sum(w * tok * mask)
    sums = {"loss": loss, "tokens": jnp.sum(mask), "entropy": jnp.sum(ent * mask), "kl": jnp.sum(kl * mask),
            "clipped": jnp.sum(clipped * mask), "nll": -jnp.sum(logp * mask)}
    return loss, sums


def make_train_step(cfg: ModelConfig, spec: LossSpec, tx: optax.GradientTransformation, micro_batches: int):
    """Jitted `(params, opt_state, batch) -> (params, opt_state, metrics)`; batch rows split into
    `micro_batches` accumulated by `lax.scan`. params/opt_state are donated."""
    grad_fn = jax.value_and_grad(functools.partial(loss_fn, cfg=cfg, spec=spec), has_aux=True)

    def step(params, opt_state, batch):
        mbs = jax.tree.map(lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:]), batch)

        def body(acc, mb):
            (_, sums), g = grad_fn(params, mb=mb)
            return jax.tree.map(jnp.add, acc, (g, sums)), None

        zero_g = jax.tree.map(jnp.zeros_like, params)
        zero_s = jax.eval_shape(lambda: loss_fn(params, cfg, spec, jax.tree.map(lambda x: x[0], mbs))[1])
        zero_s = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zero_s)
        (grads, sums), _ = jax.lax.scan(body, (zero_g, zero_s), mbs)
        gnorm = optax.tree.norm(grads)
        ok = jnp.isfinite(sums["loss"]) & jnp.isfinite(gnorm)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
        n = jnp.maximum(sums["tokens"], 1.0)
        metrics = {"loss": sums["loss"], "grad_norm": gnorm, "skipped": (~ok).astype(jnp.int32),
                   "entropy": sums["entropy"] / n, "kl": sums["kl"] / n, "clip_frac": sums["clipped"] / n,
                   "nll": sums["nll"] / n, "tokens": sums["tokens"]}
        return keep(new_params, params), keep(new_opt, opt_state), metrics

    return jax.jit(step, donate_argnums=(0, 1))
