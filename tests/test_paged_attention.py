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

from kernels.testing.paged_cases import (HEAD_DIM, IMPLS, KV_HEADS, MAX_PAGES, PALLAS_BLOCKS, TOL,  # noqa: F401
                                        _lengths, make_case)     # (shared with scripts/)


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


def test_triton_tiles_are_powers_of_two_for_every_width():
    """Issue 73: Triton wants page_size x pages_per_compute_block a power of two >= 16. For every page-table
    width `ShapeBuckets` can make (1-8 kept as they are, then up to 64) and every power-of-two page size,
    `triton_block_sizes` gives such a block, never more pages than the split rounded up to a power of two
    (or one Triton block); a page size that is not a power of two is refused, naming it."""
    from kernels.paged_attention import triton_block_sizes

    for page_size in (1, 2, 4, 8, 16, 32):
        for width in range(1, 65):
            for bs in (BlockSizes(), BlockSizes(1, 1), BlockSizes(3, 2), BlockSizes(8, 3)):
                ppcb = triton_block_sizes(bs, page_size, width).pages_per_compute_block
                block = ppcb * page_size
                assert block >= 16 and block & (block - 1) == 0, (page_size, width, bs, ppcb)
                split = -(-width // bs.k_splits)
                assert ppcb <= max(1 << (split - 1).bit_length(), -(-16 // page_size)), (page_size, width, bs)
    assert triton_block_sizes(BlockSizes(), 16, 64).pages_per_compute_block == 8     # the default is kept
    assert triton_block_sizes(BlockSizes(), 16, 5).pages_per_compute_block == 8      # 5 pages: one block of 8
    with pytest.raises(ValueError, match="page_size to be a power of two, got 12"):
        triton_block_sizes(BlockSizes(), 12, 8)


@pytest.mark.parametrize("width", [3, 5, 6, 7])
def test_triton_tiling_matches_reference_in_interpret_mode(width):
    """The tiles the GPU lowering takes for the widths it used to refuse (16-token pages, SmolLM2's 3 query heads
    per kv head), run in interpret mode on a garbage-filled pool: the padded table's page-0 slots stay masked."""
    from kernels.paged_attention import triton_block_sizes

    rng = np.random.default_rng(width)
    page_size, K, ratio, D = 16, 2, 3, 16
    lengths = np.array([0, 1, page_size + 3, width * page_size, width * page_size - 5], np.int32)
    B = len(lengths)
    num_pages = B * width + 2
    k_pages = rng.normal(size=(num_pages, K, page_size, D)) * 3
    v_pages = rng.normal(size=(num_pages, K, page_size, D)) * 3
    k_pages[0], v_pages[0] = 40.0, 1e3                      # page 0: what the padded table slots point at
    table = rng.permutation(np.arange(1, num_pages))[:B * width].reshape(B, width).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(B, K * ratio, D)), jnp.float32)
    args = (q, jnp.asarray(k_pages, jnp.float32), jnp.asarray(v_pages, jnp.float32), jnp.asarray(table),
            jnp.asarray(lengths))
    bs = triton_block_sizes(BlockSizes(), page_size, width)
    assert bs.pages_per_compute_block > width            # the table is padded up to one Triton block
    got = paged_decode_attention(*args, implementation="pallas", interpret=True, block_sizes=bs)
    assert_partials_close(got, paged_decode_attention_reference(*args), lengths, TOL[jnp.float32])
