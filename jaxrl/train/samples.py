"""Completions you can read: a few of each RL step's samples, and each evaluation's worst and best, in
`run_dir/samples.jsonl` and as TensorBoard text (what TRL's `log_completions` and verl's logged generations
show).

    log = SamplesLog(run_dir, is_main=..., resume_step=k)
    log.write(step, "train", [dict(prompt=..., completion=..., reward=..., answer=..., tokens=...)])

`samples.jsonl` holds one JSON object per completion: `{"step", "kind", "prompt", "completion", "reward",
"answer", "tokens", "finish_reason", "index"}`; `kind` is "train" (the step's rollout), "eval_worst" or
"eval_best". The text goes to `run_dir/tb/samples/` (its own TensorBoard run, under the Text tab), one
markdown table per step and kind. A resumed run keeps the lines of the steps before it and rebuilds the text
events from them, as `MetricsLogger` does for the scalars. Main process only: each process holds its own
samples, and only process 0's are written (every process sees the same kinds of completion).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from tensorboard.compat.proto import event_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.plugins.text import metadata as text_metadata
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from .metrics import truncate_jsonl

FIELDS = ("prompt", "completion", "reward", "answer", "tokens", "finish_reason", "index")
_CELL = 400          # characters of a prompt or completion in a TensorBoard table cell


def spread(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n) (all of them when k >= n): the first, the last and between."""
    if k <= 0 or n <= 0:
        return []
    if k >= n:
        return list(range(n))
    return sorted({int(i) for i in np.linspace(0, n - 1, k).round()})


def _cell(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    text = text if len(text) <= _CELL else text[:_CELL - 3] + "..."
    return text.replace("|", "\\|").replace("\n", "⏎ ")


def table(records: list[dict]) -> str:
    """A markdown table of `records` (prompt, completion, reward, answer): what TensorBoard's Text tab shows."""
    head = "| prompt | completion | reward | answer |\n|---|---|---|---|\n"
    rows = [f"| {_cell(r.get('prompt', ''))} | {_cell(r.get('completion', ''))} | {r.get('reward', 0.0):.3f} | "
            f"{_cell(r.get('answer', ''))} |" for r in records]
    return head + "\n".join(rows)


class SamplesLog:
    """`run_dir/samples.jsonl` and `run_dir/tb/samples/` (text); a no-op on processes other than the main one."""

    def __init__(self, run_dir: str | Path, *, is_main: bool = True, resume_step: int | None = None):
        self.path = Path(run_dir) / "samples.jsonl"
        self._file = self._tb = None
        if not is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = truncate_jsonl(self.path, 0 if resume_step is None else int(resume_step))
        self._file = open(self.path, "a")
        tb_dir = self.path.parent / "tb" / "samples"
        stale = sorted(tb_dir.glob("events.out.tfevents.*")) if tb_dir.exists() else []
        self._tb = EventFileWriter(str(tb_dir))
        by_step: dict[tuple[int, str], list[dict]] = {}
        for row in kept:
            by_step.setdefault((row["step"], row.get("kind", "train")), []).append(row)
        for (step, kind), records in sorted(by_step.items()):
            self._text(step, kind, records, records[0].get("time"))
        self._tb.flush()
        for f in stale:
            f.unlink()

    def write(self, step: int, kind: str, records: list[dict]) -> None:
        """Append `records` (dicts with `FIELDS`) of `step` as `kind`, and their table as TensorBoard text."""
        if self._file is None or not records:
            return
        now = round(time.time(), 3)
        for r in records:
            line = {"step": int(step), "time": now, "kind": kind, **{k: r[k] for k in FIELDS if k in r}}
            self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        self._text(step, kind, records, now)
        self._tb.flush()

    def _text(self, step: int, kind: str, records: list[dict], wall_time: float | None) -> None:
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[table(records).encode()],
                                        tensor_shape=tensor_shape_pb2.TensorShapeProto())
        event = event_pb2.Event(wall_time=wall_time or time.time(), step=int(step))
        event.summary.value.add(tag=f"samples/{kind}", tensor=tensor,
                                metadata=text_metadata.create_summary_metadata(display_name=f"samples/{kind}",
                                                                               description=""))
        self._tb.add_event(event)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def step_records(data, tokenizer, k: int) -> list[dict]:
    """`k` of a step's completions (spread over its prompt-major batch), as `SamplesLog` records."""
    comps, rows, G = data.completions, data.rows, max(data.group_size, 1)
    out = []
    for i in spread(len(comps), k):
        c, row = comps[i], rows[i // G] if i // G < len(rows) else {}
        out.append(dict(prompt=row.get("prompt", ""), completion=tokenizer.decode(c.tokens),
                        reward=float(np.asarray(data.rewards)[i]) if data.rewards is not None else 0.0,
                        answer=row.get("answer", ""), tokens=len(c.tokens), finish_reason=c.finish_reason,
                        index=int(row.get("index", -1))))
    return out
