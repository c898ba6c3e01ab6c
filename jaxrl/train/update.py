"""The RL update over fixed-shape micro-batches: one compiled gradient step whatever the batch.

A packed batch's row count changes every step (long-tailed response lengths pack into more or fewer
rows), and a fused train step compiled per row count recompiled for every new count. Here the batch is
cut into micro-batches of exactly `rows` x `pack_len` tokens (`rl.micro_batches`; the last one padded
with zero-weight rows), and an update is

    acc = zero_sums(params); acc = grad_step(params, mb_k, acc) ...;  apply_update(params, opt, acc)

(`step.make_grad_step` / `make_apply_update`: the fused step's scan body and update code, so the result is
the fused step's over the same micro-batches, whose scan also starts from zeros). Every micro-batch runs the
one gradient program that adds to an accumulator, the first onto zeros (0 + x is x, bit for bit:
tests/test_bounded_shapes.py), so a run compiles one gradient program, not one without an accumulator and one with
(each ~2.7 s of a cold start's compilation for the quickstart's model). Reference and old-policy log-probs run
per micro-batch too. The executables come from an explicit `ExecutableCache` (ahead-of-time compiled by input
signature), and `warm()` compiles all of them before the first step — the zeros, grad, the update, the
log-prob pass — feeding each one's output shardings to the next until they repeat, so a run compiles nothing
after it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl.rollout.executor import ExecutableCache, canonical
from jaxrl.rollout.executor import abstract, out_abstract
from models import lora

from .batch import FIELDS
from .step import STATS, make_apply_update, make_grad_step, make_logprob_fn

CACHE = ExecutableCache(maxsize=64)


def _constrain(x, sharding):
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def zero_sums(params, *, shardings=None, scalar=None, stats=STATS):
    """Zero gradient sums of the trainable parameters in their own shardings (`shardings`: their leaves'), zero
    sums of the `stats` (`scalar`: their sharding): the accumulator a first micro-batch's sums are added to."""
    params = lora.split(params)[0]
    leaves = jax.tree.leaves(params)
    zeros = [_constrain(jnp.zeros(p.shape, p.dtype), s) for p, s in zip(leaves, shardings or [None] * len(leaves))]
    stats = {k: _constrain(jnp.zeros((), jnp.float32), scalar) for k in stats}
    return jax.tree.unflatten(jax.tree.structure(params), zeros), stats


# keep_unused: the parameters stay inputs (read by nothing), so the executable has a fingerprint and a program JAX's
# cache loaded can be stored (`jaxrl.executable_store`: XLA:CPU gives a program without inputs none)
ZERO_SUMS = jax.jit(zero_sums, static_argnames=("shardings", "scalar", "stats"), keep_unused=True)


def sums_shardings(params) -> dict:
    """`zero_sums`' static arguments: the parameters' leaf shardings and the stats sums' (replicated over
    their mesh); None for parameters that are not on a mesh."""
    leaves = tuple(canonical(x.sharding) for x in jax.tree.leaves(lora.split(params)[0]))
    if not isinstance(leaves[0], NamedSharding):
        return {"shardings": None, "scalar": None}
    return {"shardings": leaves, "scalar": NamedSharding(leaves[0].mesh, P())}


def warm_sums(cache: ExecutableCache, name: str, grad, params, mb, acc):
    """Compile `grad(params, mb, acc)` (abstract inputs), feeding its output sums back as `acc` until their
    placement repeats (at most 3 programs); returns the abstract sums."""
    for _ in range(3):
        out = out_abstract(cache.compile(name, grad, params, mb, acc))
        if cache.key("x", out) == cache.key("x", acc):
            break
        acc = out
    return out


def needs_policy_logprobs(cfg) -> bool:
    """Whether a step runs the log-prob pass on the policy's own weights: the old log-probs of several
    mini-batches, or the reward's KL (algo.kl_in_reward). On-policy with one update it never does (the ratio
    is 1: `step.token_loss`), so its executable is not compiled. An off-policy objective always does
    (`corrections`: π_prox, GSPO's ratio), and so does OPD with algo.opd.student_logp=trainer (the student's
    log-probs for the advantage)."""
    return (cfg.algo.mini_batches > 1 or cfg.algo.kl_in_reward or cfg.algo.objective != "ppo"
            or (cfg.algo.advantage == "opd" and cfg.algo.opd.student_logp == "trainer"))


class Updater:
    """grad / apply / log-prob executables for one model, loss and optimizer, over fixed micro-batches."""

    def __init__(self, cfg, spec, tx, *, cache: ExecutableCache = CACHE):
        self.grad = make_grad_step(cfg, spec)
        self.apply = make_apply_update(tx)
        self.logp = make_logprob_fn(cfg, spec)
        self.cache = cache

    def logprobs(self, params, mb):
        """Per-token log-probs [rows, L] of one micro-batch (its packed fields only)."""
        return self.cache("logp", self.logp, params, {k: mb[k] for k in FIELDS})

    def update(self, params, opt_state, mbs: list[dict], denominator: float = 1.0):
        """One optimizer update from the summed gradients of `mbs` (params and opt_state are donated)."""
        acc = None
        for mb in mbs:
            acc = self.accumulate(params, mb, acc)
        grads, stats = acc
        return self.cache("apply", self.apply, params, opt_state, grads, float(denominator), stats)

    # ------------------------------------------------------------ the gradient-only entry point
    def accumulate(self, params, mb: dict, acc=None):
        """One micro-batch's (grad_sums, stats_sums) added to `acc` (None: zeros in the weights' shardings), on
        whatever mesh `mb` and `params` live on: what streamed and disaggregated updates call per micro-batch,
        summing the accumulators onto the train mesh and calling `apply` once at the end (`grad_stream`)."""
        if acc is None:
            acc = self.cache("zeros", ZERO_SUMS, params, **sums_shardings(params))
        return self.cache("grad", self.grad, params, mb, acc)

    def warm_accumulate(self, params, mb: dict):
        """Compile every executable `accumulate` runs for these (abstract) params and micro-batch, the zero sums
        and the gradient, following the sums' shardings; nothing runs. Returns the abstract sums (where they live)."""
        p, mb = abstract(params), abstract(mb)
        acc = out_abstract(self.cache.compile("zeros", ZERO_SUMS, p, **sums_shardings(p)))
        return warm_sums(self.cache, "grad", self.grad, p, mb, acc)

    def reset_counts(self):
        """Start counting this step's mechanism metrics (`counts`) afresh."""

    def counts(self) -> dict:
        """The update's own per-step metrics since `reset_counts` (the blockwise backward's blocks)."""
        return {}

    def warm(self, params, opt_state, mb: dict, logp_params=(), own_logp: bool = True) -> int:
        """Compile every executable `update`/`logprobs` will run on micro-batches shaped like `mb` (arrays or
        ShapeDtypeStructs with shardings), following output shardings until the inputs repeat, and the
        log-prob pass for each of `logp_params` too. `own_logp`: the log-prob pass on the policy's weights
        too (`needs_policy_logprobs`). Nothing runs and nothing is donated. Returns the number of new
        compilations."""
        before = self.cache.compiles
        p, o, mb = abstract(params), abstract(opt_state), abstract(mb)
        for extra in logp_params:          # e.g. the reference policy's weights
            self.cache.compile("logp", self.logp, abstract(extra), {k: mb[k] for k in FIELDS})
        for _ in range(3):
            if own_logp:
                self.cache.compile("logp", self.logp, p, {k: mb[k] for k in FIELDS})
            acc2 = self.warm_accumulate(p, mb)
            new_p, new_o, _ = out_abstract(self.cache.compile("apply", self.apply, p, o, acc2[0], 1.0, acc2[1]))
            if self.cache.key("x", (new_p, new_o)) == self.cache.key("x", (p, o)):
                break
            p, o = new_p, new_o
        return self.cache.compiles - before

