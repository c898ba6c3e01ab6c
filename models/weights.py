"""Model weights as registered-dataclass pytrees with logical axis names.

Per-layer tensors are stacked on a leading `layers` axis so the forward pass can `lax.scan` over
layers and resharding can move one layer at a time. Every leaf is described by an `ArraySpec`
(shape, dtype, logical axes, initializer); `abstract`, `logical_axes` and `init` are derived from the
one `weight_specs(cfg)` tree, so the three never disagree. Optional tensors (biases, q/k norms, an
untied LM head) are `None` when the architecture has none.

Vocabulary padding. A vocabulary that does not divide the tensor-parallel axis (50257, 151665 ...) is padded:
`embed` gets rows and `lm_head` columns up to `padded_vocab(V, tp)`, all zeros (`weight_specs(cfg,
vocab_size=...)`, `init(..., vocab_size=...)`, `fit_vocab`). `cfg.vocab_size` always stays the real
vocabulary; `forward` returns real-vocabulary logits, the rollout sampler gives padded columns no mass and the
log-prob kernel leaves them out (`kernels.token_logprobs(valid_vocab=)`), so their gradient is exactly zero and
they stay zero under training (weight decay of zero is zero). Megatron and vLLM pad the same way.

Logical axes used (mapped to mesh axes only in `sharding/`):
  layers, vocab, embed, heads, kv_heads, head_dim, mlp           (weights)
  pages, page_size                                                (the rollout's paged KV cache, with
                                                                  layers, kv_heads and head_dim)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from . import lora as _lora
from .config import ModelConfig

LOGICAL_AXES = ("layers", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "pages", "page_size")
KV_CACHE_AXES = ("layers", "pages", "kv_heads", "page_size", "head_dim")


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """Shape, dtype and logical axes of one weight leaf (a pytree leaf, not a node)."""

    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]
    init: Callable[[jax.Array, tuple[int, ...], Any], jax.Array]

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")
        unknown = [a for a in self.axes if a is not None and a not in LOGICAL_AXES]
        if unknown:
            raise ValueError(f"unknown logical axes {unknown}; valid: {LOGICAL_AXES}")


def _pytree(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = tuple(f.name for f in dataclasses.fields(cls))
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=())


@_pytree
class Layers:
    """All decoder layers, stacked on axis 0 (`layers`)."""

    attn_norm: Any          # [L, embed]
    wq: Any                 # [L, embed, heads, head_dim]
    wk: Any                 # [L, embed, kv_heads, head_dim]
    wv: Any                 # [L, embed, kv_heads, head_dim]
    wo: Any                 # [L, heads, head_dim, embed]
    mlp_norm: Any           # [L, embed]
    w_gate: Any             # [L, embed, mlp]
    w_up: Any               # [L, embed, mlp]
    w_down: Any             # [L, mlp, embed]
    bq: Any = None          # [L, heads, head_dim]      (qkv_bias)
    bk: Any = None          # [L, kv_heads, head_dim]   (qkv_bias)
    bv: Any = None          # [L, kv_heads, head_dim]   (qkv_bias)
    q_norm: Any = None      # [L, head_dim]             (qk_norm)
    k_norm: Any = None      # [L, head_dim]             (qk_norm)


@_pytree
class Weights:
    embed: Any              # [vocab, embed]
    layers: Layers
    final_norm: Any         # [embed]
    lm_head: Any = None     # [embed, vocab]; None when tied to `embed`


def is_spec(x) -> bool:
    return isinstance(x, ArraySpec)


@functools.cache
def _normal(fan_in_dims: tuple[int, ...]):
    """Scaled normal init: std = 1/sqrt(fan_in), fan_in = product of the given (non-layer) dims. One function
    per `fan_in_dims` (cached), so equal specs compare equal and `init`'s program is built once per shape."""

    def init(key, shape, dtype):
        fan_in = math.prod(shape[d] for d in fan_in_dims)
        return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

    return init


def _ones(key, shape, dtype):
    del key
    return jnp.ones(shape, dtype)


def _zeros(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)


def _embed_init(key, shape, dtype):
    return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """`vocab_size` rounded up to a multiple of `multiple` (e.g. 50257 -> 50258 for tp=2)."""
    if vocab_size < 1 or multiple < 1:
        raise ValueError(f"padded_vocab({vocab_size}, {multiple}): both must be positive")
    return -(-vocab_size // multiple) * multiple


def _vocab_rows(cfg: ModelConfig, vocab_size: int | None) -> int:
    """The embedding row count: `vocab_size` (padded, >= the real `cfg.vocab_size`) or the real one."""
    if vocab_size is None:
        return cfg.vocab_size
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < cfg.vocab_size:
        raise ValueError(f"vocab_size={vocab_size!r} must be an int >= the model's vocabulary {cfg.vocab_size} "
                         f"(the padded row count of embed / columns of lm_head)")
    return vocab_size


def _padded_init(init, real: int, axis: int):
    """`init`, with the entries past `real` along `axis` (padded vocabulary rows/columns) set to zero."""

    def padded(key, shape, dtype):  # the real part is drawn at the real shape: same values as unpadded
        x = init(key, shape[:axis] + (real,) + shape[axis + 1:], dtype)
        return jnp.pad(x, [(0, shape[d] - real if d == axis else 0) for d in range(len(shape))])

    return padded


def weight_specs(cfg: ModelConfig, dtype=jnp.float32, vocab_size: int | None = None) -> Weights:
    """The `ArraySpec` of every leaf, for `cfg`, in `dtype`.

    `vocab_size` (default `cfg.vocab_size`) is the row count of `embed` and the column count of `lm_head`:
    a padded vocabulary (see `padded_vocab`) lets the `vocab` axis divide a tensor-parallel mesh axis. Padded
    rows/columns initialise to zeros; `cfg.vocab_size` stays the real vocabulary, and the forward passes,
    samplers and log-prob kernels ignore everything past it.
    """
    L, E, H, K, D, M = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size)
    V = _vocab_rows(cfg, vocab_size)
    embed_init, head_init = _embed_init, _normal((0,))
    if V != cfg.vocab_size:
        embed_init, head_init = _padded_init(embed_init, cfg.vocab_size, 0), _padded_init(head_init, cfg.vocab_size, 1)

    def spec(shape, axes, init):
        return ArraySpec(tuple(shape), dtype, tuple(axes), init)

    bias = lambda heads, name: spec((L, heads, D), ("layers", name, "head_dim"), _zeros) if cfg.qkv_bias else None
    norm = lambda: spec((L, D), ("layers", "head_dim"), _ones) if cfg.qk_norm else None
    layers = Layers(
        attn_norm=spec((L, E), ("layers", "embed"), _ones),
        wq=spec((L, E, H, D), ("layers", "embed", "heads", "head_dim"), _normal((1,))),
        wk=spec((L, E, K, D), ("layers", "embed", "kv_heads", "head_dim"), _normal((1,))),
        wv=spec((L, E, K, D), ("layers", "embed", "kv_heads", "head_dim"), _normal((1,))),
        wo=spec((L, H, D, E), ("layers", "heads", "head_dim", "embed"), _normal((1, 2))),
        mlp_norm=spec((L, E), ("layers", "embed"), _ones),
        w_gate=spec((L, E, M), ("layers", "embed", "mlp"), _normal((1,))),
        w_up=spec((L, E, M), ("layers", "embed", "mlp"), _normal((1,))),
        w_down=spec((L, M, E), ("layers", "mlp", "embed"), _normal((1,))),
        bq=bias(H, "heads"), bk=bias(K, "kv_heads"), bv=bias(K, "kv_heads"),
        q_norm=norm(), k_norm=norm(),
    )
    if cfg.lora is not None:
        layers = dataclasses.replace(layers, **{f: _adapter_specs(getattr(layers, f), f, cfg.lora.rank, cfg.lora.scale)
                                                for f in cfg.lora.fields})
    return Weights(
        embed=spec((V, E), ("vocab", "embed"), embed_init),
        layers=layers,
        final_norm=spec((E,), ("embed",), _ones),
        lm_head=None if cfg.tie_embeddings else spec((E, V), ("embed", "vocab"), head_init),
    )


def _adapter_specs(w: ArraySpec, field: str, rank: int, scale: float) -> _lora.LoraLinear:
    """W's spec with its adapters: A [L, *in, r] on W's input axes, B [L, r, *out] (zeros) on its output axes;
    the rank axis is never sharded."""
    k = 1 + _lora.n_in(field)
    a = ArraySpec(w.shape[:k] + (rank,), w.dtype, w.axes[:k] + (None,), _lora.adapter_init)
    b = ArraySpec(w.shape[:1] + (rank,) + w.shape[k:], w.dtype, w.axes[:1] + (None,) + w.axes[k:], _zeros)
    return _lora.LoraLinear(w, a, b, scale)


def kv_cache_spec(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32) -> ArraySpec:
    """One of a paged KV cache's two arrays (K or V): [layers, pages, kv_heads, page_size, head_dim],
    head-major inside a page so a gathered sequence is contiguous per kv head."""
    return ArraySpec((cfg.num_layers, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim), dtype, KV_CACHE_AXES,
                     _zeros)


def abstract(cfg: ModelConfig, dtype=jnp.float32, vocab_size: int | None = None) -> Weights:
    """`jax.ShapeDtypeStruct` leaves: shapes without memory (for eval_shape, sharding, memory plans)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), weight_specs(cfg, dtype, vocab_size),
                        is_leaf=is_spec)


def logical_axes(cfg: ModelConfig, vocab_size: int | None = None) -> Weights:
    """A `Weights` tree whose leaves are `ArraySpec`s; read `.axes` (see `sharding.shardings_for`).
    `vocab_size`: the padded vocabulary row count, as in `weight_specs`."""
    return weight_specs(cfg, vocab_size=vocab_size)


def init(key: jax.Array, cfg: ModelConfig, dtype=jnp.float32, shardings: Weights | None = None,
         vocab_size: int | None = None) -> Weights:
    """Random weights. With `shardings` (a `Weights` tree of `jax.sharding.Sharding`), each leaf is
    created directly in its sharding by one jitted program, so no device ever holds a whole leaf.
    `vocab_size`: pad `embed` rows / `lm_head` columns up to it with zeros (`weight_specs`); the real rows
    get the same values as an unpadded init with the same key. With `cfg.lora`, the base weights are those of
    the same config without adapters (same key), and the adapters come from `attach_lora` (a key folded from it)."""
    if cfg.lora is not None:
        plain = dataclasses.replace(cfg, lora=None)
        w = init(key, plain, dtype, None if shardings is None else _lora.base(shardings), vocab_size)
        return attach_lora(w, cfg, jax.random.fold_in(key, _lora.ATTACH_KEY), shardings)
    specs = weight_specs(cfg, dtype, vocab_size)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    out_shardings = None if shardings is None else tuple(jax.tree.leaves(shardings))
    if out_shardings is not None and len(out_shardings) != len(leaves):
        raise ValueError(f"shardings tree has {len(out_shardings)} leaves, weights have {len(leaves)}")

    return jax.tree.unflatten(treedef, _init_program(tuple(leaves), out_shardings)(key))


@functools.lru_cache(maxsize=64)
def _init_program(leaves: tuple[ArraySpec, ...], out_shardings):
    """`init`'s jitted program for these specs and shardings: one per shape in a process (a jit of a new closure
    on every call was traced, lowered and looked up again each time a model was initialised)."""

    def make(key):
        keys = jax.random.split(key, len(leaves))
        return tuple(s.init(k, s.shape, s.dtype) for k, s in zip(keys, leaves))

    return jax.jit(make, out_shardings=out_shardings)


def attach_lora(weights, cfg: ModelConfig, key: jax.Array, shardings=None):
    """Plain `weights` (a base model: initialised or loaded) with fresh adapters for `cfg.lora` (A drawn as PEFT
    does, uniform in ±1/sqrt(fan_in); B zeros). `shardings`: the LoRA tree's shardings (from
    `logical_axes(cfg)`), so each adapter is created in place."""
    if cfg.lora is None:
        raise ValueError("attach_lora: the model config has no lora section")
    if _lora.has_adapters(weights):
        raise ValueError("attach_lora: the weights already carry adapters")
    specs = weight_specs(cfg, weights.final_norm.dtype, vocab_size=int(weights.embed.shape[0]))
    layers = specs.layers
    names = list(cfg.lora.fields)
    sh = [None] * len(names) if shardings is None else [getattr(shardings.layers, f) for f in names]
    keys = jax.random.split(key, len(names))
    new = {}
    for name, k, s in zip(names, keys, sh):
        spec = getattr(layers, name)
        out = None if s is None else (s.lora_a, s.lora_b)
        a, b = _adapter_program(spec.lora_a, spec.lora_b, out)(k)
        new[name] = _lora.LoraLinear(getattr(weights.layers, name), a, b, cfg.lora.scale)
    return dataclasses.replace(weights, layers=dataclasses.replace(weights.layers, **new))


@functools.lru_cache(maxsize=64)
def _adapter_program(a: ArraySpec, b: ArraySpec, out_shardings):
    """`attach_lora`'s jitted program for one adapter pair (both drawn from the same key), one per shape."""
    return jax.jit(lambda k: (a.init(k, a.shape, a.dtype), b.init(k, b.shape, b.dtype)), out_shardings=out_shardings)


def vocab_rows(weights: Weights) -> int:
    """The vocabulary row count the weights carry (padded or real): `embed.shape[0]`."""
    return int(weights.embed.shape[0])


@functools.partial(jax.jit, static_argnums=1)
def _fit_vocab(weights: Weights, size: int) -> Weights:
    def fit(x, axis):
        have = x.shape[axis]
        if size <= have:
            return jax.lax.slice_in_dim(x, 0, size, axis=axis)
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, size - have)
        return jnp.pad(x, pad)

    lm = None if weights.lm_head is None else fit(weights.lm_head, 1)
    return dataclasses.replace(weights, embed=fit(weights.embed, 0), lm_head=lm)


def fit_vocab(weights: Weights, size: int) -> Weights:
    """`weights` with `embed` rows and `lm_head` columns zero-padded (or sliced) to `size`.

    Padding up (real -> padded vocabulary, e.g. before placing weights on a tp mesh) and slicing down (back
    to the real vocabulary, or between two paddings) are the same call; slicing must not drop real rows
    (the caller knows `cfg.vocab_size`; `save_hf` slices to it). Jitted; works on sharded inputs, and XLA
    picks the output sharding (the caller reshards). Returns `weights` itself when the size already fits.
    Only `embed` and `lm_head` are new arrays; the other leaves are the inputs' own buffers.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"fit_vocab: size={size!r} must be a positive int")
    if vocab_rows(weights) == size:
        return weights
    head = _fit_vocab(dataclasses.replace(weights, layers=None, final_norm=None), size)
    return dataclasses.replace(weights, embed=head.embed, lm_head=head.lm_head)
