"""The held-out prompts of a training run: a file (`eval.data`) or a split of `data.source` (`eval.split`).

A split holds out `split` distinct prompts, drawn by a seeded permutation of the distinct prompts, and removes
every training row whose prompt is one of them, so no held-out prompt is ever trained on (generated suites
repeat prompts: two-digit additions have 8,100). The held-out rows keep their order in the data; each carries
its own `index` (its position in the held-out set), which seeds its samples.
"""

from __future__ import annotations

import numpy as np

from jaxrl.data import PromptDataset
from jaxrl.data.tasks import DEFAULT_TASKS


def split_heldout(dataset: PromptDataset, n: int, seed: int) -> tuple[PromptDataset, list[dict]]:
    """(the training rows without the held-out prompts, `n` held-out rows): ValueError when the data has fewer
    than n + 1 distinct prompts (something must be left to train on)."""
    distinct = list(dict.fromkeys(row["prompt"] for row in dataset))
    if len(distinct) <= n:
        raise ValueError(f"eval.split={n}: {dataset.source} has {len(distinct)} distinct prompts; hold out fewer "
                         "(some must be left to train on) or set eval.data to a file of its own")
    chosen = {distinct[i] for i in np.random.default_rng(seed).permutation(len(distinct))[:n]}
    held, train, seen = [], [], set()
    for row in dataset:
        if row["prompt"] not in chosen:
            train.append(row)
        elif row["prompt"] not in seen:        # one row per held-out prompt
            seen.add(row["prompt"])
            held.append(row)
    kept = PromptDataset(train, source=dataset.source, skipped=dataset.skipped,
                         skipped_example=dataset.skipped_example)
    return kept, indexed(held)


def indexed(rows) -> list[dict]:
    """`rows` as dicts with their position as `index` (the sampling seed's key)."""
    return [{**row, "index": i} for i, row in enumerate(rows)]


def load_rows(data, seed: int) -> PromptDataset:
    """The rows a `data` section names: the built-in suite (`data.tasks`, `num_examples`, `seed`) or a file."""
    if data.source == "builtin":
        return PromptDataset.builtin(list(data.tasks) or list(DEFAULT_TASKS), data.num_examples, seed)
    return PromptDataset.from_file(data.source, prompt_key=data.prompt_key, answer_key=data.answer_key)
