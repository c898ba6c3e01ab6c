"""Per-token log-probs and entropy from hidden states, by a chunked vocabulary projection.

    logp, ent = token_logprobs(hidden, w, targets, temperature=1.0, chunk_size=1024)

  hidden   [N, E] or [B, T, E]   final-normed hidden states (`models.forward(..., return_hidden=True)`)
  w        [E, V]                the output projection (`models.forward.lm_head(weights)`)
  targets  [N] or [B, T] int     token ids, 0 <= targets < valid_vocab (out-of-range ids give undefined
                                 values: they cannot be checked inside jit)
  valid_vocab  int <= V          the real vocabulary (default V): columns >= valid_vocab are the zero padding
                                 that lets V divide a tensor-parallel axis (`models.padded_vocab`); they are
                                 left out of the softmax and entropy, and their d_w is exactly 0
  returns  logp [N] / [B, T] float32   log softmax(hidden @ w / temperature)[target]
           ent  same shape, float32    -sum_v p_v log p_v of that distribution (None when
                                       `return_entropy=False`)

`token_logprobs_reference` is the naive oracle: full float32 logits [N, V], `jax.nn.log_softmax`, autodiff.

Padded vocabulary (`valid_vocab` < V). The chunk loops simply stop at `valid_vocab`: the chunks cover
[0, valid_vocab) exactly as they would for an unpadded w of that width (whole chunks, then one static
narrower remainder), so padded columns never enter the online max/sum, no tile is masked, no work is
spent on them, and the result equals the unpadded computation. The backward's d_w starts as zeros and only
the visited column blocks are written, so d_w of a padded column is exactly 0 (Adam then leaves those
columns at zero). Masking padded logits to a large negative value inside each tile would give the same
numbers for more work, and needs care where a temperature < 1 turns the mask into -inf (0 * -inf in the
entropy sum).

Why vocabulary chunks (and not token chunks). The forward walks the vocabulary `chunk_size` columns
at a time, keeping an online logsumexp per token (running max m, s = sum e^(z-m), and for the entropy
u = sum e^(z-m) (z-m), so H = log s - u/s and lse = m + log s), and picks the target's logit out of
the chunk that holds it. Working memory is then O(N * chunk_size) for one tile of logits plus O(N)
per-token state; the residuals for the backward are only lse [N] and H [N] (hidden and w are the
inputs themselves). The backward walks the same chunks, recomputes each tile of logits, and
  d_hidden  += d_logits_c @ w_c^T     one float32 [N, E] accumulator (the size of hidden itself)
  d_w[:, c]  = hidden^T @ d_logits_c  each column block written exactly once, in w's dtype
Token chunks would instead hold a [chunk, V] tile (at V = 151936 that is 0.6 GB of float32 per
1024 tokens) and would have to accumulate d_w across chunks in a float32 [E, V] buffer (another
0.6 GB at E = 1024 when w is bfloat16). With vocabulary chunks the tile is bounded by chunk_size,
the only large accumulator is [N, E] — the same order as the activations already in memory — and
nothing of size V is held beyond w and d_w themselves (except on the CPU with 16-bit weights: one
uint16 view of w, see `_get_cols_cpu`). At the sizes the architecture targets
(N of a few thousand per micro-batch, E ~ 1-4k) an [N, chunk] tile is small, so no second (token)
loop is needed; a micro-batch of very many tokens should be split by the caller.

Per-chunk gradient (z = logits / temperature, p = softmax(z), H = entropy, g_l, g_h the cotangents):
  dlogp_t/dz_j = onehot_j(t) - p_j
  dH/dz_j      = -p_j (log p_j + H)
  d_logits_j   = (g_l (onehot_j - p_j) - g_h p_j (log p_j + H)) / temperature
d_logits is cast to the matmul dtype (result type of hidden and w: bfloat16 stays bfloat16, as flash
attention casts dS) before the two backward matmuls, which accumulate in float32.

A vocabulary that is not a multiple of chunk_size: the whole chunks run in a `lax.fori_loop`
(`lax.dynamic_slice` of w), the remainder is one more call of the same step with a static,
narrower width — no padding of w (which would copy [E, V]) and no masked columns.

Simplified / left out (said, not pretended done): this is plain XLA (the chunk body is fused by the
compiler), not a Pallas kernel, so there is no `interpret` flag, and the one tile size is an int
rather than a `BlockSizes` dataclass. `temperature` is a static Python float (a traced temperature
would need another residual and cotangent). No vocabulary-parallel variant: with w sharded on the
vocab axis (tp), each chunk's `dynamic_slice` makes GSPMD gather it; a tp-aware version would reduce
(m, s, u, target logit) across the tp axis instead. No logit soft-capping, no z-loss, no
label smoothing. Targets are not range-checked (no checkify in the hot path). Memory has been
measured only with XLA's CPU compiler (`scripts/bench_logprobs.py`); GPU memory and speed are untested.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels.attention_common import cpu_upcast

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite "-inf" for the running max (0 * it stays 0)


# ----------------------------------------------------------------------------------------- reference

def token_logprobs_reference(hidden, w, targets, *, temperature: float = 1.0, valid_vocab: int | None = None):
    """The naive path: full float32 logits [N, V], log_softmax, gather. Returns (logp, entropy).
    `valid_vocab`: only the first valid_vocab columns of w are the vocabulary (see `token_logprobs`)."""
    hidden, targets, lead = _check(hidden, w, targets, temperature, 1)
    valid_vocab = _check_valid_vocab(valid_vocab, w)
    logits = jnp.matmul(*cpu_upcast(hidden, w[:, :valid_vocab]), preferred_element_type=jnp.float32) / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[:, None], axis=-1)[:, 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp.reshape(lead), entropy.reshape(lead)


# ----------------------------------------------------------------------------------------------- op

def token_logprobs(hidden, w, targets, *, temperature: float = 1.0, chunk_size: int = 1024,
                   return_entropy: bool = True, valid_vocab: int | None = None):
    """Per-token log-probs (and entropy) of `targets` under softmax(hidden @ w / temperature).

    Never materialises [N, V] logits, forward or backward (see the module docstring). Differentiable
    in `hidden` and `w` through a custom VJP that takes cotangents on both outputs. Returns
    (logp, entropy), entropy None when `return_entropy=False`; both float32, shaped like `targets`.
    `valid_vocab` (static int, default V): the softmax runs over w's first valid_vocab columns only; the
    rest (vocabulary padding) get exactly zero gradient.
    """
    hidden, targets, lead = _check(hidden, w, targets, temperature, chunk_size)
    valid_vocab = _check_valid_vocab(valid_vocab, w)
    chunk = min(int(chunk_size), valid_vocab)
    logp, ent = _logprobs(hidden, w, targets, float(temperature), chunk, bool(return_entropy), valid_vocab)
    return logp.reshape(lead), None if ent is None else ent.reshape(lead)


def _check(hidden, w, targets, temperature, chunk_size):
    """Validates shapes up front; returns hidden [N, E], targets [N] and the leading shape."""
    shapes = f"hidden {hidden.shape}, w {w.shape}, targets {targets.shape}"
    if hidden.ndim not in (2, 3):
        raise ValueError(f"hidden must be [N, E] or [B, T, E]; got {shapes}")
    if w.ndim != 2 or w.shape[0] != hidden.shape[-1]:
        raise ValueError(f"w must be [E, V] with E = hidden.shape[-1]; got {shapes}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have shape hidden.shape[:-1] = {hidden.shape[:-1]}; got {shapes}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids; got dtype {targets.dtype}")
    if not (jnp.issubdtype(hidden.dtype, jnp.floating) and jnp.issubdtype(w.dtype, jnp.floating)):
        raise ValueError(f"hidden and w must be floating; got {hidden.dtype}, {w.dtype}")
    if isinstance(temperature, jax.Array) or not temperature > 0:
        raise ValueError(f"temperature must be a static Python float > 0; got {temperature!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    lead = targets.shape
    return hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1).astype(jnp.int32), lead


def _check_valid_vocab(valid_vocab, w) -> int:
    """`valid_vocab` as an int in [1, V] (default V = w.shape[1])."""
    if valid_vocab is None:
        return int(w.shape[1])
    if isinstance(valid_vocab, (bool, jax.Array)) or not isinstance(valid_vocab, int) \
            or not 1 <= valid_vocab <= w.shape[1]:
        raise ValueError(f"valid_vocab must be a static int in [1, {w.shape[1]}] (w {w.shape}); got {valid_vocab!r}")
    return valid_vocab


def _chunks(vocab: int, chunk: int):
    """(number of whole chunks, start and width of the remainder chunk or None)."""
    n_full = vocab // chunk
    rem = vocab - n_full * chunk
    return n_full, (n_full * chunk, rem) if rem else None


def _get_cols(w, start, width: int):
    """w[:, start:start + width] for a traced start."""
    return lax.platform_dependent(w, start, cpu=functools.partial(_get_cols_cpu, width=width),
                                  default=lambda w, s: lax.dynamic_slice_in_dim(w, s, width, axis=1))


def _put_cols(d_w, cols, start):
    """d_w with columns [start, start + width) replaced by cols (in place inside the loop)."""
    return lax.platform_dependent(d_w, cols, start, cpu=_put_cols_cpu,
                                  default=lambda d, c, s: lax.dynamic_update_slice_in_dim(d, c, s, axis=1))


# XLA's CPU backend has no bfloat16/float16 dynamic-slice or dynamic-update-slice: it wraps them in
# converts to float32. Loop-invariant code motion then hoists one float32 copy of the whole of w out of
# the chunk loops ([E, V]: 0.6 GB at E = 1024, V = 151936), and every d_w update converts all of d_w
# to float32 and back (O(V^2 E / chunk) work). On the CPU the 16-bit columns therefore move as uint16
# bits, which costs one uint16 copy of w (the CPU materialises the bitcast) instead. Other platforms
# slice 16-bit floats natively and take the plain path.
def _bits(x):
    return lax.bitcast_convert_type(x, jnp.uint16) if jnp.dtype(x.dtype).itemsize == 2 else x


def _unbits(x, dtype):
    return lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _get_cols_cpu(w, start, *, width):
    return _unbits(lax.dynamic_slice_in_dim(_bits(w), start, width, axis=1), w.dtype)


def _put_cols_cpu(d_w, cols, start):
    return _unbits(lax.dynamic_update_slice_in_dim(_bits(d_w), _bits(cols), start, axis=1), d_w.dtype)


def _tile(hidden, w, start, width: int, temperature: float):
    """Scaled float32 logits of one vocabulary chunk [N, width] and its w columns [E, width]."""
    w_c = _get_cols(w, jnp.asarray(start, jnp.int32), width)
    z = jnp.matmul(*cpu_upcast(hidden, w_c), preferred_element_type=jnp.float32)
    return z / temperature if temperature != 1.0 else z, w_c


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _logprobs(hidden, w, targets, temperature, chunk, with_entropy, valid_vocab):
    return _forward(hidden, w, targets, temperature, chunk, with_entropy, valid_vocab)[0]


def _forward(hidden, w, targets, temperature, chunk, with_entropy, valid_vocab):
    n = hidden.shape[0]

    def step(start, width, carry):
        m, s, u, tgt = carry
        z, _ = _tile(hidden, w, start, width, temperature)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        alpha = jnp.exp(m - m_new)
        zm = z - m_new[:, None]
        e = jnp.exp(zm)
        if with_entropy:  # u uses the old s: alpha * (u + (m - m_new) s) + sum e (z - m_new)
            u = alpha * (u + (m - m_new) * s) + jnp.sum(e * zm, axis=1)
        s = alpha * s + jnp.sum(e, axis=1)
        hit = targets[:, None] == start + jnp.arange(width, dtype=jnp.int32)[None, :]
        tgt = tgt + jnp.sum(jnp.where(hit, z, 0.0), axis=1)
        return m_new, s, u, tgt

    zeros = jnp.zeros((n,), jnp.float32)
    carry = (jnp.full((n,), _NEG, jnp.float32), zeros, zeros, zeros)
    n_full, rem = _chunks(valid_vocab, chunk)  # columns >= valid_vocab (padding) are never visited
    carry = lax.fori_loop(0, n_full, lambda i, c: step(i * chunk, chunk, c), carry)
    if rem is not None:
        carry = step(rem[0], rem[1], carry)
    m, s, u, tgt = carry
    log_s = jnp.log(s)
    lse = m + log_s
    ent = log_s - u / s if with_entropy else None
    return (tgt - lse, ent), (hidden, w, targets, lse, ent)


def _backward(temperature, chunk, with_entropy, valid_vocab, res, cts):
    hidden, w, targets, lse, ent = res
    g_logp, g_ent = cts
    cdt = jnp.result_type(hidden.dtype, w.dtype)

    def step(start, width, carry):
        d_h, d_w = carry
        z, w_c = _tile(hidden, w, start, width, temperature)
        logp = z - lse[:, None]
        p = jnp.exp(logp)
        hit = targets[:, None] == start + jnp.arange(width, dtype=jnp.int32)[None, :]
        dz = g_logp[:, None] * (hit.astype(jnp.float32) - p)
        if with_entropy:
            dz = dz - g_ent[:, None] * p * (logp + ent[:, None])
        if temperature != 1.0:
            dz = dz / temperature
        dz = dz.astype(cdt)
        d_h = d_h + jnp.matmul(*cpu_upcast(dz, w_c.T.astype(cdt)), preferred_element_type=jnp.float32)
        d_w_c = jnp.matmul(*cpu_upcast(hidden.T.astype(cdt), dz), preferred_element_type=jnp.float32)
        d_w = _put_cols(d_w, d_w_c.astype(w.dtype), jnp.asarray(start, jnp.int32))
        return d_h, d_w

    carry = (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros(w.shape, w.dtype))
    n_full, rem = _chunks(valid_vocab, chunk)  # columns >= valid_vocab (padding) are never visited
    carry = lax.fori_loop(0, n_full, lambda i, c: step(i * chunk, chunk, c), carry)
    if rem is not None:
        carry = step(rem[0], rem[1], carry)
    d_h, d_w = carry
    return d_h.astype(hidden.dtype), d_w, None


_logprobs.defvjp(_forward, _backward)
