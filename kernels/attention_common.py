"""Helpers shared by the attention forward (`kernels/attention.py`), its Pallas backward
(`kernels/attention_bwd.py`) and the other kernels: the masked-score constant, the CPU dot upcast, the
kernels' static arguments, shape checks, the per-block mask and key range, the float32-accumulating dot,
the Triton compiler parameters and the block padding.

Both attention files import this module and neither imports the other's helpers, so the forward can
import the backward at module level (no import cycle).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def cpu_upcast(*xs):
    """Operands of a dot that accumulates in float32, made safe for XLA:CPU.

    XLA:CPU has no BF16 x BF16 = F32 (nor F16) dot kernel: it usually upcasts such dots itself, but not
    every dot in every graph ("Unsupported element type for DotThunk::Execute"). On the CPU backend
    (decided at trace time) bfloat16/float16 operands are cast to float32 here; every bf16/f16 value and
    the product of two of them are exact in float32, so this is the same math as bf16 products
    accumulated in float32. Elsewhere, and for float32 operands, the operands come back unchanged.
    """
    if jax.default_backend() != "cpu":
        return xs
    return tuple(x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x for x in xs)


@dataclasses.dataclass(frozen=True)
class StaticArgs:
    """Everything the kernels need at trace time (hashable: a custom_vjp nondiff argument)."""

    causal: bool
    window: int | None
    scale: float
    interpret: bool
    T: int
    S: int
    D: int
    block_q: int
    block_k: int
    block_q_dkv: int
    block_k_dkv: int
    block_q_dq: int
    block_k_dq: int

    @property
    def T_pad(self) -> int:
        return _round_up(self.T, max(self.block_q, self.block_q_dkv, self.block_q_dq))

    @property
    def S_pad(self) -> int:
        return _round_up(self.S, max(self.block_k, self.block_k_dkv, self.block_k_dq))

    @property
    def D_pad(self) -> int:
        return max(16, pl.next_power_of_2(self.D))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def check_shapes(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention wants q [B,T,H,D], k/v [B,S,K,D]; got q{q.shape} k{k.shape} v{v.shape}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention shape mismatch: q{q.shape} k{k.shape} v{v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} not a multiple of kv heads {k.shape[2]}: q{q.shape} k{k.shape}")


def block_mask(q_pos, k_pos, kv_len, q_seg, kv_seg, st: StaticArgs):
    """[bq, bk] visibility of keys at `k_pos` [bk] for queries at `q_pos` [bq] (the masking rules in `kernels/attention.py`)."""
    mask = jnp.broadcast_to(k_pos[None, :] < kv_len, (q_pos.shape[0], k_pos.shape[0]))
    if st.causal:
        mask &= k_pos[None, :] <= q_pos[:, None]
    if st.window is not None:
        mask &= q_pos[:, None] - k_pos[None, :] < st.window
    if q_seg is not None:
        mask &= q_seg[:, None] == kv_seg[None, :]
    return mask


def key_block_range(q_first, q_last, kv_len, block_k: int, st: StaticArgs):
    """[lo, hi) key blocks that queries at positions q_first..q_last can see (non-negative bounds)."""
    end = jnp.minimum(kv_len, q_last + 1) if st.causal else kv_len
    hi = lax.div(jnp.maximum(end, 0) + (block_k - 1), block_k)
    lo = jnp.int32(0)
    if st.window is not None:
        lo = lax.div(jnp.maximum(q_first - st.window + 1, 0), block_k)
    return lo, jnp.maximum(lo, hi)


def dot(a, b, *, trans_a=False, trans_b=False):
    """a @ b with float32 accumulation; transposes are folded into the contraction."""
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def compiler_params(num_warps: int = 4, num_stages: int = 2):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pad_axis(x, axis: int, n: int):
    if x.shape[axis] == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pad)


def pad_inputs(q, k, v, q_seg, kv_seg, st: StaticArgs):
    """Pad T, S, D up to block multiples (zeros; padded keys are masked through kv_len <= S)."""
    q = pad_axis(pad_axis(q, 1, st.T_pad), 3, st.D_pad)
    k = pad_axis(pad_axis(k, 1, st.S_pad), 3, st.D_pad)
    v = pad_axis(pad_axis(v, 1, st.S_pad), 3, st.D_pad)
    if q_seg is not None:
        q_seg, kv_seg = pad_axis(q_seg, 1, st.T_pad), pad_axis(kv_seg, 1, st.S_pad)
    return q, k, v, q_seg, kv_seg
