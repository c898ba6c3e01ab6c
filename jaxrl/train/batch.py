"""Training batches: pack (prompt, response) sequences into fixed-length rows and weight every token.

Packing (first-fit decreasing) puts several sequences in one row with their own segment ids and
restarted positions, which cuts padding for long-tailed response lengths; attention never crosses a
segment (`models.forward(segment_ids=...)`). A token at index i predicts `targets[i]`; `loss_mask`
marks the response tokens (the prompt's last token predicts the first response token; the final
response token predicts nothing).

Loss aggregation is expressed as per-token weights so that `loss = sum(w * token_loss)` is exact
whatever the packing, micro-batching or number of processes (one mechanism, no special cases). The
weights come from the `jaxrl.algos` aggregation registry, the one definition of each mode
(`algos.token_weights`: unnormalised w_i = 1/q_i and the denominator kind;
`algos.folded_token_weights`: 1/(D·q_i), what the synchronous trainer packs; see
`jaxrl.train.rl.batch_weights`). `pack` takes them per sequence and casts them to float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl.rollout.shapes import fine_bucket


@dataclasses.dataclass
class Sample:
    prompt: list[int]
    response: list[int]
    advantage: float = 0.0
    logprobs: list[float] | None = None    # the rollout's log-probs of `response` (the behaviour policy)
    version: int = 0                       # the weights version that generated it (one-step-async staleness)
    kv: Any = None                         # its rollout K/V (`rollout.SequenceKV`; kv_source=rollout, streamed)
    # multi-turn: per response token, 1 where the model sampled it (trained), 0 where it is context the
    # environment appended (an observation: attended to, never trained on); None: every token is trained
    mask: list[int] | None = None


def trained_mask(c) -> list[int] | None:
    """A completion's `Sample.mask`: its sampled tokens 1, the observations appended to it 0 (None when it has
    none: a single-turn completion trains every token, bit for bit as before)."""
    return c.sampled_mask() if c.appended else None


def trained_tokens(s: Sample) -> int:
    """The response tokens of `s` the loss covers (the aggregation's token count)."""
    return len(s.response) if s.mask is None else int(sum(s.mask))


FIELDS = ("tokens", "positions", "segment_ids", "targets", "loss_mask", "advantages", "weights")
INT_FIELDS = ("tokens", "positions", "segment_ids", "targets", "loss_mask")     # int32; the others float32


def row_bucket(n: int) -> int:
    """Training rows (without fixed micro-batches): at most 25% padding, 4 shapes (compiles) per octave."""
    return fine_bucket(n)


def pack_rows(lengths: list[int], pack_len: int) -> list[list[int]]:
    """First-fit decreasing: indices of the sequences in each row."""
    too_long = [n for n in lengths if n > pack_len]
    if too_long:
        raise ValueError(f"sequence of {max(too_long)} tokens does not fit pack_len={pack_len}")
    rows: list[list[int]] = []
    space: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(space):
            if free >= lengths[i]:
                rows[r].append(i)
                space[r] -= lengths[i]
                break
        else:
            rows.append([i])
            space.append(pack_len - lengths[i])
    return rows


def pack(samples: list[Sample], seq_weights, pack_len: int, n_rows: int | None = None,
         rows: list[list[int]] | None = None, behaviour: bool = False,
         token_fields: dict[str, list] | None = None) -> dict[str, np.ndarray]:
    """Pack into `n_rows` rows (default: as few as fit) of `pack_len` tokens; `rows` reuses a
    `pack_rows` assignment the caller already computed. `behaviour`: also "old_logp", each response
    token's rollout log-prob at the index that predicts it (the importance ratio's behaviour policy).
    `token_fields`: more float32 fields, name -> one array per sample with a value per response token, each
    placed at the index that predicts its token (e.g. the critic's "returns" and "old_values")."""
    if rows is None:
        rows = pack_rows([len(s.prompt) + len(s.response) for s in samples], pack_len)
    n_rows = len(rows) if n_rows is None else n_rows
    if n_rows < len(rows):
        raise ValueError(f"{len(samples)} sequences need {len(rows)} rows of {pack_len}, only {n_rows} given")
    token_fields = token_fields or {}
    out = {k: np.zeros((n_rows, pack_len), np.int32 if k in INT_FIELDS else np.float32)
           for k in FIELDS + ("old_logp",) * behaviour + tuple(token_fields)}
    for r, members in enumerate(rows):
        off = 0
        for seg, i in enumerate(members, 1):
            s = samples[i]
            seq = s.prompt + s.response
            n, p = len(seq), len(s.prompt)
            out["tokens"][r, off:off + n] = seq
            out["positions"][r, off:off + n] = np.arange(n)
            out["segment_ids"][r, off:off + n] = seg
            out["targets"][r, off:off + n - 1] = seq[1:]
            resp = slice(off + p - 1, off + n - 1)          # indices whose target is a response token
            out["advantages"][r, resp] = s.advantage
            if s.mask is None:
                out["loss_mask"][r, resp] = 1
                out["weights"][r, resp] = seq_weights[i]
            else:                                           # observation tokens: context, no loss
                if len(s.mask) != len(s.response):
                    raise ValueError(f"sample {i}: a mask of {len(s.mask)} for {len(s.response)} response tokens")
                out["loss_mask"][r, resp] = s.mask
                out["weights"][r, resp] = seq_weights[i] * np.asarray(s.mask, np.float64)
            if behaviour:
                if s.logprobs is None or len(s.logprobs) != len(s.response):
                    raise ValueError(f"sample {i}: behaviour log-probs needed for each of its {len(s.response)} "
                                     "response tokens")
                out["old_logp"][r, resp] = s.logprobs
            for name, per_sample in token_fields.items():
                out[name][r, resp] = per_sample[i]
            off += n
    return out


def unpack(rows: np.ndarray, assignment: list[list[int]], samples: list[Sample]) -> list[np.ndarray]:
    """`pack`'s inverse for one per-token field: `rows` [n_rows, pack_len] packed with `assignment` ->
    each sample's values at its response tokens (the indices that predict them), in sample order."""
    out: list = [None] * len(samples)
    for r, members in enumerate(assignment):
        off = 0
        for i in members:
            p, n = len(samples[i].prompt), len(samples[i].prompt) + len(samples[i].response)
            out[i] = np.asarray(rows[r, off + p - 1:off + n - 1])
            off += n
    return out
