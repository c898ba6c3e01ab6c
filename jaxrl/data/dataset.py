"""Prompt datasets: rows {prompt, answer, task[, reward], ...the file's other columns} from JSONL, Parquet or the
built-in task suite.

A row is valid when its prompt and answer are non-empty strings (and its task and reward, where the file
has them, are non-empty strings; null counts as absent). Anything else — a line that is not JSON, a
missing key, a number or null where a string belongs — is skipped, counted in `dataset.skipped`, and the
first such row is kept as text in `dataset.skipped_example` and logged with the count, so a bad export
shows up in the log instead of silently shrinking the dataset. A file with no valid row at all is an
error, as is a Parquet file without the requested columns (a configuration mistake, not a bad row).

DeepScaleR-style files (`problem`/`answer` columns, no task column) load with
`from_parquet(path, prompt_key="problem")`; rows without a task field get `default_task` ("math",
scored by the math verifier in `jaxrl.rewards`).

An answer that is a JSON object or list (a code task's test cases, `jaxrl.rewards.code`) is kept as its
JSON text. A `"reward"` field (key or column) names the reward function of that row — a registered name or
"package.module:function" (see `jaxrl.rewards.registry`); rows keep it only when it is set, so rows
without one (and the built-in rows) are exactly {prompt, answer, task}.

**Every other column is kept** (`extra_columns=None`; a list keeps only those, `()` none), so a reward can take
it by name (`jaxrl.rewards.calling`) and an environment's `reset(row)` sees it. What is kept and how:

* Values are kept as they are: JSON values (JSONL: whatever the line holds, objects and lists included; null is
  kept as None). Parquet columns of a JSON-like type (strings, numbers, booleans, nulls, and lists/structs of
  those) are read; a column of any other type (binary, timestamp, decimal, map, ...) is not read, and one
  warning names it: cast it to a string in the file to keep it.
* A column whose name is taken is not kept (one warning names it): `prompt`, `answer`, `task` (a renamed
  `data.prompt_key` column's place), `index` (the loader's row number) and `response` (a reward's response).
* A JSONL row without a column simply lacks it (not None); the start-up check (`check_rewards` over
  `reward_columns`) refuses a reward that requires a column not every row has.
* Large values: no limit. They cost host memory (every process holds the table; Parquet no longer reads only
  the prompt and answer columns, so drop columns you do not need, or pass `extra_columns`), and they cross the
  reward pool's pipe only to a function that takes them by name (or `**kwargs`), never to the others.

Every process holds the row table (prompts are text: tens of MB for 40k math problems, plus the columns kept)
but consumes, tokenizes and generates only its own shard: the
`DataLoader` hands each process its slice of a per-epoch permutation, which needs random access to the
rows. Chat-format prompts (a list of messages in one cell) are not read; flatten them to the user turn.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Iterable, Iterator, Sequence

from .tasks import make_suite

logger = logging.getLogger(__name__)

Row = dict[str, object]
REWARD_KEY = "reward"  # optional per-row reward-function name
TAKEN = ("prompt", "answer", "task", REWARD_KEY, "index", "response")  # never an extra column's name
_SNIPPET = 200


def _snippet(value) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= _SNIPPET else text[:_SNIPPET] + "..."


@dataclasses.dataclass(frozen=True)
class _Keys:
    """Where a row's fields are in a record, the task of rows without one and which other columns to keep."""

    prompt: str
    answer: str
    task: str
    default_task: str
    extra: frozenset[str] | None = None     # None: every other column

    def keep(self, column: str) -> bool:
        return column not in (self.prompt, self.answer, self.task, REWARD_KEY) and \
            (self.extra is None or column in self.extra)


def _check(record, keys: _Keys, dropped: set) -> Row | str:
    """The row, or the reason it is malformed; the names of columns not kept because taken go to `dropped`."""
    prompt_key, answer_key, task_key, default_task = keys.prompt, keys.answer, keys.task, keys.default_task
    if not isinstance(record, dict):
        return f"not an object ({type(record).__name__})"
    fields = {}
    for key in (prompt_key, answer_key):
        if key not in record:
            return f"missing {key!r}"
        value = record[key]
        if key == answer_key and isinstance(value, (dict, list)) and value:
            value = json.dumps(value)   # structured answers (code test cases) travel as JSON text
        if not isinstance(value, str):
            return f"{key!r} is {type(value).__name__}, not a string"
        if not value.strip():
            return f"{key!r} is empty"
        fields[key] = value
    task = record.get(task_key)
    if task is None:
        task = default_task
    elif not isinstance(task, str) or not task:
        return f"{task_key!r} is {type(task).__name__}, not a non-empty string"
    row = {"prompt": fields[prompt_key], "answer": fields[answer_key], "task": task}
    reward = record.get(REWARD_KEY)
    if reward is not None:
        if not isinstance(reward, str) or not reward.strip():
            return f"{REWARD_KEY!r} is {type(reward).__name__}, not a non-empty string"
        row[REWARD_KEY] = reward
    for column, value in record.items():
        if keys.keep(column):
            if column in TAKEN:
                dropped.add(column)
            else:
                row[column] = value
    return row


class PromptDataset(Sequence[Row]):
    """An indexable list of rows {"prompt", "answer", "task"[, "reward"]} and what was skipped loading them."""

    def __init__(self, rows: Iterable[Row], *, source: str = "<memory>", skipped: int = 0,
                 skipped_example: str | None = None):
        self.rows: list[Row] = list(rows)
        self.source = source
        self.skipped = skipped
        self.skipped_example = skipped_example

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    def __repr__(self) -> str:
        return f"PromptDataset({len(self)} rows from {self.source}, {self.skipped} skipped)"

    @classmethod
    def _collect(cls, records: Iterable[tuple[str, object]], source: str, keys: _Keys) -> "PromptDataset":
        """records: (where, record-or-parse-error) pairs; `where` names the line/row for the log."""
        rows, skipped, example, dropped = [], 0, None, set()
        for where, record in records:
            checked = record if isinstance(record, _Malformed) else _check(record, keys, dropped)
            if isinstance(checked, dict):
                rows.append(checked)
                continue
            skipped += 1
            if example is None:
                raw = record.raw if isinstance(record, _Malformed) else record
                example = f"{source}:{where}: {checked}: {_snippet(raw)}"
        if skipped:
            logger.warning("%s: skipped %d malformed of %d rows (prompt_key=%r, answer_key=%r); first: %s",
                           source, skipped, skipped + len(rows), keys.prompt, keys.answer, example)
        if dropped:
            logger.warning("%s: column(s) %s not kept: the name is taken (%s); rename them to pass them to rewards",
                           source, sorted(dropped), ", ".join(TAKEN))
        if not rows:
            raise ValueError(f"{source}: no valid rows with string {keys.prompt!r} and {keys.answer!r}"
                             + (f"; first malformed: {example}" if example else " (empty file)"))
        return cls(rows, source=source, skipped=skipped, skipped_example=example)

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike, prompt_key: str = "prompt", answer_key: str = "answer",
                   task_key: str = "task", default_task: str = "math",
                   extra_columns: Sequence[str] | None = None) -> "PromptDataset":
        """One JSON object per line; blank lines are ignored (not counted as malformed). `extra_columns`: the other
        columns to keep (None: all)."""

        def records():
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        yield f"line {lineno}", json.loads(line)
                    except json.JSONDecodeError as e:
                        yield f"line {lineno}", _Malformed(f"not JSON ({e.msg})", line.rstrip("\n"))

        keys = _Keys(prompt_key, answer_key, task_key, default_task, _frozen(extra_columns))
        return cls._collect(records(), os.fspath(path), keys)

    @classmethod
    def from_parquet(cls, path: str | os.PathLike, prompt_key: str = "prompt", answer_key: str = "answer",
                     task_key: str = "task", default_task: str = "math",
                     extra_columns: Sequence[str] | None = None) -> "PromptDataset":
        """Reads the prompt, answer (and task and reward, if present) columns and the other columns kept
        (`extra_columns`, None: all of a JSON-like type), batch by batch."""
        import pyarrow.parquet as pq

        f = pq.ParquetFile(path)
        schema = f.schema_arrow
        names = schema.names
        missing = [k for k in (prompt_key, answer_key) if k not in names]
        if missing:
            raise ValueError(f"{os.fspath(path)}: no column(s) {missing}; columns are {names}")
        keys = _Keys(prompt_key, answer_key, task_key, default_task, _frozen(extra_columns))
        extra = [k for k in names if keys.keep(k)]
        odd = [k for k in extra if not _json_type(schema.field(k).type)]
        if odd:
            logger.warning("%s: column(s) %s not read: not a JSON-like type (%s); cast them to strings to keep them",
                           os.fspath(path), odd, ", ".join(str(schema.field(k).type) for k in odd))
        columns = [prompt_key, answer_key] + [k for k in (task_key, REWARD_KEY) if k in names] + \
            [k for k in extra if k not in odd]

        def records():
            index = 0
            for batch in f.iter_batches(columns=columns):
                for record in batch.to_pylist():
                    yield f"row {index}", record
                    index += 1

        return cls._collect(records(), os.fspath(path), keys)

    @classmethod
    def from_file(cls, path: str | os.PathLike, **keys) -> "PromptDataset":
        """`from_parquet` for *.parquet, else `from_jsonl`."""
        loader = cls.from_parquet if os.fspath(path).endswith(".parquet") else cls.from_jsonl
        return loader(path, **keys)

    @classmethod
    def builtin(cls, task_names: Sequence[str] | str, n: int, seed: int) -> "PromptDataset":
        """n generated rows of the built-in tasks (see `jaxrl.data.tasks.make_suite`)."""
        names = [task_names] if isinstance(task_names, str) else list(task_names)
        rows = [dataclasses.asdict(ex) for ex in make_suite(names, n, seed)]
        return cls(rows, source=f"builtin({','.join(names)}, n={n}, seed={seed})")


def _frozen(columns: Sequence[str] | None) -> frozenset[str] | None:
    if isinstance(columns, str):
        raise TypeError(f"extra_columns={columns!r}: a list of column names (or None for all)")
    return None if columns is None else frozenset(columns)


def _json_type(t) -> bool:
    """Whether Arrow type `t` reads as JSON values (`to_pylist`): strings, numbers, booleans, nulls, and
    lists/structs of those (a dictionary-encoded column by its values)."""
    import pyarrow.types as pt

    if pt.is_null(t) or pt.is_boolean(t) or pt.is_integer(t) or pt.is_floating(t) or pt.is_string(t) \
            or pt.is_large_string(t):
        return True
    if pt.is_dictionary(t):
        return _json_type(t.value_type)
    if pt.is_list(t) or pt.is_large_list(t) or pt.is_fixed_size_list(t):
        return _json_type(t.value_type)
    if pt.is_struct(t):
        return all(_json_type(t.field(i).type) for i in range(t.num_fields))
    return False


@dataclasses.dataclass(frozen=True)
class _Malformed:
    reason: str
    raw: str

    def __str__(self) -> str:
        return self.reason
