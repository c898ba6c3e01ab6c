"""A per-token loss of log-probs and entropy, summed, with its gradient computed in the forward pass.

    loss, logp, ent = token_loss_sum(hidden, w, targets, aux, per_token, temperature=1.0)

  hidden     [R, L, E]   final-normed hidden states (`models.forward(..., return_hidden=True)`)
  w          [E, V]      the output projection (`models.forward.lm_head(weights)`)
  targets    [R, L] int  token ids in [0, valid_vocab)
  aux        pytree of [R, L] float arrays: per-token constants of the loss (advantages, old and
             reference log-probs, weights, masks); they receive no gradient
  per_token  a static function (logp [n], ent [n], aux_chunk) -> [n] loss terms whose sum is the loss;
             it must be elementwise over tokens (token i's term depends on token i's inputs only),
             which holds for every loss in `jaxrl.algos` (clipped policy term, KL estimators, entropy
             bonus, NLL) once the aggregation is folded into per-token weights
  returns    loss (float32 scalar, differentiable in hidden and w), logp and ent [R, L] float32 (values
             only: no gradient flows through them; use `kernels.logprobs.token_logprobs` for that)

Why. `kernels.logprobs.token_logprobs` walks the vocabulary in chunks with an online logsumexp and
never holds a [tokens, vocab] tile larger than its chunk, but its backward must recompute every logit
tile (the per-token cotangents are only known once the loss is), so the lm_head costs 8·E·V·T FLOPs
per step instead of 6·E·V·T. Here the walk is over *tokens*: each chunk of n tokens gets its full
[n, V] logits, so its log-softmax, entropy, the loss terms and their derivatives g_l = ∂loss/∂logp and
g_h = ∂loss/∂H are all known at once, and the gradient is formed there (Liger-Kernel's fused linear
cross-entropy, generalised to the RL token losses):

    dz       = (g_l (onehot(t) − p) − g_h p (log p + H)) / temperature          [n, V]
    d_hidden = dz @ wᵀ          (rows of this chunk)
    d_w     += hiddenᵀ @ dz     (a float32 [E, V] accumulator over chunks)

Both are kept as residuals and scaled by the loss's cotangent in the backward (a scalar: the loss
is summed), so nothing is recomputed. Measured at the 58M shape (README "Throughput").

Memory: one chunk holds three [n, V] float32 tiles (logits, probabilities, dz) and the accumulators
d_hidden (the size of hidden, float32) and d_w ([E, V] float32, the size of the gradient itself).
`chunk_tokens` (default: as many tokens as fit 64 MiB of one tile, at least 16) bounds the tiles; the
chunks run along L (sequence positions) over all R rows, so a data-parallel split of the rows keeps
each device's chunk local.

Loss positions (`mask` [R, L], the positions whose terms can be nonzero: in RL the response tokens). Only
they need the projection, yet a packed row also holds prompts and padding. With several chunks, each row's
loss positions move to its front (a stable per-row argsort, so a data-parallel split of the rows stays
local), the chunk loop runs while a chunk still holds one (`ceil(max_r count_r / cols)` chunks, a dynamic
trip count: one executable whatever the batch), and logp/ent go back in place (0 outside `mask`); the
hidden-state gradient goes back through the inverse permutation (a gather, not a scatter). The lm_head
then costs 6·E·V·(cols·chunks run) instead of 6·E·V·L per row: at half response tokens, 1.9x faster
(hidden 512, vocabulary 32000, 8 x 1024 positions). One chunk (small vocabularies) keeps the plain path:
nothing to skip, and the same bits as before. Equal to the plain path within float32 rounding
(tests/test_logprob_loss.py, test_train_step.py on a sharded mesh).

Padded vocabulary (`valid_vocab` < V): the softmax runs over w's first valid_vocab columns; the padded
columns' d_w is exactly 0.

Simplified / left out: plain XLA (no Pallas kernel); the per-token function is traced once per chunk
shape (the whole chunks and one remainder); 16-bit w is upcast per chunk on the CPU (`cpu_upcast`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels.attention_common import cpu_upcast

TILE_BYTES = 64 << 20


def token_loss_sum(hidden, w, targets, aux, per_token, *, temperature: float = 1.0, valid_vocab: int | None = None,
                   chunk_tokens: int | None = None, mask=None):
    """Σ per_token(logp, ent, aux) over every token, differentiable in hidden and w (module docstring).
    `mask` [R, L]: the positions whose terms may be nonzero (the caller's per_token is zero elsewhere);
    with several chunks, only those positions go through the output projection (see "Loss positions")."""
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be [R, L, E] and targets [R, L]; got {hidden.shape}, {targets.shape}")
    if w.ndim != 2 or w.shape[0] != hidden.shape[2]:
        raise ValueError(f"w must be [E, V] with E = {hidden.shape[2]}; got {w.shape}")
    for x in jax.tree.leaves(aux):
        if x.shape != targets.shape:
            raise ValueError(f"every aux array must be [R, L] = {targets.shape}; got {x.shape}")
    if isinstance(temperature, jax.Array) or not temperature > 0:
        raise ValueError(f"temperature must be a static Python float > 0; got {temperature!r}")
    vv = w.shape[1] if valid_vocab is None else valid_vocab
    if isinstance(vv, bool) or not isinstance(vv, int) or not 1 <= vv <= w.shape[1]:
        raise ValueError(f"valid_vocab must be a static int in [1, {w.shape[1]}]; got {valid_vocab!r}")
    n = chunk_tokens if chunk_tokens is not None else max(16, TILE_BYTES // (4 * vv))
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"chunk_tokens must be a positive int; got {chunk_tokens!r}")
    cols = max(1, min(hidden.shape[1], n // hidden.shape[0]))        # positions per chunk, all rows
    if mask is not None and mask.shape != targets.shape:
        raise ValueError(f"mask must be [R, L] = {targets.shape}; got {mask.shape}")
    if mask is not None and hidden.shape[1] > cols:        # several chunks: skip those past every row's last position
        loss, logp, ent = _compacted(hidden, w, targets.astype(jnp.int32), aux, mask, per_token, float(temperature),
                                     vv, cols)
    else:
        loss, logp, ent = _fused(hidden, w, targets.astype(jnp.int32), aux, None, per_token, float(temperature), vv,
                                 cols)
    return loss, lax.stop_gradient(logp), lax.stop_gradient(ent)


def _valid_terms(logp, ent, aux, *, per_token):
    return per_token(logp, ent, aux["aux"]) * aux["valid"]


@jax.custom_vjp
def _gather_rows(x, order, inverse):
    """x [R, L, ...] -> x[r, order[r, j]] [R, Lp, ...]; `order`'s first L entries are a permutation of each row
    (`inverse` its inverse), the rest repeat a position whose cotangent is zero (the caller's contract)."""
    return jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)


def _gather_rows_fwd(x, order, inverse):
    return _gather_rows(x, order, inverse), (order, inverse)


def _gather_rows_bwd(res, ct):        # the transpose of a permutation is its inverse: a gather, not a scatter
    _, inverse = res
    ct = ct[:, :inverse.shape[1]]
    return jnp.take_along_axis(ct, inverse.reshape(inverse.shape + (1,) * (ct.ndim - 2)), axis=1), None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _compacted(hidden, w, targets, aux, mask, per_token, temperature, valid_vocab, cols):
    """`_fused` over each row's loss positions moved to its front (stable), the chunk loop stopped after the
    chunk that holds the longest row's last one; logp/ent back in place (0 outside `mask`)."""
    R, L, _ = hidden.shape
    chunks = -(-L // cols)
    keep = mask != 0
    order = jnp.argsort(jnp.logical_not(keep), axis=1, stable=True).astype(jnp.int32)
    inverse = jnp.argsort(order, axis=1).astype(jnp.int32)
    count = jnp.sum(keep, axis=1, dtype=jnp.int32)
    padded = jnp.pad(order, ((0, 0), (0, chunks * cols - L)))       # whole chunks; the extra entries are not valid
    take = lambda x: jnp.take_along_axis(x, padded, axis=1)  # noqa: E731
    valid = (jnp.arange(chunks * cols, dtype=jnp.int32)[None, :] < count[:, None]).astype(jnp.float32)
    trip = (jnp.max(count) + cols - 1) // cols
    loss, logp, ent = _fused(_gather_rows(hidden, padded, inverse), w, take(targets),
                             {"aux": jax.tree.map(take, aux), "valid": valid}, trip,
                             functools.partial(_valid_terms, per_token=per_token), temperature, valid_vocab, cols)
    back = lambda x: jnp.where(keep, jnp.take_along_axis(x[:, :L], inverse, axis=1), 0.0)  # noqa: E731
    return loss, back(logp), back(ent)


def _chunk(hidden, w_v, targets, aux, per_token, temperature: float):
    """One chunk [R, c]: (loss terms' sum, logp, ent, d_hidden [R, c, E] float32, d_w [E, Vv] float32)."""
    R, c, E = hidden.shape
    h = hidden.reshape(R * c, E)
    t = targets.reshape(-1)
    z = jnp.matmul(*cpu_upcast(h, w_v), preferred_element_type=jnp.float32)
    if temperature != 1.0:
        z = z / temperature
    m = jnp.max(z, axis=1, keepdims=True)
    e = jnp.exp(z - m)
    s = jnp.sum(e, axis=1, keepdims=True)
    lse = m + jnp.log(s)
    p = e / s
    hit = t[:, None] == jnp.arange(z.shape[1], dtype=jnp.int32)[None, :]
    z_t = jnp.sum(jnp.where(hit, z, 0.0), axis=1)
    logp = z_t - lse[:, 0]
    ent = lse[:, 0] - jnp.sum(p * z, axis=1)                  # -Σ p log p = lse - Σ p z
    aux_flat = jax.tree.map(lambda x: x.reshape(-1), aux)
    terms, vjp = jax.vjp(lambda lp, en: per_token(lp, en, aux_flat), logp, ent)
    g_l, g_h = vjp(jnp.ones_like(terms))
    dz = g_l[:, None] * (hit.astype(jnp.float32) - p) - g_h[:, None] * p * ((z - lse) + ent[:, None])
    if temperature != 1.0:
        dz = dz / temperature
    cdt = jnp.result_type(hidden.dtype, w_v.dtype)
    dz = dz.astype(cdt)
    d_h = jnp.matmul(*cpu_upcast(dz, w_v.T), preferred_element_type=jnp.float32)
    d_w = jnp.matmul(*cpu_upcast(h.T, dz), preferred_element_type=jnp.float32)
    return jnp.sum(terms), logp.reshape(R, c), ent.reshape(R, c), d_h.reshape(R, c, E), d_w


def _forward(hidden, w, targets, aux, trip, per_token, temperature, valid_vocab, cols):
    R, L, E = hidden.shape
    w_v = w if valid_vocab == w.shape[1] else w[:, :valid_vocab]
    step = functools.partial(_chunk, per_token=per_token, temperature=temperature)

    def cut(x, start, width):
        return lax.dynamic_slice_in_dim(x, start, width, axis=1)

    def body(start, width, carry):
        loss, logp, ent, d_h, d_w = carry
        l_c, lp, en, dh_c, dw_c = step(cut(hidden, start, width), w_v, cut(targets, start, width),
                                       jax.tree.map(lambda x: cut(x, start, width), aux))
        put = lambda acc, x: lax.dynamic_update_slice_in_dim(acc, x, start, axis=1)  # noqa: E731
        return loss + l_c, put(logp, lp), put(ent, en), put(d_h, dh_c), d_w + dw_c

    zeros = jnp.zeros((R, L), jnp.float32)
    carry = (jnp.float32(0), zeros, zeros, jnp.zeros((R, L, E), jnp.float32), jnp.zeros(w_v.shape, jnp.float32))
    n_full, rem = L // cols, L % cols
    if trip is not None:       # `_compacted`: whole chunks, only the first `trip` hold loss positions
        n_full, rem = trip, 0
    carry = lax.fori_loop(0, n_full, lambda i, c: body(i * cols, cols, c), carry)
    if rem:
        carry = body(n_full * cols, rem, carry)
    loss, logp, ent, d_h, d_w = carry
    if valid_vocab != w.shape[1]:
        d_w = jnp.pad(d_w, ((0, 0), (0, w.shape[1] - valid_vocab)))
    return (loss, logp, ent), (d_h.astype(hidden.dtype), d_w.astype(w.dtype), aux)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _fused(hidden, w, targets, aux, trip, per_token, temperature, valid_vocab, cols):
    return _forward(hidden, w, targets, aux, trip, per_token, temperature, valid_vocab, cols)[0]


def _backward(per_token, temperature, valid_vocab, cols, res, cts):
    d_h, d_w, aux = res
    g = cts[0]            # logp and ent leave through stop_gradient: their cotangents are zero
    return ((g * d_h).astype(d_h.dtype), (g * d_w).astype(d_w.dtype), None, jax.tree.map(jnp.zeros_like, aux), None)


_fused.defvjp(_forward, _backward)
