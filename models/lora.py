"""LoRA (Hu et al. 2021): a targeted projection W becomes W + (alpha / rank) · A B, with W frozen and only A, B
trained.

A weight tree with adapters is an ordinary `Weights` whose targeted `Layers` fields (`ModelConfig.lora.fields`)
hold a `LoraLinear` node instead of an array: (w [L, *in, *out], lora_a [L, *in, r], lora_b [L, r, *out]), with
the scale as static metadata. Nothing else changes shape, so every path that scans the layers (the train
forward, the blockwise backward, the rollout's prefill and decode) runs the adapters through
`models.layers.dense`, which computes the low-rank path x W + s · (x A) B without ever forming A B: the
weight gradient of the frozen W is never computed, and the decode step reads W once plus two thin matrices.

`weight_specs(cfg)` describes the adapters with logical axes (A: W's input axes + an unsharded rank axis, B: an
unsharded rank axis + W's output axes), so they shard by the same rules as their W (A on fsdp over embed, B on tp
over heads/mlp in training; B on tp in the rollout). B starts at zero: step 0 is the base model exactly.

The tree operations here are what the trainer needs:
    split(tree) -> (trainable, frozen)    the adapters alone (gradients, optimizer state, checkpoints, syncs)
                                          and the rest, each the whole structure with None elsewhere
    join(trainable, frozen)               the inverse
    (fresh adapters on plain weights: `models.weights.attach_lora`; PEFT files: `models.peft_io`)
    base(tree)                            the weights with the adapters off (the reference policy: no copy)
    rebase(tree, new_base)                the adapters on other base weights
    merge(tree)                           W + s·A B as plain weights (the HF export, merged rollout copies)
A tree without adapters splits into (tree, None), and join(tree, None) is the tree: the full-parameter path
is the same code with nothing frozen.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp


ADAPTER_FIELDS = ("lora_a", "lora_b")
ATTACH_KEY = 0x10BA         # fresh adapters draw from fold_in(the weights' key, ATTACH_KEY)
_N_IN = {"wo": 2}           # input axes of each projection (wo contracts heads and head_dim); the rest: 1


@dataclasses.dataclass(frozen=True)
class LoraLinear:
    """A frozen projection with its adapters; `models.layers.dense` applies it."""

    w: Any
    lora_a: Any
    lora_b: Any
    scale: float = 1.0


jax.tree_util.register_dataclass(LoraLinear, data_fields=["w", "lora_a", "lora_b"], meta_fields=["scale"])


def n_in(field: str) -> int:
    return _N_IN.get(field, 1)


def _is_lora(x) -> bool:
    return isinstance(x, LoraLinear)


def has_adapters(tree) -> bool:
    return any(_is_lora(x) for x in jax.tree.leaves(tree, is_leaf=_is_lora))


def _is_adapter_path(path) -> bool:
    return bool(path) and getattr(path[-1], "name", None) in ADAPTER_FIELDS


def split(tree):
    """(trainable, frozen): `tree` with None in place of every frozen leaf, and with None in place of every
    adapter leaf. Works on any tree shaped like the weights (arrays, shardings, ShapeDtypeStructs). Without
    adapters: (tree, None)."""
    if not has_adapters(tree):
        return tree, None
    pick = lambda want: jax.tree_util.tree_map_with_path(       # noqa: E731
        lambda p, x: x if _is_adapter_path(p) == want else None, tree)
    return pick(True), pick(False)


def join(trainable, frozen):
    """`split`'s inverse."""
    if frozen is None:
        return trainable
    return jax.tree.map(lambda t, f: f if t is None else t, trainable, frozen, is_leaf=lambda x: x is None)


def _map_lora(tree, fn):
    return jax.tree.map(lambda x: fn(x) if _is_lora(x) else x, tree, is_leaf=_is_lora)


def base(tree):
    """The weights with the adapters off (their frozen projections; the same arrays, nothing copied)."""
    return _map_lora(tree, lambda x: x.w)


def rebase(tree, new_base):
    """`tree` with its base weights replaced by `new_base` (plain weights, as `base(tree)` is shaped), the
    adapters kept: e.g. after a full-parameter warm start of the base. Without adapters: `new_base`."""
    return jax.tree.map(lambda x, b: dataclasses.replace(x, w=b) if _is_lora(x) else b, tree, new_base,
                        is_leaf=_is_lora)


def delta(x: LoraLinear):
    """s · A B in W's shape, in float32 ([L, *in, *out])."""
    r = x.lora_a.shape[-1]
    a = x.lora_a.astype(jnp.float32).reshape(x.lora_a.shape[0], -1, r)
    b = x.lora_b.astype(jnp.float32).reshape(x.lora_b.shape[0], r, -1)
    return (x.scale * jnp.matmul(a, b)).reshape(x.w.shape)


def merge(tree):
    """Plain weights W + s · A B, added in float32 and rounded once to W's dtype: what the HF export writes and
    a merged rollout copy holds."""
    return _map_lora(tree, lambda x: (x.w.astype(jnp.float32) + delta(x)).astype(x.w.dtype))


def adapter_bytes(tree) -> int:
    """Bytes of the trainable leaves (every leaf when the tree has no adapters)."""
    trainable, _ = split(tree)
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(trainable))


def adapter_init(key, shape, dtype):
    """PEFT's default A: kaiming-uniform with a=sqrt(5), i.e. uniform in ±1/sqrt(fan_in) (fan_in: the input
    axes, shape[1:-1] of [L, *in, r])."""
    fan_in = math.prod(shape[1:-1])
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)
