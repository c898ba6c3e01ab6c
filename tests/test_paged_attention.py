"""Paged decode attention: XLA path and Pallas kernel (interpret mode on CPU) against the oracles.

Sequences are built contiguously, then scattered into a shuffled page pool whose unused pages and
past-the-end positions hold large garbage, so any masking or page-table mistake shows up.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels.attention import attention_reference
from kernels.paged_attention import (BlockSizes, merge_partials, normalize, paged_decode_attention,
                                     paged_decode_attention_reference)

# Set once per dtype (of q and the pages); never loosened to make a test pass.
TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
IMPLS = ("xla", "pallas")
# The grid runs the kernel with several online-softmax steps and two key splits per sequence.
PALLAS_BLOCKS = BlockSizes(pages_per_compute_block=1, k_splits=2)
KV_HEADS, HEAD_DIM, MAX_PAGES = 2, 16, 4


def _lengths(page_size):
    full = MAX_PAGES * page_size
    return [0, 1, page_size + 3, full, 2 * page_size, full - 1]  # empty, one key, ragged, full, page-aligned


def make_case(ratio, page_size, dtype=jnp.float32, seed=0):
    """Returns q, k_pages, v_pages, page_table, lengths, k, v (k, v contiguous [B, S, K, D])."""
    rng = np.random.default_rng(seed)
    lengths = np.array(_lengths(page_size), np.int32)
    B, S, K, D, H = len(lengths), MAX_PAGES * page_size, KV_HEADS, HEAD_DIM, KV_HEADS * ratio
    q = rng.normal(size=(B, H, D))
    k, v = rng.normal(size=(2, B, S, K, D))
    past_end = np.arange(S)[None, :] >= lengths[:, None]
    k[past_end], v[past_end] = 40.0, 1e3  # garbage a leak would expose
    num_pages = B * MAX_PAGES + 3
    k_pages = np.full((num_pages, K, page_size, D), 40.0)   # head-major pages
    v_pages = np.full((num_pages, K, page_size, D), -1e3)
    ids = rng.permutation(num_pages)
    table = np.zeros((B, MAX_PAGES), np.int32)
    for b in range(B):
        for p in range(MAX_PAGES):
            if p * page_size < lengths[b]:  # a page the sequence uses
                page = ids[b * MAX_PAGES + p]
                k_pages[page] = k[b, p * page_size:(p + 1) * page_size].swapaxes(0, 1)
                v_pages[page] = v[b, p * page_size:(p + 1) * page_size].swapaxes(0, 1)
            else:  # unused entry: page 0 (maybe another sequence's) or a garbage page
                page = 0 if b % 2 else ids[-1 - p % 3]
            table[b, p] = page
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (cast(q), cast(k_pages), cast(v_pages), jnp.asarray(table), jnp.asarray(lengths), cast(k), cast(v))


def run(impl, q, k_pages, v_pages, table, lengths, **kw):
    if impl == "pallas":
        kw.setdefault("block_sizes", PALLAS_BLOCKS)
    return paged_decode_attention(q, k_pages, v_pages, table, lengths, implementation=impl, **kw)


def assert_partials_close(got, want, lengths, tol):
    (o, l, m), (o_r, l_r, m_r) = got, want
    for x in (o, l, m):
        assert x.dtype == jnp.float32
    nonempty = np.asarray(lengths) > 0
    np.testing.assert_allclose(l, l_r, **tol)
    np.testing.assert_allclose(np.asarray(m)[nonempty], np.asarray(m_r)[nonempty], **tol)
    np.testing.assert_allclose(normalize(o, l), normalize(o_r, l_r), **tol)
    assert np.all(np.isfinite(m)) and np.all(np.asarray(m)[~nonempty] < -1e30)
    assert np.all(np.asarray(l)[~nonempty] == 0) and np.all(np.asarray(o)[~nonempty] == 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("page_size", [4, 8])
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_matches_reference_partials(impl, ratio, page_size):
    q, kp, vp, table, lengths, _, _ = make_case(ratio, page_size)
    got = run(impl, q, kp, vp, table, lengths)
    want = paged_decode_attention_reference(q, kp, vp, table, lengths)
    assert_partials_close(got, want, lengths, TOL[jnp.float32])
    np.testing.assert_allclose(got[0], want[0], **TOL[jnp.float32])  # unnormalised o itself


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("page_size", [4, 8])
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_normalized_equals_contiguous_attention(impl, ratio, page_size):
    q, kp, vp, table, lengths, k, v = make_case(ratio, page_size, seed=1)
    o, l, _ = run(impl, q, kp, vp, table, lengths)
    want = attention_reference(q[:, None], k, v, kv_lengths=lengths, causal=False)[:, 0]
    np.testing.assert_allclose(normalize(o, l), want, **TOL[jnp.float32])
    want_ref = normalize(*paged_decode_attention_reference(q, kp, vp, table, lengths)[:2])
    np.testing.assert_allclose(want_ref, want, **TOL[jnp.float32])  # the oracle agrees too


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("page_size", [4, 8])
@pytest.mark.parametrize("ratio", [1, 4])
def test_split_k_merge_is_exact(impl, ratio, page_size):
    q, kp, vp, table, lengths, _, _ = make_case(ratio, page_size, seed=2)
    half = MAX_PAGES // 2
    first = run(impl, q, kp, vp, table[:, :half], jnp.minimum(lengths, half * page_size))
    second = run(impl, q, kp, vp, table[:, half:], jnp.maximum(lengths - half * page_size, 0))
    full = run(impl, q, kp, vp, table, lengths)
    assert_partials_close(merge_partials(*first, *second), full, lengths, TOL[jnp.float32])
    assert_partials_close(merge_partials(*second, *first), full, lengths, TOL[jnp.float32])


@pytest.mark.parametrize("impl", IMPLS)
def test_head_sharding_concatenates(impl):
    q, kp, vp, table, lengths, _, _ = make_case(2, 4, seed=3)
    G = q.shape[1] // KV_HEADS
    shards = [run(impl, q[:, h * G:(h + 1) * G], kp[:, h:h + 1], vp[:, h:h + 1], table, lengths)
              for h in range(KV_HEADS)]
    got = tuple(jnp.concatenate(parts, axis=1) for parts in zip(*shards))
    assert_partials_close(got, run(impl, q, kp, vp, table, lengths), lengths, TOL[jnp.float32])


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_pages(impl):
    q, kp, vp, table, lengths, k, v = make_case(2, 8, dtype=jnp.bfloat16, seed=4)
    got = run(impl, q, kp, vp, table, lengths)
    assert_partials_close(got, paged_decode_attention_reference(q, kp, vp, table, lengths), lengths,
                          TOL[jnp.bfloat16])
    want = attention_reference(q[:, None], k, v, kv_lengths=lengths, causal=False)[:, 0]
    out = normalize(*got[:2], dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), want.astype(jnp.float32), **TOL[jnp.bfloat16])


@pytest.mark.parametrize("block_sizes",
                         [BlockSizes(), BlockSizes(1, 1), BlockSizes(2, 2), BlockSizes(3, 1), BlockSizes(1, 3)])
def test_pallas_block_sizes(block_sizes):
    """Compute blocks and key splits that do not divide max_pages exercise the page-table padding."""
    q, kp, vp, table, lengths, _, _ = make_case(4, 4, seed=5)
    got = run("pallas", q, kp, vp, table, lengths, block_sizes=block_sizes, interpret=True)
    want = paged_decode_attention_reference(q, kp, vp, table, lengths)
    assert_partials_close(got, want, lengths, TOL[jnp.float32])


def test_custom_scale():
    q, kp, vp, table, lengths, _, _ = make_case(2, 4, seed=6)
    want = paged_decode_attention_reference(q, kp, vp, table, lengths, scale=0.3)
    for impl in IMPLS:
        assert_partials_close(run(impl, q, kp, vp, table, lengths, scale=0.3), want, lengths, TOL[jnp.float32])


def test_merge_with_empty_partial_is_identity():
    q, kp, vp, table, lengths, _, _ = make_case(1, 4, seed=7)
    full = paged_decode_attention_reference(q, kp, vp, table, lengths)
    empty = paged_decode_attention_reference(q, kp, vp, table, jnp.zeros_like(lengths))
    assert_partials_close(merge_partials(*full, *empty), full, lengths, TOL[jnp.float32])
    both_empty = merge_partials(*empty, *empty)
    assert_partials_close(both_empty, empty, jnp.zeros_like(lengths), TOL[jnp.float32])


def test_shape_errors_name_the_shapes():
    q, kp, vp, table, lengths, _, _ = make_case(2, 4)
    with pytest.raises(ValueError, match=r"query heads 3 .*q\(6, 3, 16\)"):
        paged_decode_attention(q[:, :3], kp, vp, table, lengths)  # 3 heads over 2 kv heads
    with pytest.raises(ValueError, match=r"k_pages and v_pages"):
        paged_decode_attention(q, kp, vp[:, :, :2], table, lengths)
    with pytest.raises(ValueError, match=r"batch size 6"):
        paged_decode_attention(q, kp, vp, table[:5], lengths)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, kp, vp, table, lengths.astype(jnp.float32))
    with pytest.raises(ValueError, match="implementation"):
        paged_decode_attention(q, kp, vp, table, lengths, implementation="cuda")


def test_pallas_outside_interpret_refuses_cpu():
    q, kp, vp, table, lengths, _, _ = make_case(1, 4)
    with pytest.raises(NotImplementedError, match="interpret=True"):
        paged_decode_attention(q, kp, vp, table, lengths, implementation="pallas", interpret=False)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [1, 5, 9])
def test_sliding_window_matches_both_oracles(impl, window):
    """Keys j >= length - W only: against the paged oracle with the window and against contiguous
    attention (`attention_reference`, query at position length - 1, window W); the Pallas run skips the
    compute blocks before the window (one page per block here)."""
    q, kp, vp, table, lengths, k, v = make_case(2, 4)
    got = run(impl, q, kp, vp, table, lengths, window=window)
    want = paged_decode_attention_reference(q, kp, vp, table, lengths, window=window)
    assert_partials_close(got, want, lengths, TOL[jnp.float32])
    nonempty = np.asarray(lengths) > 0
    dense = attention_reference(q[:, None], k, v, q_offset=jnp.maximum(lengths - 1, 0), kv_lengths=lengths,
                                window=window)[:, 0]
    np.testing.assert_allclose(np.asarray(normalize(*got[:2]))[nonempty], np.asarray(dense)[nonempty],
                               **TOL[jnp.float32])
    full = normalize(*run(impl, q, kp, vp, table, lengths)[:2])
    assert np.abs(np.asarray(full) - np.asarray(normalize(*got[:2])))[np.asarray(lengths) > window].max() > 1e-3
