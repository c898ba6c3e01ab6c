"""The flash attention kernel's test cases (`tests/test_attention_kernel.py`, `scripts/gpu_check_kernels.py`):
the shape grid, its tolerances per dtype and the inputs of a case."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels.attention import BlockSizes

# Tolerances, set once per dtype. Gradients are checked in float32 only.
ATOL = {jnp.float32: {"fwd": 2e-5, "grad": 1e-4}, jnp.bfloat16: {"fwd": 3e-2}}
BLOCKS = BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16, block_q_dq=16, block_k_dq=16)


@dataclasses.dataclass(frozen=True)
class Case:
    T: int
    S: int
    H: int
    K: int
    D: int = 16
    B: int = 2
    q_offset: int | tuple[int, ...] = 0
    kv_lengths: tuple[int, ...] | None = None
    causal: bool = True
    window: int | None = None
    segments: bool = False
    blocks: BlockSizes | None = BLOCKS


CASES = {
    "train_mha": Case(T=37, S=37, H=2, K=2),
    "train_gqa2_packed": Case(T=40, S=40, H=4, K=2, D=32, segments=True),
    "prefill_chunk_gqa4": Case(T=19, S=40, H=4, K=1, q_offset=21),
    "prefill_ragged_offsets": Case(T=13, S=35, H=4, K=2, D=32, q_offset=(22, 7), kv_lengths=(35, 20)),
    "prefill_packed_history": Case(T=17, S=39, H=2, K=1, q_offset=(22, 9), segments=True),
    "window": Case(T=40, S=40, H=4, K=2, window=7),
    "window_offset_ragged": Case(T=11, S=38, H=4, K=4, q_offset=(27, 3), kv_lengths=(38, 14), window=12),
    "noncausal_ragged": Case(T=23, S=33, H=2, K=1, causal=False, kv_lengths=(33, 9)),
    "noncausal_packed_window": Case(T=30, S=30, H=4, K=2, causal=False, segments=True, window=11),
    "empty_rows": Case(T=9, S=21, H=2, K=1, q_offset=(12, 0), kv_lengths=(21, 0)),
    "default_blocks": Case(T=5, S=40, H=4, K=2, q_offset=35, blocks=None),
}


def make_inputs(c: Case, dtype, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (c.B, c.T, c.H, c.D), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (c.B, c.S, c.K, c.D), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (c.B, c.S, c.K, c.D), jnp.float32).astype(dtype)
    cot = jax.random.normal(keys[3], (c.B, c.T, c.H, c.D), jnp.float32).astype(dtype)
    offset = c.q_offset if isinstance(c.q_offset, int) else jnp.asarray(c.q_offset, jnp.int32)
    kw = dict(q_offset=offset, causal=c.causal, window=c.window,
              kv_lengths=None if c.kv_lengths is None else jnp.asarray(c.kv_lengths, jnp.int32))
    if c.segments:  # packed documents: sorted ids with random boundaries; queries take their keys' ids
        rng = np.random.default_rng(seed)
        kv_seg = np.sort(rng.integers(0, 4, (c.B, c.S)), axis=1).astype(np.int32)
        offs = np.broadcast_to(np.asarray(c.q_offset), (c.B,))
        q_seg = np.stack([kv_seg[b, offs[b]:offs[b] + c.T] if offs[b] + c.T <= c.S else
                          rng.integers(0, 4, c.T) for b in range(c.B)]).astype(np.int32)
        kw.update(q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg))
    return (q, k, v), cot, kw
