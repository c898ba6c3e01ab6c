"""How many KV pages an instance gets: a per-device memory budget minus its weight shard.

    pages = (budget_per_device - weight bytes on the device) // (one page's K+V bytes on the device)

The budget is `kv_bytes_per_device`, or `kv_memory_fraction` of the smallest `bytes_limit` the instance's
devices report (`Device.memory_stats()`; default fraction 0.5, leaving room for the colocated trainer's
state). It covers the instance's weights and KV (like vLLM's gpu_memory_utilization). A page's bytes on a
device shrink with tp when KV heads shard over tp and stay whole when they are replicated (tp > kv heads);
the weight shard shrinks with tp, so a larger TP group has more pages as long as its KV heads shard.
`num_pages` overrides everything. With no budget and no memory figure (the CPU backend reports none) the
pool holds `max_batch` sequences of `max_seq_len` tokens, plus the scratch page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models import ModelConfig, abstract, kv_cache_spec, logical_axes
from sharding import Layout, ShardingRules, padded_vocab_for, shardings_for

DEFAULT_MEMORY_FRACTION = 0.5


def weight_bytes_per_device(weights) -> int:
    """The largest number of weight bytes any one device holds (`weights`: arrays, or ShapeDtypeStructs with
    shardings: a layout not built yet)."""
    per_device: dict = {}
    for x in jax.tree.leaves(weights):
        if isinstance(x, jax.ShapeDtypeStruct):
            n = int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
            for d in x.sharding.device_set:
                per_device[d] = per_device.get(d, 0) + n
            continue
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)


def page_bytes_per_device(cfg: ModelConfig, mesh, page_size: int, dtype) -> int:
    """Bytes one page (K and V, every layer) takes on each device of an instance on `mesh`."""
    spec = kv_cache_spec(cfg, 1, page_size, dtype)
    sharding = shardings_for(spec, mesh, ShardingRules.rollout(cfg, Layout(tp=mesh.shape["tp"])))
    return 2 * int(np.prod(sharding.shard_shape(spec.shape))) * jnp.dtype(dtype).itemsize


def device_memory(devices) -> int | None:
    """The smallest memory limit the devices report, or None when any reports none (CPU)."""
    limits = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def instance_pages(cfg: ModelConfig, mesh, weights, *, num_pages: int | None, page_size: int, max_batch: int,
                   max_seq_len: int, kv_bytes_per_device: int | None = None, kv_memory_fraction: float | None = None,
                   kv_dtype=None) -> int:
    """Pages (scratch page included) for an instance on `mesh` holding `weights` (see module docstring)."""
    if num_pages:
        return int(num_pages)
    budget = kv_bytes_per_device
    if budget is None:
        total = device_memory(mesh.devices.flat)
        if total is not None:
            budget = int(total * (kv_memory_fraction or DEFAULT_MEMORY_FRACTION))
        elif kv_memory_fraction is not None:
            raise ValueError("kv_memory_fraction: these devices report no memory size (the CPU backend); set "
                             "kv_bytes_per_device or num_pages instead")
    if budget is None:
        return max_batch * -(-max_seq_len // page_size) + 1
    dtype = kv_dtype or jax.tree.leaves(weights)[0].dtype
    per_page = page_bytes_per_device(cfg, mesh, page_size, dtype)
    w = weight_bytes_per_device(weights)
    pages = (budget - w) // per_page
    if pages < 2:
        raise ValueError(f"a tp={mesh.shape['tp']} instance's weight shard takes {w} bytes per device and a page "
                         f"{per_page}; a budget of {budget} bytes per device leaves room for {max(pages, 0)} pages "
                         f"(need at least 2): raise kv_bytes_per_device / kv_memory_fraction or use a larger tp")
    return int(pages)


def layout_pages(cfg: ModelConfig, devices, *, page_size: int, budget: int, dtype) -> int:
    """The pages a TP-`len(devices)` instance on `devices` would get under a per-device `budget` of bytes for
    weights + KV, counted on abstract weights laid out by the rollout rules (nothing is allocated): what the
    planner checks a layout by before choosing it, and the simulator sizes its pools by. Raises ValueError
    when the weight shard leaves no room, as `instance_pages` does."""
    layout = Layout(tp=len(devices))
    mesh = layout.make_mesh(list(devices))
    pad = padded_vocab_for(cfg, layout)
    sh = shardings_for(logical_axes(cfg, vocab_size=pad), mesh, ShardingRules.rollout(cfg, layout))
    tree = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract(cfg, np.dtype(dtype), vocab_size=pad), sh)
    return instance_pages(cfg, mesh, tree, num_pages=None, page_size=page_size, max_batch=1, max_seq_len=1,
                          kv_bytes_per_device=int(budget), kv_dtype=np.dtype(dtype))


def holds_request(cfg: ModelConfig, devices, *, page_size: int, budget: int, dtype, max_seq_len: int) -> bool:
    """Whether an instance on `devices` (`layout_pages` under `budget`) holds one request of `max_seq_len`
    tokens (the scratch page aside)."""
    try:
        pages = layout_pages(cfg, devices, page_size=page_size, budget=budget, dtype=dtype)
    except ValueError:
        return False
    return pages - 1 >= -(-max_seq_len // page_size)
