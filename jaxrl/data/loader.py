"""Process-sharded, resumable prompt loader, and prompt/demonstration encoding.

The loader walks one infinite *global stream*: epoch 0's permutation of the row indices, then epoch
1's, ... (each drawn from `seed` and the epoch number, identical on every process). A step consumes
one global batch of `batch_size × process_count` consecutive stream entries, and process p takes the
entries whose stream index is ≡ p (mod process_count) — when the epoch length divides by the process
count that is exactly "rows i with i % process_count == process_index of the permuted epoch". So:

* every process yields only its own rows; over an epoch the processes' rows are disjoint and their
  union is the whole dataset (no central data node, DistFlow);
* every process takes the same number of steps per epoch — a global batch may straddle an epoch
  boundary instead of being cut short, so no process runs out first and SPMD stays in lock step and
  no row is dropped or padded;
* the cursor `{"epoch", "position", "seed"}` (position = stream offset inside the epoch) is the same on
  every process, so any process's `state_dict()` checkpoints all of them, and `load_state_dict` then
  yields exactly the batches an uninterrupted run would have yielded. Because the cursor is global,
  it also resumes under a different process count (the rows are re-dealt, none skipped or repeated).

Each yielded batch is a list of `batch_size` row dicts, each with its dataset `"index"` added (the
length ranker and logs key on it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator, Sequence

import numpy as np

from .tasks import Example, demonstration


class DataLoader:
    def __init__(self, dataset: Sequence[Mapping], batch_size: int, *, process_index: int = 0,
                 process_count: int = 1, shuffle: bool = True, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in [0, process_count={process_count})")
        if len(dataset) == 0:
            raise ValueError("DataLoader: the dataset is empty")
        self.dataset = dataset
        self.batch_size = batch_size
        self.process_index = process_index
        self.process_count = process_count
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._perms: dict[int, np.ndarray] = {}

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.process_count

    @property
    def steps_per_epoch(self) -> float:
        """Global batches per epoch (fractional when a batch straddles the epoch boundary)."""
        return len(self.dataset) / self.global_batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            n = len(self.dataset)
            self._perms = {e: p for e, p in self._perms.items() if e >= self.epoch}   # keep it bounded
            self._perms[epoch] = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                                  else np.arange(n))
        return self._perms[epoch]

    def _local_indices(self) -> list[int]:
        n = len(self.dataset)
        out = []
        for j in range(self.batch_size):
            offset = self.position + j * self.process_count + self.process_index
            out.append(int(self._permutation(self.epoch + offset // n)[offset % n]))
        return out

    def __iter__(self) -> Iterator[list[dict]]:
        return self

    def __next__(self) -> list[dict]:
        batch = [{**self.dataset[i], "index": i} for i in self._local_indices()]
        epochs, self.position = divmod(self.position + self.global_batch_size, len(self.dataset))
        self.epoch += epochs
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise KeyError(f"loader state lacks {sorted(missing)}: {dict(state)}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.dataset):
            raise ValueError(f"loader state {dict(state)} does not fit a dataset of {len(self.dataset)} rows")
        self.epoch, self.position, self.seed = epoch, position, int(state["seed"])
        self._perms = {}


def _field(row: Mapping | Example, key: str) -> str:
    return getattr(row, key) if isinstance(row, Example) else row[key]


def encode_prompts(rows: Sequence[Mapping | Example], tokenizer, chat: bool = True) -> list[list[int]]:
    """Token ids of each row's prompt, wrapped as one user turn of the tokenizer's chat template."""
    out = []
    for row in rows:
        text = _field(row, "prompt")
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        out.append(tokenizer.encode(text))
    return out


def encode_demonstrations(rows: Sequence[Mapping | Example], tokenizer,
                          chat: bool = True) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, ideal response ids + EOS) for built-in rows: the supervised warm start's data."""
    prompts = encode_prompts(rows, tokenizer, chat)
    out = []
    for row, prompt in zip(rows, prompts):
        ex = row if isinstance(row, Example) else Example(row["prompt"], row["answer"], row["task"])
        out.append((prompt, tokenizer.encode(demonstration(ex)) + [tokenizer.eos_ids[0]]))
    return out


def sft_batch(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int, seq_len: int | None = None, *,
              pack: bool = False, num_rows: int | None = None) -> dict[str, np.ndarray]:
    """Next-token training arrays [R, T] for (prompt ids, response ids) pairs.

    Returns int32 `tokens`, `positions`, `segment_ids` (1, 2, ... per sequence in a row, 0 on padding)
    and float32 `loss_mask` = 1 where tokens[r, t] is a response token (EOS included): the loss on
    predicting tokens[:, 1:] from tokens[:, :-1] is masked by loss_mask[:, 1:], and give `positions` and
    `segment_ids` to `models.forward` so packed sequences neither see each other nor share positions.

    Unpacked: one pair per row, T = `seq_len` or the longest pair. `pack=True` fills rows of `seq_len`
    first-fit in order: the built-in tasks' long-tailed lengths make padded rows mostly padding (a few
    130-token rows beside a 30-token median), and packing removes most of it. `num_rows` pads the row
    count to a fixed number (one compiled shape) and is an error if the pairs need more. A pair longer
    than `seq_len` is an error: truncating its EOS would teach the model never to stop.
    """
    lengths = [len(p) + len(r) for p, r in pairs]
    if pack and seq_len is None:
        raise ValueError("sft_batch(pack=True) needs seq_len")
    T = max(lengths) if seq_len is None else seq_len
    if max(lengths) > T:
        raise ValueError(f"a demonstration has {max(lengths)} tokens, more than seq_len={T}")
    placement = []                                   # (row, start) per pair
    if pack:
        fill: list[int] = []
        for n in lengths:
            row = next((i for i, used in enumerate(fill) if used + n <= T), len(fill))
            if row == len(fill):
                fill.append(0)
            placement.append((row, fill[row]))
            fill[row] += n
        rows = len(fill)
    else:
        placement = [(b, 0) for b in range(len(pairs))]
        rows = len(pairs)
    if num_rows is not None:
        if rows > num_rows:
            raise ValueError(f"the pairs need {rows} rows of {T} tokens, more than num_rows={num_rows}")
        rows = num_rows
    tokens = np.full((rows, T), pad_id, np.int32)
    positions = np.zeros((rows, T), np.int32)
    segments = np.zeros((rows, T), np.int32)
    mask = np.zeros((rows, T), np.float32)
    for (p, r), (row, start), n in zip(pairs, placement, lengths):
        end = start + n
        tokens[row, start:end] = list(p) + list(r)
        positions[row, start:end] = np.arange(n)
        segments[row, start:end] = segments[row, :start].max(initial=0) + 1
        mask[row, start + len(p):end] = 1.0
    return {"tokens": tokens, "positions": positions, "segment_ids": segments, "loss_mask": mask,
            "lengths": np.asarray(lengths, np.int32)}
