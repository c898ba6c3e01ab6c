"""A live sequence of the rollout engine: the scheduler's mutable record (`Sequence`), the same as a plain value
that can leave its instance and join another (`SequenceState`), and the batches of one step's device work
(`PrefillBatch`, `DecodeBatch`). Pure Python and numpy, no JAX (see `scheduler`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from .params import SamplingParams


@dataclasses.dataclass(frozen=True)
class SequenceState:
    """One live sequence as a value: what it is, how far it got, and where its KV lives.

    `pages` are page ids in the pool of instance `instance` holding the K/V of positions [0, computed)
    (empty: no KV anywhere, the sequence recomputes it). The sampling position (the index folded into
    the request's seed for its next token) is `len(tokens)`, so a moved sequence samples exactly what it
    would have sampled where it was.
    """

    rid: int
    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int
    group: int | None
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    preemptions: int = 0
    computed: int = 0
    pages: tuple[int, ...] = ()
    instance: int | None = None
    priority: float = 0.0                 # LPT admission key (StreamRL: predicted length; larger first)
    appended: tuple[tuple[int, int], ...] = ()   # [start, end) spans of `tokens` appended (observations)
    paused: bool = False                  # between turns: waits for `resume`, holding `pages`

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.tokens)

    @property
    def sampling_step(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(eq=False)
class Sequence:
    """The scheduler's mutable record of a live sequence."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    group: int | None = None              # shared-prefix group id (None: standalone)
    out: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0                     # positions whose K/V are in the cache
    preemptions: int = 0
    pending: int = 0                      # tokens dispatched but not yet read back (0 or 1)
    done: bool = False                    # retired or aborted: unread tokens are discarded
    priority: float = 0.0                 # LPT admission key (larger first); FCFS ignores it
    appended: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # observation spans of `out`
    paused: bool = False                  # between turns (in `Scheduler.paused`)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    def __len__(self):
        return len(self.prompt) + len(self.out)

    @property
    def turn_start(self) -> int:
        """Index in `out` where the current turn's samples start (after the last observation)."""
        return self.appended[-1][1] if self.appended else 0

    def state(self, instance: int | None = None) -> SequenceState:
        return SequenceState(self.rid, tuple(self.prompt), self.params, self.seed, self.group, tuple(self.out),
                             tuple(self.logprobs), self.preemptions, self.computed if self.pages else 0,
                             tuple(self.pages), instance if self.pages else None, self.priority,
                             tuple(self.appended), self.paused)

    @classmethod
    def from_state(cls, st: SequenceState, pages: list[int] | None = None) -> "Sequence":
        """A record for `st`; with `pages` (ids in the new pool holding its KV) it keeps `st.computed`."""
        return cls(st.rid, list(st.prompt), st.params, st.seed, st.group, list(st.tokens), list(st.logprobs),
                   list(pages or []), st.computed if pages else 0, st.preemptions, priority=st.priority,
                   appended=list(st.appended), paused=st.paused)


@dataclasses.dataclass
class PrefillBatch:
    """One prefill call: row i holds positions start[i] .. start[i]+n_valid[i]-1 of seqs[i]."""

    seqs: list[Sequence]
    tokens: np.ndarray       # [rows, width] int32
    start: np.ndarray        # [rows]
    n_valid: np.ndarray      # [rows]
    table: np.ndarray        # [rows, max_pages]


@dataclasses.dataclass
class DecodeBatch:
    """One decode step over `seqs` (rows beyond len(seqs) are padding on the scratch page)."""

    seqs: list[Sequence]
    tokens: np.ndarray       # [rows] input tokens known on the host
    positions: np.ndarray    # [rows]
    src: np.ndarray          # [rows] row of the previous step whose output is the input (-1: use tokens)
    table: np.ndarray        # [rows, max_pages]
    sampling: list[tuple[SamplingParams, int, int]]   # (params, seed, step) per real row
