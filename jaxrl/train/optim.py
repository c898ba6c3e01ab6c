"""Optimizer: AdamW with linear warm-up, then cosine/linear/constant decay, and global-norm clipping.

Weight decay applies to the projection and embedding matrices only, not to norms or biases (and to LoRA's
adapters, as PEFT with the HF Trainer does). With LoRA the optimizer sees the adapters alone
(`models.lora.split`): its state has no entry for a frozen weight.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl.config.train import OptimSection
from jaxrl.executable_store import KEY_ATTRIBUTE, stable_text
from models import lora

_DECAYED = {"embed", "lm_head", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lora_a", "lora_b"}


def schedule(o: OptimSection, total_steps: int) -> optax.Schedule:
    warm = min(o.warmup_steps, max(total_steps - 1, 0))
    decay_steps = max(total_steps - warm, 1)
    if o.schedule == "cosine":
        after = optax.cosine_decay_schedule(o.lr, decay_steps, alpha=o.min_lr_ratio)
    elif o.schedule == "linear":
        after = optax.linear_schedule(o.lr, o.lr * o.min_lr_ratio, decay_steps)
    else:
        after = optax.constant_schedule(o.lr)
    if warm == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(o.lr / warm, o.lr, warm), after], [warm])


def decay_mask(params):
    def leaf_mask(path, _):
        return getattr(path[-1], "name", None) in _DECAYED
    return jax.tree_util.tree_map_with_path(leaf_mask, params)


def make_optimizer(o: OptimSection, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer and its learning-rate schedule, the latter jitted for the host's per-step reads (the
    metrics' `lr`): evaluated eagerly, optax's schedules run ~6 ops, each its own program to trace and compile."""
    lr = schedule(o, total_steps)
    parts = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm is not None else []
    parts.append(optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask))
    tx = optax.chain(*parts)
    # what made it, which determines its programs: the update's executables are stored by it (jaxrl.executable_store)
    setattr(tx, KEY_ATTRIBUTE, f"{__name__}.make_optimizer({stable_text(o)}, {total_steps})")
    return tx, jax.jit(lr)


def init_state(tx: optax.GradientTransformation, params, param_shardings, mesh):
    """Optimizer state laid out like the params (moments share each param's sharding) with the rest
    (step counters) replicated over the mesh — global arrays every process can checkpoint. Of the trainable
    leaves only (with LoRA: the adapters)."""
    params, param_shardings = lora.split(params)[0], lora.split(param_shardings)[0]
    abstract = jax.eval_shape(tx.init, params)
    out = optax.tree_map_params(tx, lambda _, sh: sh, abstract, param_shardings,
                                transform_non_params=lambda _: NamedSharding(mesh, P()))
    return jax.jit(tx.init, out_shardings=out)(params)
