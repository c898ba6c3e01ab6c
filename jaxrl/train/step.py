"""The jitted pieces of a training update: per-token log-probs, the RL loss, gradients, and the update.

Gradients and the update are separate steps (ARCHITECTURE.md, "Gradients and the update are separate
steps"):

    grad_step(params, micro_batch)                     -> (grad_sums, stats_sums)       make_grad_step
    apply_update(params, opt_state, grad_sums, denominator, stats_sums)
                                                       -> (params, opt_state, metrics)  make_apply_update
    train_step(params, opt_state, batch, denominator)  -> (params, opt_state, metrics)  make_train_step

`grad_step` differentiates the *unnormalised* sum Σ weights · token_loss · mask of one micro-batch;
its per-token `weights` come from the `jaxrl.algos` aggregation registry
(`algos.token_weights`: w_i = 1/q_i per sequence, plus which denominator — tokens or sequences — the
mode divides by). Sums add exactly over micro-batches, blocks, streamed arrivals and device groups
(`sum_onto`), so `apply_update` divides the summed gradients (and the loss sum) by the final
denominator once, takes the global norm, skips a non-finite update (params and optimizer state come
back untouched and `skipped` is 1), and applies the optax update.

Streamed/blockwise callers pass unnormalised weights and the final denominator; the synchronous
step folds it (bitwise today's update): the synchronous trainer knows the global denominator before
the update, so it builds the weights with the denominator folded in on the host
(`algos.folded_token_weights`, float64, the expressions the trainer has always used) and passes
denominator 1.0 (x / 1.0 is exact). `make_train_step` is the fused form the trainer runs: a `lax.scan`
of the same gradient computation over micro-batches, then the same update code, bitwise equal to
grad_step per micro-batch + sum + apply_update.

The loss composes the `jaxrl.algos` registry: the clipped policy term (`algos.ppo_clip_token_loss`),
a KL term to the reference policy (`algos.kl_penalty` with the configured estimator), an entropy
bonus, and the aggregation through the registry's weights. Kind "sft" is the negative
log-likelihood (the supervised warm start). The loss's sum and its gradient w.r.t. the final hidden
states and the output projection come from `kernels.logprob_loss.token_loss_sum` (token chunks, each with
its full-vocabulary logits, the per-token loss derivatives and both projection gradients in one pass;
`LossSpec.fused_loss`, default on); with `fused_loss=False`, and for the log-prob passes without a
gradient, log-probs come from `kernels.logprobs.token_logprobs` (vocabulary chunks, custom VJP). Neither
materialises [tokens, vocab] logits beyond one chunk. `LossSpec.remat` / `attention_impl` are passed to
the train forward (`models.forward`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from jaxrl import algos
from jaxrl.config.train import AlgoSection, TrainerSection
from kernels.logprob_loss import token_loss_sum
from kernels.logprobs import token_logprobs
from models import ModelConfig, forward, lm_head, lora
from models.forward import ATTENTION_IMPLS, REMAT_POLICIES

LOSS_KINDS = ("rl", "sft")
STATS = ("loss", "tokens", "entropy", "kl", "clipped", "nll")


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """Static (hashable) loss hyper-parameters and train-forward options."""

    kind: str = "rl"                 # "rl" (clipped policy gradient) or "sft" (negative log-likelihood)
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"         # a name in algos.KL_ESTIMATORS
    entropy_coef: float = 0.0
    temperature: float = 1.0
    remat: str = "none"              # models.forward.REMAT_POLICIES
    attention_impl: str = "xla"      # models.forward.ATTENTION_IMPLS
    fused_loss: bool = True          # kernels.logprob_loss (gradient formed with the logits) vs token_logprobs + autodiff

    def __post_init__(self):
        for name, choices in (("kind", LOSS_KINDS), ("kl_estimator", tuple(algos.KL_ESTIMATORS)),
                              ("remat", REMAT_POLICIES), ("attention_impl", ATTENTION_IMPLS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"LossSpec.{name}={getattr(self, name)!r}; valid choices: {', '.join(choices)}")

    @classmethod
    def from_config(cls, algo: AlgoSection, *, temperature: float, trainer: TrainerSection,
                    kind: str = "rl") -> LossSpec:
        """The static spec of `algo`'s objective with `trainer`'s train-forward options (`kind="sft"`: the
        warm start's NLL)."""
        if kind == "sft":
            return cls(kind="sft", remat=trainer.remat, attention_impl=trainer.attention_impl,
                       fused_loss=trainer.fused_loss)
        return cls(clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
                   kl_coef=0.0 if algo.kl_in_reward else algo.kl_coef, kl_estimator=algo.kl_estimator,
                   entropy_coef=algo.entropy_coef, temperature=temperature, remat=trainer.remat,
                   attention_impl=trainer.attention_impl, fused_loss=trainer.fused_loss)


def token_logp(params, cfg: ModelConfig, batch, temperature: float = 1.0, *, remat: str = "none",
               attention_impl: str = "xla"):
    """log p(targets) and entropy per token [R, L] for a packed batch."""
    h = forward(params, cfg, batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                return_hidden=True, attention_impl=attention_impl, remat=remat)
    return token_logprobs(h, lm_head(params), batch["targets"], temperature=temperature, valid_vocab=cfg.vocab_size)


def make_logprob_fn(cfg: ModelConfig, spec: LossSpec):
    """Jitted `(params, batch) -> logp [R, L]` (old-policy and reference log-probs; no backward, so
    `spec.remat` does not apply)."""
    return jax.jit(functools.partial(_logprobs, cfg=cfg, spec=spec))


def _logprobs(params, batch, *, cfg: ModelConfig, spec: LossSpec):
    return token_logp(params, cfg, batch, spec.temperature, attention_impl=spec.attention_impl)[0]


def token_loss(logp, ent, mb, spec: LossSpec):
    """Per-token loss [R, L] and its parts ("kl", "clipped") from the `jaxrl.algos` registry.

    rl:  ℓ = w·ppo_clip(ρ, A) + β·KL_est(logp, ref_logp) − c_H·H, with ρ = exp(logp − old_logp)
         (ρ = 1 on-policy: `old_logp` absent means the current log-probs, without gradient); with
         "seq_ratio" GSPO's per-token ratio instead, and w = "is_weight" (decoupled PPO) or 1.
    sft: ℓ = −logp (+ the same KL / entropy terms when their coefficients are set).
    """
    if spec.kind == "sft":
        tok, clipped = -logp, jnp.zeros_like(logp)
    else:
        old = mb["old_logp"] if "old_logp" in mb else jax.lax.stop_gradient(logp)   # on-policy: ratio == 1
        if "seq_ratio" in mb:        # GSPO-token: value s_i, gradient s_i·∇logp (algos.offpolicy)
            ratio = algos.gspo_token_ratio(logp, mb["seq_ratio"])
        else:
            ratio = jnp.exp(logp - old)
        tok, clipped, _ = algos.ppo_clip_token_loss(ratio, mb["advantages"], clip_low=spec.clip_low,
                                                    clip_high=spec.clip_high, dual_clip=spec.dual_clip)
        if "is_weight" in mb:        # decoupled PPO: π_prox/π_behav, truncated or masked (algos.offpolicy)
            tok = mb["is_weight"] * tok
    kl = jnp.zeros_like(logp)
    if spec.kl_coef:
        kl = algos.kl_penalty(logp, mb["ref_logp"], spec.kl_estimator)
        tok = tok + spec.kl_coef * kl
    if spec.entropy_coef:
        tok = tok - spec.entropy_coef * ent
    return tok, {"kl": kl, "clipped": clipped}


def _loss_aux(mb, spec: LossSpec) -> dict:
    """The per-token constants `token_loss` reads, plus the weights and the mask (float32)."""
    keys = ["advantages"] if spec.kind == "rl" else []
    keys += [k for k in ("old_logp", "is_weight", "seq_ratio") if spec.kind == "rl" and k in mb]
    keys += ["ref_logp"] if spec.kl_coef else []
    aux = {k: mb[k] for k in keys}
    aux.update(weights=mb["weights"], loss_mask=mb["loss_mask"].astype(jnp.float32))
    return aux


def _weighted_token_loss(logp, ent, aux, *, spec: LossSpec):
    """w · ℓ · mask per token: what the loss sums (elementwise over tokens, as `token_loss_sum` needs)."""
    return aux["weights"] * token_loss(logp, ent, aux, spec)[0] * aux["loss_mask"]


def loss_fn(params, cfg: ModelConfig, spec: LossSpec, mb):
    """(Σ weights · ℓ · mask, stats sums) of one micro-batch; the weights carry the aggregation."""
    h = forward(params, cfg, mb["tokens"], positions=mb["positions"], segment_ids=mb["segment_ids"],
                return_hidden=True, attention_impl=spec.attention_impl, remat=spec.remat)
    return hidden_loss(params, cfg, spec, h, mb)


def hidden_loss(params, cfg: ModelConfig, spec: LossSpec, h, mb):
    """`loss_fn` from the final hidden states h [R, L, E] of `mb`'s tokens (also a block of them: every
    term is per token, so block sums add up to the micro-batch's).

    `spec.fused_loss`: the sum and its gradient come from `kernels.logprob_loss.token_loss_sum` (each
    token chunk's full-vocabulary softmax, loss derivatives and projection gradients in one pass: 6·E·V·T
    lm_head FLOPs, T the loss positions only, prompts and padding left out when there are several chunks);
    otherwise log-probs come from `token_logprobs` and autodiff differentiates the sum
    (8·E·V·T: its backward recomputes the logits). The two agree within float32 rounding
    (tests/test_train_step.py). The stats are computed from the same log-probs either way."""
    if spec.fused_loss:
        aux = _loss_aux(mb, spec)
        loss, logp, ent = token_loss_sum(h, lm_head(params), mb["targets"], aux,
                                         functools.partial(_weighted_token_loss, spec=spec),
                                         temperature=spec.temperature, valid_vocab=cfg.vocab_size,
                                         mask=aux["loss_mask"])
        mask = aux["loss_mask"]
        _, parts = token_loss(logp, ent, mb, spec)
    else:
        logp, ent = token_logprobs(h, lm_head(params), mb["targets"], temperature=spec.temperature,
                                   valid_vocab=cfg.vocab_size)
        mask, w = mb["loss_mask"].astype(jnp.float32), mb["weights"]
        tok, parts = token_loss(logp, ent, mb, spec)
        loss = jnp.sum(w * tok * mask)
    sums = {"loss": loss, "tokens": jnp.sum(mask), "entropy": jnp.sum(ent * mask),
            "kl": jnp.sum(parts["kl"] * mask), "clipped": jnp.sum(parts["clipped"] * mask),
            "nll": -jnp.sum(logp * mask)}
    return loss, sums


def _grads(params, mb, acc=None, *, cfg: ModelConfig, spec: LossSpec):
    """Gradients w.r.t. the trainable leaves only (`models.lora.split`: the adapters with LoRA, every leaf
    without): the frozen weights are constants of the differentiated function, so their gradient is never
    formed."""
    trainable, frozen = lora.split(params)
    loss = lambda t, mb: loss_fn(lora.join(t, frozen), cfg, spec, mb)     # noqa: E731
    (_, sums), g = jax.value_and_grad(loss, has_aux=True)(trainable, mb)
    return (g, sums) if acc is None else jax.tree.map(jnp.add, acc, (g, sums))


@functools.cache
def make_grad_step(cfg: ModelConfig, spec: LossSpec):
    """Jitted `grad_step(params, micro_batch, acc=None) -> (grad_sums, stats_sums)`: gradients of the
    unnormalised Σ weights · ℓ · mask and the stats sums (loss, tokens, entropy, kl, clipped, nll). Runs
    on whatever mesh its inputs live on (a sub-mesh too; combine with `sum_onto`). One jitted function per
    (cfg, spec) in a process, so updaters of one spec share its executables (the warm start's and the RL
    update's: `warm_start.loss_spec`).

    `acc` (donated) is a running (grad_sums, stats_sums) to add this micro-batch's sums to, inside the
    same program: that is exactly the fused step's `lax.scan` body, so accumulating with `acc` is
    bitwise the fused step. (Adding returned sums outside is exact up to float rounding: XLA folds the
    accumulation into the gradient's last ops, e.g. the tied embedding's scatter-add, which reorders
    the additions.)"""
    return jax.jit(functools.partial(_grads, cfg=cfg, spec=spec), donate_argnums=(2,))


def _update(params, opt_state, grad_sums, denominator, stats=None, *, tx: optax.GradientTransformation):
    """Normalise once, global norm, skip non-finite, optax update (shared by the split and fused paths)."""
    d = jnp.asarray(denominator, jnp.float32)
    # The barrier keeps XLA from fusing the division into the optimizer's arithmetic (it would rewrite
    # e.g. (g / d) * clip_scale, changing roundings): with d = 1 the update is bitwise the pre-split one.
    grads = jax.lax.optimization_barrier(jax.tree.map(lambda g: (g / d).astype(g.dtype), grad_sums))
    gnorm = optax.tree.norm(grads)
    ok = jnp.isfinite(gnorm)
    metrics = {"grad_norm": gnorm}
    if stats is not None:
        loss = stats["loss"] / d
        ok = jnp.isfinite(loss) & ok
        n = jnp.maximum(stats["tokens"], 1.0)
        metrics.update(loss=loss, entropy=stats["entropy"] / n, kl=stats["kl"] / n,
                       clip_frac=stats["clipped"] / n, nll=stats["nll"] / n, tokens=stats["tokens"])
    trainable, frozen = lora.split(params)      # the optimizer sees the trainable leaves only
    updates, new_opt = tx.update(grads, opt_state, trainable)
    new_params = optax.apply_updates(trainable, updates)
    keep = lambda new, old: jax.tree.map(lambda n_, o: jnp.where(ok, n_, o), new, old)
    metrics["skipped"] = (~ok).astype(jnp.int32)
    return lora.join(keep(new_params, trainable), frozen), keep(new_opt, opt_state), metrics


def make_apply_update(tx: optax.GradientTransformation):
    """Jitted `apply_update(params, opt_state, grad_sums, denominator, stats_sums=None) -> (params,
    opt_state, metrics)`, params/opt_state donated. Divides grad_sums (and the loss sum) by
    `denominator` once; with `stats_sums` the metrics also hold loss, per-token entropy/kl/clip_frac/nll
    and tokens, and a non-finite loss also skips the update."""
    return jax.jit(functools.partial(_update, tx=tx), donate_argnums=(0, 1))


def make_train_step(cfg: ModelConfig, spec: LossSpec, tx: optax.GradientTransformation, micro_batches: int):
    """Jitted `(params, opt_state, batch, denominator=1.0) -> (params, opt_state, metrics)`: batch rows
    split into `micro_batches`, gradient sums accumulated by `lax.scan` (the `grad_step` computation),
    then the `apply_update` code. params/opt_state are donated."""
    grads = functools.partial(_grads, cfg=cfg, spec=spec)

    def step(params, opt_state, batch, denominator=1.0):
        mbs = jax.tree.map(lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:]), batch)

        def body(acc, mb):
            return grads(params, mb, acc), None

        zero = jax.eval_shape(grads, params, jax.tree.map(lambda x: x[0], mbs))
        zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zero)
        (grad_sums, stats), _ = jax.lax.scan(body, zero, mbs)
        return _update(params, opt_state, grad_sums, denominator, stats, tx=tx)

    return jax.jit(step, donate_argnums=(0, 1))


@jax.jit
def _add_trees(trees):
    return jax.tree.map(lambda *xs: functools.reduce(jnp.add, xs), *trees)


def sum_onto(trees: Sequence, shardings):
    """Σ of pytrees computed on different meshes (e.g. grad_step on sub-meshes freed by rollout), summed
    on the train mesh: each tree is `jax.device_put` onto `shardings` (a matching pytree of shardings,
    or one sharding for every leaf), then added left to right ((t0 + t1) + t2 ...)."""
    if not trees:
        raise ValueError("sum_onto needs at least one tree")
    placed = [jax.device_put(t, shardings) for t in trees]
    return placed[0] if len(placed) == 1 else _add_trees(placed)
