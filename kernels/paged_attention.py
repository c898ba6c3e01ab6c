"""Paged decode attention returning unnormalised partials `(o, l, m)`.

One query token per sequence attends to that sequence's keys, which live in fixed-size pages of a
shared pool (one layer's K and V) and are located through a page table:

  q           [B, H, D]                      one decode token per sequence
  k_pages     [num_pages, K, page_size, D]   one layer's pool (v_pages likewise); H % K == 0 (GQA:
                                             query head h reads kv head h // (H // K)). Head-major
                                             inside a page: each kv head's slots are contiguous, so a
                                             page is K separate [page_size, D] blocks (as in jax's TPU
                                             paged attention) and a gathered sequence is contiguous per
                                             kv head
  page_table  [B, max_pages] int32           page ids of each sequence, in order; entries past the
                                             sequence's last page may be any valid id (e.g. 0)
  lengths     [B] int32                      valid keys per sequence, 0 <= lengths <= max_pages * page_size
  window      int or None (static)           sliding window W: only keys j >= lengths - W are visible (the
                                             query sits at position lengths - 1; HF semantics q - j < W)

Key j of sequence b, kv head k, is `k_pages[page_table[b, j // page_size], k, j % page_size]`; keys j >= lengths[b]
are masked (they may hold any finite values: stale entries, other sequences' data). The fast paths
cast q to the pages' dtype for the matmuls and accumulate in float32; probabilities are cast to the
pages' dtype before the product with V (as flash kernels do); the reference stays in float32.

The (o, l, m) contract. With scaled scores s_j = scale * q . k_j over the valid keys j, all float32:
  m [B, H]     = max_j s_j                     (_MASK_VALUE, a finite -inf stand-in, when no key is valid)
  l [B, H]     = sum_j exp(s_j - m)            (0 when no key is valid)
  o [B, H, D]  = sum_j exp(s_j - m) * v_j      (0 when no key is valid)
so `normalize(o, l)` is softmax attention. Partials over disjoint key sets (split-K, different page
subsets such as shared prompt pages and per-sample pages) combine exactly with `merge_partials`;
head-sharded partials concatenate along H.

Implementations (`implementation=`):
  "xla"     gathers the batch's pages into [B, K, max_pages * page_size, D] and computes the partials
            with one batched matrix-vector product per query head of a group (float32 accumulation);
            XLA:CPU runs those far faster than a [group, D] x [D, S] batched matmul.
  "pallas"  a Pallas kernel modelled on jax's GPU paged attention: grid (batch, kv_head, k_split); each
            program loops over its pages `pages_per_compute_block` at a time with an online softmax and
            stops at the sequence's last valid page; the k_splits partials are merged in XLA. It is
            written for the Triton lowering (tile dims padded/validated as Triton needs: the query-head
            group is padded to >= 16 rows; the pages per compute block are rounded up so that
            page_size * pages_per_compute_block is a power of two >= 16, the table padded to match
            (`triton_block_sizes`); page_size and head_dim must be powers of two). In this repository it
            has run with `interpret=True` on the CPU (`interpret=None` picks that on the CPU backend)
            and is lowered for CUDA in CI over every decode bucket (tests/test_cuda_export.py), but not
            yet compiled by Triton nor run on a GPU. Outside interpret mode it refuses to run on non-GPU
            backends rather than silently falling back.
  `paged_decode_attention_reference` is the plain-jnp oracle (float32 throughout, repeated kv heads).

Dropped on purpose: no VJP (decode only; training uses `kernels.attention`), no logit soft-capping,
no quantised (scaled int8/fp8) pages. With a window, the Pallas kernel skips the compute blocks wholly
before it; the XLA path masks (its gather covers the table's width either way).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.attention_common import cpu_upcast

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_MIN_BLOCK_H = 16  # Triton's dot wants at least 16 rows: the query-head group is padded up to this.


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the Pallas kernel.

    pages_per_compute_block: pages loaded and scored per online-softmax step (block_k = this * page_size).
    k_splits: the page table is cut into this many contiguous parts, each a separate grid program whose
      partials are merged afterwards (more parallelism for long sequences at small batch).
    """

    pages_per_compute_block: int = 8
    k_splits: int = 1

    def __post_init__(self):
        if self.pages_per_compute_block < 1 or self.k_splits < 1:
            raise ValueError(f"BlockSizes fields must be >= 1, got {self}")


# ----------------------------------------------------------------------------------------- combining

def merge_partials(o1, l1, m1, o2, l2, m2):
    """Exact combination of two partial results over disjoint key sets (any leading dims).

    m = max(m1, m2); l = l1 e^(m1-m) + l2 e^(m2-m); o = o1 e^(m1-m) + o2 e^(m2-m). Empty partials
    (l = 0, m = _MASK_VALUE) are neutral: their o and l are zero, and every exponent stays finite.
    """
    m = jnp.maximum(m1, m2)
    a1, a2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    return a1[..., None] * o1 + a2[..., None] * o2, a1 * l1 + a2 * l2, m


def _merge_axis(o, l, m, axis: int):
    """merge_partials folded over `axis` of stacked partials (o has one more trailing dim)."""
    m_all = jnp.max(m, axis=axis)
    a = jnp.exp(m - jnp.expand_dims(m_all, axis))
    return jnp.sum(a[..., None] * o, axis=axis), jnp.sum(a * l, axis=axis), m_all


def normalize(o, l, *, dtype=jnp.float32):
    """Attention output o / l from partials; rows with l == 0 (no valid key) give zeros. Cast to `dtype`."""
    safe = jnp.where(l > 0, l, 1.0)
    return jnp.where((l > 0)[..., None], o / safe[..., None], 0.0).astype(dtype)


# ------------------------------------------------------------------------------------------ checking

def _check_inputs(q, k_pages, v_pages, page_table, lengths):
    shapes = (f"q{tuple(q.shape)} k_pages{tuple(k_pages.shape)} v_pages{tuple(v_pages.shape)} "
              f"page_table{tuple(page_table.shape)} lengths{tuple(lengths.shape)}")
    if q.ndim != 3 or k_pages.ndim != 4 or page_table.ndim != 2 or lengths.ndim != 1:
        raise ValueError("paged_decode_attention wants q [B,H,D], k_pages/v_pages [num_pages,K,page_size,D], "
                         f"page_table [B,max_pages], lengths [B]; got {shapes}")
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages must match in shape and dtype; got {shapes} "
                         f"({k_pages.dtype} vs {v_pages.dtype})")
    B, H, D = q.shape
    if k_pages.shape[3] != D:
        raise ValueError(f"head_dim of q ({D}) differs from the pages' ({k_pages.shape[3]}): {shapes}")
    if H % k_pages.shape[1]:
        raise ValueError(f"query heads {H} not a multiple of kv heads {k_pages.shape[1]}: {shapes}")
    if page_table.shape[1] == 0 or k_pages.shape[0] == 0:
        raise ValueError(f"need at least one page in the pool and in the page table: {shapes}")
    if page_table.shape[0] != B or lengths.shape[0] != B:
        raise ValueError(f"page_table and lengths must have batch size {B}: {shapes}")
    if page_table.dtype != jnp.int32 or lengths.dtype != jnp.int32:
        raise ValueError(f"page_table and lengths must be int32; got {page_table.dtype}, {lengths.dtype}")


def _scale(scale, D):
    return D ** -0.5 if scale is None else float(scale)


# ----------------------------------------------------------------------------------------- reference

def _visible(S: int, lengths, window):
    """[B, 1, S] mask of the keys each sequence's decode query sees."""
    j = jnp.arange(S)[None, :]
    valid = j < lengths[:, None]
    if window is not None:
        valid &= j >= lengths[:, None] - window
    return valid[:, None, :]


def paged_decode_attention_reference(q, k_pages, v_pages, page_table, lengths, *, scale=None, window=None):
    """Oracle: gather each sequence's keys, repeat kv heads to H, float32 softmax partials."""
    _check_inputs(q, k_pages, v_pages, page_table, lengths)
    B, H, D = q.shape
    _, K, page_size, _ = k_pages.shape
    S = page_table.shape[1] * page_size
    k = k_pages[page_table].transpose(0, 1, 3, 2, 4).reshape(B, S, K, D).astype(jnp.float32)
    v = v_pages[page_table].transpose(0, 1, 3, 2, 4).reshape(B, S, K, D).astype(jnp.float32)
    k, v = jnp.repeat(k, H // K, axis=2), jnp.repeat(v, H // K, axis=2)  # [B, S, H, D]
    s = jnp.einsum("bhd,bshd->bhs", q.astype(jnp.float32), k, precision="highest") * _scale(scale, D)
    valid = _visible(S, lengths, window)  # [B, 1, S]
    m = jnp.max(jnp.where(valid, s, _MASK_VALUE), axis=-1)
    p = jnp.where(valid, jnp.exp(s - m[..., None]), 0.0)
    return jnp.einsum("bhs,bshd->bhd", p, v, precision="highest"), jnp.sum(p, axis=-1), m


# --------------------------------------------------------------------------------------------- XLA

def gather_pages(pages, page_table):
    """One layer's pool [num_pages, K, page_size, D] -> each sequence's keys [B, K, max_pages * page_size, D]."""
    B, MP = page_table.shape
    _, K, page_size, D = pages.shape
    return pages[page_table].swapaxes(1, 2).reshape(B, K, MP * page_size, D)


def group_partials(q, k, v, valid, scale):
    """Partials of q [N, K, G, D] against keys k, v [N, K, S, D] where `valid` [N, 1, S] (or broadcastable).

    One batched matrix-vector product per query head of the group (G of them) instead of one
    [G, D] x [D, S] batched matmul: on XLA:CPU the former is several times faster at decode shapes.
    Returns o [N, K, G, D], l [N, K, G], m [N, K, G] in float32.
    """
    qs = q.astype(k.dtype)
    os_, ls, ms = [], [], []
    for g in range(q.shape[2]):
        s = jnp.einsum("nkd,nksd->nks", *cpu_upcast(qs[:, :, g], k), preferred_element_type=jnp.float32) * scale
        m = jnp.max(jnp.where(valid, s, _MASK_VALUE), axis=-1)
        p = jnp.where(valid, jnp.exp(s - m[..., None]), 0.0)
        os_.append(jnp.einsum("nks,nksd->nkd", *cpu_upcast(p.astype(v.dtype), v), preferred_element_type=jnp.float32))
        ls.append(jnp.sum(p, axis=-1))
        ms.append(m)
    return jnp.stack(os_, 2), jnp.stack(ls, 2), jnp.stack(ms, 2)


def _xla_partials(q, k_pages, v_pages, page_table, lengths, scale, window):
    B, H, D = q.shape
    K = k_pages.shape[1]
    k, v = gather_pages(k_pages, page_table), gather_pages(v_pages, page_table)
    valid = _visible(k.shape[2], lengths, window)  # [B, 1, S]
    o, l, m = group_partials(q.reshape(B, K, H // K, D), k, v, valid, scale)
    return o.reshape(B, H, D), l.reshape(B, H), m.reshape(B, H)


# ------------------------------------------------------------------------------------------ Pallas

def _paged_decode_kernel(q_ref, k_pages_ref, v_pages_ref, table_ref, length_ref, o_ref, l_ref, m_ref, *,
                         scale: float, pages_per_compute_block: int, window: int | None):
    """One (sequence, kv head, key split): q_ref [block_h, D]; *_pages_ref [num_pages, page_size, D]
    (this kv head's view of the pool); table_ref [pages_per_split]; length_ref scalar."""
    block_h, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    pages_per_split = table_ref.shape[0]
    block_k = pages_per_compute_block * page_size
    split_first_page = pl.program_id(2) * pages_per_split
    length = length_ref[()]

    # Pages of this split that hold at least one valid key; the loop skips the rest entirely.
    valid_pages = jnp.clip(pl.cdiv(length, page_size) - split_first_page, 0, pages_per_split)
    num_steps = pl.cdiv(valid_pages, pages_per_compute_block)
    first_step = 0
    if window is not None:   # compute blocks wholly before the window are skipped too
        first_page = jnp.clip(lax.div(jnp.maximum(length - window, 0), page_size) - split_first_page, 0,
                              pages_per_split)
        first_step = jnp.minimum(lax.div(first_page, pages_per_compute_block), num_steps)
    q = q_ref[...]

    def body(step, carry):
        o_prev, l_prev, m_prev = carry
        pages = table_ref[pl.ds(step * pages_per_compute_block, pages_per_compute_block)]
        k = k_pages_ref[pages].reshape(block_k, head_dim)
        v = v_pages_ref[pages].reshape(block_k, head_dim)
        s = plgpu.dot(q.astype(k.dtype), k, trans_b=True) * scale  # [block_h, block_k] float32
        first_key = (split_first_page + step * pages_per_compute_block) * page_size
        key = first_key + jnp.arange(block_k)
        valid = key < length
        if window is not None:
            valid &= key >= length - window
        valid = valid[None, :]
        m_next = jnp.maximum(m_prev, jnp.max(jnp.where(valid, s, _MASK_VALUE), axis=-1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.where(valid, jnp.exp(s - m_next[:, None]), 0.0)
        o_next = correction[:, None] * o_prev + plgpu.dot(p.astype(v.dtype), v)
        return o_next, correction * l_prev + jnp.sum(p, axis=-1), m_next

    init = (jnp.zeros((block_h, head_dim), jnp.float32), jnp.zeros((block_h,), jnp.float32),
            jnp.full((block_h,), _MASK_VALUE, jnp.float32))
    o, l, m = lax.fori_loop(first_step, num_steps, body, init)
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


def _round_up(x: int, n: int) -> int:
    return -(-x // n) * n


def _is_pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def _pages_per_block(block_sizes: BlockSizes, max_pages: int) -> int:
    """`pages_per_compute_block` clipped to the pages of one split, rounded up to a power of two (a table of 5
    pages with the default 8 runs one block of 8, its last 3 slots padding)."""
    return min(block_sizes.pages_per_compute_block, pl.next_power_of_2(pl.cdiv(max_pages, block_sizes.k_splits)))


def triton_block_sizes(block_sizes: BlockSizes, page_size: int, max_pages: int) -> BlockSizes:
    """The tiling the kernel is lowered for Triton with, for a page table `max_pages` wide.

    Triton's tiles are powers of two and its dot takes at least 16 keys, so the pages per compute block
    (`_pages_per_block`) are rounded up to a power of two and to at least 16 // page_size; the wrapper pads
    the table with page 0 to whole compute blocks (slots past `lengths`: masked). So a table of 3, 5, 6 or
    7 pages (`ShapeBuckets` makes them: a max_seq_len of at most 8 pages, or max_pages / 2^i) runs one
    block of 4 or 8 pages instead of being refused. Interpret mode takes `block_sizes` as given (tiny
    tiles, several online-softmax steps in the CPU tests); passing it this function's result runs the
    Triton tiling there too (whenever the table is at least 16 keys wide). `page_size` itself must be a
    power of two: the pool is not copied to pad it."""
    if not _is_pow2(page_size):
        raise ValueError(f"Triton tiles need page_size to be a power of two, got {page_size} "
                         "(use a power-of-two engine.page_size, or implementation='xla')")
    ppcb = max(pl.next_power_of_2(_pages_per_block(block_sizes, max_pages)), pl.cdiv(16, page_size))
    return dataclasses.replace(block_sizes, pages_per_compute_block=ppcb)


def _pallas_partials(q, k_pages, v_pages, page_table, lengths, scale, block_sizes: BlockSizes,
                     interpret: bool, window: int | None = None):
    B, H, D = q.shape
    num_pages, K, page_size, _ = k_pages.shape
    G = H // K
    block_h = max(_MIN_BLOCK_H, pl.next_power_of_2(G))
    if not interpret:
        if jax.default_backend() != "gpu":
            raise NotImplementedError(f"the Pallas paged decode kernel targets GPU (Triton); backend is "
                                      f"{jax.default_backend()!r}: use implementation='xla' or "
                                      "interpret=True")
        if D < 16 or not _is_pow2(D):
            raise ValueError(f"Triton tiles need head_dim to be a power of two >= 16, got {D} "
                             f"(q{tuple(q.shape)}); use implementation='xla'")
        block_sizes = triton_block_sizes(block_sizes, page_size, page_table.shape[1])
        ppcb = block_sizes.pages_per_compute_block
    else:
        ppcb = _pages_per_block(block_sizes, page_table.shape[1])
    k_splits = block_sizes.k_splits

    # Pad the page table (with page 0; masked by `lengths`) so it splits into whole compute blocks.
    pages_per_split = _round_up(pl.cdiv(page_table.shape[1], k_splits), ppcb)
    table = jnp.pad(page_table, ((0, 0), (0, k_splits * pages_per_split - page_table.shape[1])))
    table = table.reshape(B, k_splits, pages_per_split)
    qg = jnp.pad(q.reshape(B, K, G, D), ((0, 0), (0, 0), (0, block_h - G), (0, 0)))

    kernel = functools.partial(_paged_decode_kernel, scale=scale, pages_per_compute_block=ppcb, window=window)
    pool_spec = pl.BlockSpec((num_pages, None, page_size, D), lambda b, h, s: (0, h, 0, 0))
    o, l, m = pl.pallas_call(
        kernel,
        grid=(B, K, k_splits),
        in_specs=[
            pl.BlockSpec((None, None, block_h, D), lambda b, h, s: (b, h, 0, 0)),  # q
            pool_spec,  # k_pages: all pages, one kv head
            pool_spec,  # v_pages
            pl.BlockSpec((None, None, pages_per_split), lambda b, h, s: (b, s, 0)),  # page table
            pl.BlockSpec((None,), lambda b, h, s: (b,)),  # length
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_h, D), lambda b, h, s: (s, b, h, 0, 0)),  # o
            pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (s, b, h, 0)),  # l
            pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (s, b, h, 0)),  # m
        ],
        out_shape=[
            jax.ShapeDtypeStruct((k_splits, B, K, block_h, D), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, B, K, block_h), jnp.float32),
            jax.ShapeDtypeStruct((k_splits, B, K, block_h), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=f"paged_decode_attention_ppcb{ppcb}_ks{k_splits}",
    )(qg, k_pages, v_pages, table, lengths)

    o, l, m = _merge_axis(o[..., :G, :], l[..., :G], m[..., :G], axis=0)
    return o.reshape(B, H, D), l.reshape(B, H), m.reshape(B, H)


# --------------------------------------------------------------------------------------- entry point

@functools.partial(jax.jit, static_argnames=("scale", "implementation", "interpret", "block_sizes", "window"))
def paged_decode_attention(q, k_pages, v_pages, page_table, lengths, *, scale=None, implementation="xla",
                           interpret=None, block_sizes=None, window=None):
    """Unnormalised float32 partials (o [B,H,D], l [B,H], m [B,H]) of paged decode attention.

    See the module docstring for shapes and the (o, l, m) contract. `implementation` is "xla" (CPU
    runtime default) or "pallas"; `interpret` (Pallas only) defaults to True on the CPU backend;
    `block_sizes` (Pallas only) is a `BlockSizes`, default `BlockSizes()`. `window`: sliding window W
    (keys j >= lengths - W only), None for full attention.
    """
    _check_inputs(q, k_pages, v_pages, page_table, lengths)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None; got {window!r}")
    scale = _scale(scale, q.shape[-1])
    if implementation == "xla":
        return _xla_partials(q, k_pages, v_pages, page_table, lengths, scale, window)
    if implementation == "pallas":
        if interpret is None:
            interpret = jax.default_backend() == "cpu"
        return _pallas_partials(q, k_pages, v_pages, page_table, lengths, scale,
                                block_sizes or BlockSizes(), interpret, window)
    raise ValueError(f"implementation must be 'xla' or 'pallas', got {implementation!r}")
