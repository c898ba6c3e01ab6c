"""Loss aggregation modes: per-token values [B, T] -> one scalar, in a registry by name.

Each mode is defined ONCE, by two facts (an `Aggregation` in `AGGREGATIONS`):

* `divisor(lengths, norm_len) -> q_i`, a per-sequence divisor (>= 1) of that sequence's token sum;
* `denominator`, what the whole sum is divided by: "tokens" (valid tokens of the batch) or
  "sequences" (sequences of the batch).

so that   aggregate(x, mask) = Σ_i (Σ_t ℓ_i,t) / q_i  /  D.

Everything else is derived from those two facts, so the modes cannot drift apart:

* `aggregate(x, mask, agg, *, norm_len=None, denom=None)` — the jnp reduction (losses, metrics).
  `denom` overrides D: when one batch is split into micro-batches (gradient accumulation, the stream
  trainer), pass the *whole* batch's count to each part so the parts sum to the whole exactly. By
  default D counts the valid tokens ("tokens") or the rows with at least one valid token
  ("sequences"), so all-padding rows of a bucketed batch do not dilute the mean.
* `token_weights(agg, lengths, max_new_tokens) -> (w_i = 1 / q_i, denominator kind)` — the
  *unnormalised* per-sequence token weight a trainer puts on every response token, so that
  Σ w·ℓ / D == aggregate(ℓ, mask) whatever the packing, micro-batching or device group
  (`jaxrl.train.step.grad_step` sums, `apply_update` divides by D once).
* `folded_token_weights(agg, lengths, max_new_tokens, denominator=D)` — the same weight with D
  folded in, 1 / (D·q_i), computed in float64 on the host (the synchronous trainer knows D before
  the update and passes denominator 1 to it).

`norm_len` is the constant length normaliser of "seq-mean-token-sum-norm" (default: T; a trainer
passes the configured max_new_tokens so L does not change with the padded bucket). A sequence of
length 0 counts as length 1 in `divisor` (it has no tokens, so its weight multiplies nothing).

The names follow verl's `loss_agg_mode`, so recipes read the same.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .masked import as_mask, check_shapes, masked_sum
from .registry import lookup

DENOMINATORS = ("tokens", "sequences")


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """One aggregation mode: `divisor(lengths, norm_len) -> q_i` and the `denominator` kind.

    Calling it is `aggregate` for this mode: `(x [B, T], mask [B, T], *, norm_len=None, denom=None)`.
    """

    name: str
    divisor: Callable
    denominator: str

    def __post_init__(self):
        if self.denominator not in DENOMINATORS:
            raise ValueError(f"aggregation {self.name!r}: denominator={self.denominator!r}; "
                             f"valid choices: {', '.join(DENOMINATORS)}")

    def __call__(self, x, mask, *, norm_len=None, denom=None) -> jax.Array:
        valid = mask > 0
        lengths = jnp.sum(valid, axis=-1)
        q = self.divisor(jnp.maximum(lengths, 1), mask.shape[-1] if norm_len is None else norm_len)
        per_seq = masked_sum(x, mask, axis=-1) / q
        if denom is None:
            count = jnp.sum(lengths) if self.denominator == "tokens" else jnp.sum(lengths > 0)
            denom = jnp.maximum(count, 1)
        return jnp.sum(per_seq) / denom

    def seq_divisor(self, lengths, max_new_tokens: int) -> np.ndarray:
        """q_i per sequence as a host int64 array (lengths clamped to >= 1)."""
        lengths = np.maximum(np.asarray(lengths, np.int64), 1)
        return np.broadcast_to(np.asarray(self.divisor(lengths, max_new_tokens)), lengths.shape)


AGGREGATIONS: dict[str, Aggregation] = {}


def register_aggregation(name: str, *, denominator: str):
    """Decorator: register `divisor(lengths, norm_len) -> q_i` as the aggregation mode `name` whose
    token sum is divided by `denominator` ("tokens" or "sequences"). The function must work on numpy
    and jax arrays (plain arithmetic). A repeated name is an error."""

    def deco(fn):
        if name in AGGREGATIONS:
            raise ValueError(f"aggregation {name!r} is already registered")
        AGGREGATIONS[name] = Aggregation(name, fn, denominator)
        return fn

    return deco


def aggregate(x, mask, agg: str = "token-mean", *, norm_len=None, denom=None) -> jax.Array:
    """Reduce per-token values x [B, T] over valid tokens with the mode `agg` (see AGGREGATIONS)."""
    mode = lookup(AGGREGATIONS, agg, "aggregation")
    mask = as_mask(mask, what=f"aggregate({agg})")
    check_shapes(f"aggregate({agg})", x=x, mask=mask)
    return mode(jnp.asarray(x, jnp.float32), mask, norm_len=norm_len, denom=denom)


def token_weights(agg: str, lengths, max_new_tokens: int) -> tuple[np.ndarray, str]:
    """Unnormalised per-sequence token weight w_i = 1 / q_i (float64 [n]) and the denominator kind
    ("tokens" or "sequences") the weighted sum Σ_i w_i Σ_t ℓ_i,t must be divided by."""
    mode = lookup(AGGREGATIONS, agg, "aggregation")
    return 1.0 / mode.seq_divisor(lengths, max_new_tokens), mode.denominator


def folded_token_weights(agg: str, lengths, max_new_tokens: int, *, denominator: int) -> np.ndarray:
    """Per-sequence token weight with the denominator folded in: 1 / (max(D, 1) · q_i), float64 [n].

    For the built-in modes these are the float64 expressions the synchronous trainer has always used
    (1/N for token-mean, 1/(S·|o_i|) for seq-mean-token-mean, 1/S, 1/(S·L)), so folding is bit-exact."""
    mode = lookup(AGGREGATIONS, agg, "aggregation")
    return 1.0 / (max(int(denominator), 1) * mode.seq_divisor(lengths, max_new_tokens))


@register_aggregation("token-mean", denominator="tokens")
def token_mean(lengths, norm_len):
    """Σ_i Σ_t ℓ_i,t / Σ_i |o_i| — every token of the batch weighs the same
    (DAPO, Yu et al. 2025, arXiv:2503.14476, §3.3 "Token-Level Policy Gradient Loss"). q_i = 1."""
    return lengths * 0 + 1


@register_aggregation("seq-mean-token-mean", denominator="sequences")
def seq_mean_token_mean(lengths, norm_len):
    """1/G Σ_i 1/|o_i| Σ_t ℓ_i,t — each sequence weighs the same
    (GRPO, Shao et al. 2024, arXiv:2402.03300, eq. 3). q_i = |o_i|."""
    return lengths


@register_aggregation("seq-mean-token-sum", denominator="sequences")
def seq_mean_token_sum(lengths, norm_len):
    """1/G Σ_i Σ_t ℓ_i,t — the per-sequence REINFORCE sum of token terms, averaged over sequences. q_i = 1."""
    return lengths * 0 + 1


@register_aggregation("seq-mean-token-sum-norm", denominator="sequences")
def seq_mean_token_sum_norm(lengths, norm_len):
    """1/G Σ_i Σ_t ℓ_i,t / L with a constant L (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783, §3.1:
    the 1/|o_i| length normaliser is replaced by the generation budget, removing the length bias).
    q_i = L = `norm_len`. verl's mode of the same name omits the 1/G; the two differ by a constant."""
    return lengths * 0 + norm_len
