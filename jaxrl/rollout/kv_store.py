"""The paged KV cache of one rollout instance, as a pytree with logical axes, and the page moves between pools.

`KVStore(k, v)`: each [layers, pages, kv_heads, page_size, head_dim] (`models.kv_cache_spec`), sharded by the
rollout `ShardingRules` of its instance's layout (kv heads on the TP axis, replicated when tp > kv heads; the
mapping to mesh axes lives in `sharding/`). It is allocated directly in that sharding (one jitted zeros with
out_shardings: no whole pool ever sits on one device). Page 0 is the scratch page padding rows write to.

Page moves (`move_pages`) copy pages of one pool into pages of another, **layer by layer**: per layer one
gather of the source pages on the source devices, one `jax.device_put` to the target's one-layer sharding,
and one scatter into the donated target pool, so the transient memory is one layer of the moved pages. Index
vectors are padded to `shapes.fine_bucket` lengths (at most 25% extra entries, which copy into the scratch page) to
bound compilations. The bytes a move sends are predicted without moving anything by `move_bytes` (the same
box-overlap count as `sharding.reshard_bytes`, for the valid pages; the padding entries add at most 25%) and
equal what `move_pages` reports.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from models import ModelConfig, kv_cache_spec
from sharding import ShardingRules, leaf_bytes_moved, shardings_for

from .shapes import copy_bucket, fine_bucket


@dataclasses.dataclass(frozen=True)
class SequenceKV:
    """A finished sequence's K/V, exported on its instance's devices (never through the host).

    k, v [layers, n, kv_heads, head_dim] with n >= length: the sequence's pages gathered in order, their
    count padded to a `shapes.fine_bucket` (so exports compile a bounded set of shapes); positions >=
    `length` are padding. `length` = prompt + generated tokens - 1 (the last token's K/V is never computed:
    no step reads it). MetroRLHF's blockwise trainer consumes these (`jaxrl.train.rollout_kv`)."""

    k: jax.Array
    v: jax.Array
    length: int

    def numpy(self) -> tuple[np.ndarray, np.ndarray]:
        """Host copies trimmed to `length`: K, V [layers, length, kv_heads, head_dim]."""
        return np.asarray(self.k)[:, :self.length], np.asarray(self.v)[:, :self.length]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVStore:
    k: jax.Array
    v: jax.Array

    @staticmethod
    def allocate(cfg: ModelConfig, mesh, rules: ShardingRules, num_pages: int, page_size: int, dtype) -> "KVStore":
        sharding = shardings_for(kv_cache_spec(cfg, num_pages, page_size, dtype), mesh, rules)
        shape = (cfg.num_layers, num_pages, cfg.num_kv_heads, page_size, cfg.head_dim)
        k, v = _zeros(shape, jnp.dtype(dtype), sharding)()
        return KVStore(k, v)

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def sharding(self) -> NamedSharding:
        return self.k.sharding

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def delete(self):
        self.k.delete()
        self.v.delete()

    def copy_pages(self, copies: list[tuple[int, int]]) -> "KVStore":
        """Copy page src -> dst in every layer, for each (src, dst) (copy-on-write of shared prompt pages)."""
        if not copies:
            return self
        src, dst = _padded([c[0] for c in copies], copy_bucket), _padded([c[1] for c in copies], copy_bucket)
        put = lambda x: jax.device_put(x, NamedSharding(self.sharding.mesh, PartitionSpec()))  # noqa: E731
        return KVStore(*_copy_pages(self.k, self.v, put(src), put(dst)))

    def export(self, pages: list[int], length: int) -> SequenceKV:
        """Contiguous K, V of a sequence held in `pages`, on this pool's devices (`SequenceKV`)."""
        put = lambda x: jax.device_put(x, NamedSharding(self.sharding.mesh, PartitionSpec()))  # noqa: E731
        k, v = _export(self.k, self.v, put(_padded(pages)))
        return SequenceKV(k, v, length)

    def warm_export(self, max_pages: int):
        """Compile `export` for every page-count bucket a sequence of up to `max_pages` pages can have."""
        for n in sorted({fine_bucket(p) for p in range(1, max_pages + 1)}):
            self.export([0] * n, 0)

    def take(self, pages: list[int]) -> tuple[jax.Array, jax.Array]:
        """K, V of `pages` [layers, n', kv_heads, page_size, head_dim] on this pool's devices (relayout staging);
        n' = `fine_bucket(len(pages))` (bounded shapes: rows past len(pages) repeat the first page)."""
        idx = _padded(list(pages))
        idx[len(pages):] = pages[0] if pages else 0
        return _take_all(self.k, self.v, jnp.asarray(idx))


def _padded(ids: list[int], bucket=fine_bucket) -> np.ndarray:
    out = np.zeros(bucket(len(ids)), np.int32)
    out[:len(ids)] = ids
    return out


@functools.lru_cache(maxsize=64)
def _zeros(shape, dtype, sharding):
    return jax.jit(lambda: (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)), out_shardings=(sharding, sharding))


@functools.lru_cache(maxsize=64)
def _copy_pages_fn(sharding):
    return jax.jit(lambda k, v, src, dst: (k.at[:, dst].set(k[:, src]), v.at[:, dst].set(v[:, src])),
                   out_shardings=(sharding, sharding), donate_argnums=(0, 1))


def _copy_pages(k, v, src, dst):
    return _copy_pages_fn(k.sharding)(k, v, src, dst)


@jax.jit
@jax.jit
def _export(k, v, page_ids):
    Lr, _, K, ps, D = k.shape
    flat = lambda pages: pages[:, page_ids].transpose(0, 1, 3, 2, 4).reshape(Lr, -1, K, D)  # noqa: E731
    return flat(k), flat(v)


@functools.lru_cache(maxsize=64)
def _take_all_fn(sharding):
    return jax.jit(lambda k, v, idx: (k[:, idx], v[:, idx]), out_shardings=(sharding, sharding))


def _take_all(k, v, idx):
    return _take_all_fn(k.sharding)(k, v, idx)


@jax.jit
def _take_layer(pool, layer, idx):
    return pool[layer, idx]


@functools.lru_cache(maxsize=64)
def _put_layer_fn(sharding):
    # out_shardings = the pool's own: the donated pool is updated in place (no second pool, even briefly)
    return jax.jit(lambda pool, layer, idx, pages: pool.at[layer, idx].set(pages), out_shardings=sharding,
                   donate_argnums=(0,))


def _put_layer(pool, layer, idx, pages):
    return _put_layer_fn(pool.sharding)(pool, layer, idx, pages)


def move_bytes(n_pages: int, src: KVStore | tuple, dst: KVStore) -> int:
    """Bytes the target devices receive when `n_pages` pages (K and V, every layer) move from `src` to `dst`:
    per target shard, what the same device did not already hold (`sharding.leaf_bytes_moved`). `src` may be
    a store or staged (k, v) arrays from `KVStore.take`."""
    src_sh = src.sharding if isinstance(src, KVStore) else src[0].sharding
    shape = (dst.k.shape[0], n_pages, *dst.k.shape[2:])
    return 2 * leaf_bytes_moved(shape, dst.k.dtype, src_sh, dst.sharding)


def move_pages(src: KVStore | tuple, src_pages: list[int], dst: KVStore, dst_pages: list[int]) -> tuple[KVStore, int]:
    """Copy pages `src_pages` of `src` (a store, or staged (k, v) arrays whose axis 1 `src_pages` indexes) into
    `dst_pages` of `dst`, layer by layer; returns the new `dst` (donated) and the bytes sent (== `move_bytes`)."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} target pages")
    if not src_pages:
        return dst, 0
    sk, sv = (src.k, src.v) if isinstance(src, KVStore) else src
    n = len(src_pages)
    s_idx, d_idx = _padded(list(src_pages)), _padded(list(dst_pages))
    if len(src_pages) < len(s_idx) and not isinstance(src, KVStore):
        s_idx[n:] = src_pages[0]        # staged arrays have no scratch page; re-read a real one (written to scratch)
    s_rep = NamedSharding(sk.sharding.mesh, PartitionSpec())
    d_rep = NamedSharding(dst.sharding.mesh, PartitionSpec())
    s_idx, d_idx = jax.device_put(s_idx, s_rep), jax.device_put(d_idx, d_rep)
    layer_sh = NamedSharding(dst.sharding.mesh, PartitionSpec(*tuple(dst.sharding.spec)[1:]))
    k, v = dst.k, dst.v
    for layer in range(sk.shape[0]):
        l_src, l_dst = jax.device_put(np.int32(layer), s_rep), jax.device_put(np.int32(layer), d_rep)
        k = _put_layer(k, l_dst, d_idx, jax.device_put(_take_layer(sk, l_src, s_idx), layer_sh))
        v = _put_layer(v, l_dst, d_idx, jax.device_put(_take_layer(sv, l_src, s_idx), layer_sh))
    out = KVStore(k, v)
    return out, move_bytes(n, (sk, sv), out)
