"""The paged decode kernel's test cases (`tests/test_paged_attention.py`, `scripts/gpu_check_kernels.py`):
tolerances per dtype, the interpret-mode tiling and a case scattered into a shuffled page pool whose unused
pages and past-the-end positions hold large garbage."""

import jax.numpy as jnp
import numpy as np

from kernels.paged_attention import BlockSizes

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
