"""Sampling parameters and the on-device sampler.

Randomness is per request: the key for a request's t-th new token is `fold_in(key(seed), t)`, so the
same seed gives the same tokens whatever else shares the batch, the bucket or the instance.

The returned log-prob is that of the sampled token under the temperature-scaled distribution
*before* top-k/top-p truncation (log_softmax(logits / T); T=1 for greedy), which is what a
teacher-forced forward computes, so RL importance ratios start at 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    n: int = 1                        # samples per prompt (share the prompt's KV pages)
    return_kv: bool = False           # attach the sequence's KV cache to the completion

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an int >= 1")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling inputs of one compiled step (all [B])."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    step: jax.Array  # index of the token being sampled within its request

    @staticmethod
    def build(rows: list[tuple[SamplingParams, int, int]], bucket: int) -> "SamplingBatch":
        """rows: (params, seed, step) per real row; padded to `bucket` with greedy rows."""
        pad = bucket - len(rows)
        col = lambda f, dt, fill: np.array([f(r) for r in rows] + [fill] * pad, dt)
        return SamplingBatch(temperature=col(lambda r: r[0].temperature, np.float32, 0.0),
                             top_k=col(lambda r: r[0].top_k, np.int32, 0), top_p=col(lambda r: r[0].top_p, np.float32, 1.0),
                             seed=col(lambda r: r[1], np.uint32, 0), step=col(lambda r: r[2], np.int32, 0))


def _filter(scaled, top_k, top_p):
    """Mask logits outside the top-k and the top-p nucleus (rows with k=0 / p=1 are untouched)."""
    V = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs          # mass strictly before each sorted entry
    n_keep = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1), 1)
    pth = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(scaled < jnp.maximum(kth, pth), -jnp.inf, scaled)


def sample(logits: jax.Array, s: SamplingBatch) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] float32 -> (tokens [B] int32, log-probs [B] float32)."""
    greedy = s.temperature <= 0
    t = jnp.where(greedy, 1.0, s.temperature)
    scaled = logits / t[:, None]
    logp_all = jax.nn.log_softmax(scaled, axis=-1)
    need_filter = jnp.any(((s.top_k > 0) | (s.top_p < 1)) & ~greedy)
    filtered = jax.lax.cond(need_filter, lambda: _filter(scaled, s.top_k, s.top_p), lambda: scaled)
    def draw():
        keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(s.seed, s.step)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
        return jnp.argmax(filtered + gumbel, axis=-1)

    argmax = jnp.argmax(logits, axis=-1)
    sampled = jax.lax.cond(jnp.all(greedy), lambda: argmax, draw)  # no noise for all-greedy batches
    tok = jnp.where(greedy, argmax, sampled).astype(jnp.int32)
    return tok, jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]
