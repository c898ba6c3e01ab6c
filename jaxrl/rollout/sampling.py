"""Sampling parameters and the on-device sampler.

Randomness is per request: the key for a request's t-th new token is `fold_in(key(seed), t)`, so the
same seed gives the same tokens whatever else shares the batch, the bucket or the instance.

The returned log-prob is that of the sampled token under the temperature-scaled distribution
*before* top-k/top-p truncation (log_softmax(logits / T); T=1 for greedy), which is what a
teacher-forced forward computes, so RL importance ratios start at 1.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .params import SamplingParams


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["temperature", "top_k", "top_p", "seed", "step"], meta_fields=["truncate"])
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling inputs of one compiled step (all [B]).

    `truncate` (static: part of the compiled step's cache key) says whether any sampled row asks for
    top-k/top-p; only then is the threshold search compiled in (an untaken `lax.cond` branch holding
    a sort made every XLA:CPU step ~8 ms slower at [64, 32000]).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    step: jax.Array  # index of the token being sampled within its request
    truncate: bool = False

    @staticmethod
    def build(rows: list[tuple[SamplingParams, int, int]], bucket: int) -> "SamplingBatch":
        """rows: (params, seed, step) per real row; padded to `bucket` with greedy rows."""
        pad = bucket - len(rows)
        col = lambda f, dt, fill: np.array([f(r) for r in rows] + [fill] * pad, dt)
        truncate = any(r[0].temperature > 0 and (r[0].top_k > 0 or r[0].top_p < 1) for r in rows)
        return SamplingBatch(temperature=col(lambda r: r[0].temperature, np.float32, 0.0),
                             top_k=col(lambda r: r[0].top_k, np.int32, 0), top_p=col(lambda r: r[0].top_p, np.float32, 1.0),
                             seed=col(lambda r: r[1], np.uint32, 0), step=col(lambda r: r[2], np.int32, 0),
                             truncate=truncate)


def _ordered(x):
    """float32 -> int32 with the same order (negative floats' magnitude bits flipped)."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(i < 0, i ^ 0x7FFFFFFF, i)


def _mid(lo, hi):
    """floor((lo + hi) / 2) without int32 overflow."""
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


def truncation_threshold(scaled, probs, top_k, top_p, iters: int = 33):
    """Per-row threshold [B, 1] on `_ordered(scaled)`: a token is kept iff its key is >= the threshold.

    Top-k keeps the k largest logits (the k-th largest value and its ties); top-p keeps every token whose
    strictly-larger tokens hold less than p of the mass (the smallest prefix of the sorted
    distribution reaching p, with ties at the boundary kept together). Both thresholds come from a
    bisection over the 32-bit ordered keys, `iters` passes of two reductions over [B, V] instead of a
    sort (a sort of [64, 32000] took ~370 ms on the 2-core CPU). Rows with k = 0 / p >= 1 keep all.
    """
    key = _ordered(scaled)
    k = top_k[:, None]
    p = top_p[:, None]
    lo_k, hi_k = jnp.min(key, -1, keepdims=True), jnp.max(key, -1, keepdims=True)
    lo_p, hi_p = lo_k - 1, hi_k                     # invariant: mass(> lo_p) >= p > mass(> hi_p)

    def body(_, c):
        lo_k, hi_k, lo_p, hi_p = c
        mid = _mid(lo_k, hi_k) + ((lo_k ^ hi_k) & 1)      # ceil: find the largest t with count(>= t) >= k
        ok = jnp.sum(key >= mid, -1, keepdims=True) >= k
        lo_k, hi_k = jnp.where(ok, mid, lo_k), jnp.where(ok, hi_k, mid - 1)
        mid = _mid(lo_p, hi_p)                            # find the smallest t with mass(> t) < p
        below = jnp.sum(jnp.where(key > mid, probs, 0.0), -1, keepdims=True) < p
        return lo_k, hi_k, jnp.where(below, lo_p, mid), jnp.where(below, mid, hi_p)

    lo_k, _, _, hi_p = jax.lax.fori_loop(0, iters, body, (lo_k, hi_k, lo_p, hi_p))
    none = jnp.iinfo(jnp.int32).min
    return jnp.maximum(jnp.where(k > 0, lo_k, none), jnp.where(p < 1, hi_p, none))


def _argmax(x):
    """First index of each row's maximum, as two plain reductions (XLA:CPU's variadic argmax reduce is
    ~30x slower at [64, 32000]); NaN rows give the last index."""
    V = x.shape[-1]
    hit = x == jnp.max(x, axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(hit, jnp.arange(V, dtype=jnp.int32), V), axis=-1), V - 1)


def _last_positive(w):
    return jnp.max(jnp.where(w > 0, jnp.arange(w.shape[-1], dtype=jnp.int32), 0), axis=-1)


def inverse_cdf(weights, u, block: int = 128):
    """Index drawn in proportion to nonnegative `weights` [B, V] given uniforms u [B] in [0, 1).

    Two levels (block sums, then one block) so the cumulative sums stay short; the result is the first
    index whose running sum exceeds u * total, and never an index of zero weight (rounding guards).
    """
    B, V = weights.shape
    w = jnp.pad(weights, ((0, 0), (0, (-V) % block))).reshape(B, -1, block)
    bsum = jnp.sum(w, axis=-1)                                       # [B, blocks]
    bcdf = jnp.cumsum(bsum, axis=-1)
    target = u * bcdf[:, -1]
    blk = jnp.minimum(jnp.sum(bcdf <= target[:, None], axis=-1), _last_positive(bsum))
    before = jnp.take_along_axis(bcdf - bsum, blk[:, None], axis=-1)[:, 0]
    row = jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0]   # [B, block]
    idx = jnp.sum(jnp.cumsum(row, axis=-1) <= (target - before)[:, None], axis=-1)
    return (blk * block + jnp.minimum(idx, _last_positive(row))).astype(jnp.int32)


def sample(logits: jax.Array, s: SamplingBatch) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] float32 -> (tokens [B] int32, log-probs [B] float32).

    Sampled rows draw by inverse CDF with one uniform per row (from the request's key), an exact draw
    from softmax(logits / T) restricted to top-k/top-p, up to float32 rounding of the running sums.
    It replaced a Gumbel-max draw that needed [B, V] random numbers per step (4x the cost of the
    whole step's lm-head on the CPU).
    """
    greedy = s.temperature <= 0
    t = jnp.where(greedy, 1.0, s.temperature)
    scaled = logits / t[:, None]
    m = jnp.max(scaled, axis=-1, keepdims=True)
    # exp(d) for d < -80 would be a float32 denormal (or zero): denormal arithmetic is several times
    # slower on CPUs, and logits spread over > 80 nats are common. Those tokens get exactly zero weight.
    d = scaled - m
    e = jnp.where(d < -80.0, 0.0, jnp.exp(jnp.maximum(d, -80.0)))
    lse = m[:, 0] + jnp.log(jnp.sum(e, axis=-1))
    if s.truncate:
        thr = truncation_threshold(scaled, e / jnp.sum(e, axis=-1, keepdims=True), s.top_k, s.top_p)
        weights = jnp.where(_ordered(scaled) < thr, 0.0, e)
    else:
        weights = e
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(s.seed, s.step)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    tok = jnp.where(greedy, _argmax(logits), inverse_cdf(weights, u)).astype(jnp.int32)
    return tok, jnp.take_along_axis(scaled, tok[:, None], axis=-1)[:, 0] - lse
