"""A simulated RL step's record, a row's totals over its steps (summary.json's rows) and device utilisation."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxrl.train.pipeline import Timeline


@dataclasses.dataclass
class StepRecord:
    step: int
    kind: str = "sync"                  # round type: sync, short, long
    start: float = 0.0
    end: float = 0.0
    step_s: float = 0.0
    rollout_s: float = 0.0              # first engine step to the last
    reward_s: float = 0.0               # waiting for rewards after the last engine step
    forward_s: float = 0.0              # log-prob forwards (old policy, reference)
    train_s: float = 0.0                # the update (its part after the rollout)
    sync_s: float = 0.0
    driver_s: float = 0.0               # data plane: through the single driver, or DistFlow's repartition
    switch_s: float = 0.0               # PAT / planner relayouts
    engine_steps: int = 0
    preemptions: int = 0
    switches: int = 0
    tp: str = ""
    prompts: int = 0
    samples: int = 0
    response_tokens: int = 0
    max_response: int = 0
    aborted: int = 0
    wasted_tokens: int = 0
    queue: int = 0
    shrunk_at: float = 0.0              # stream trainer: fraction of requests finished when GPUs were freed (0: never)
    early_train_s: float = 0.0          # stream trainer / disaggregated: train work done while the rollout ran


def busy(timeline: Timeline, gen_gpus: int, train_gpus: int, total: float, disaggregated: bool) -> dict:
    """Device utilisation over the row: the generation GPUs' decode time, and the training side's stages
    (on the training pool, or on every GPU when colocated; the stream trainer's on the freed half)."""
    if total <= 0:
        return {"gen_busy": 0.0, "train_busy": 0.0}
    gen = sum(s.end - s.start for s in timeline.spans if s.pool.startswith("gen") and s.kind == "decode")
    train = sum((s.end - s.start) * train_gpus for s in timeline.spans
                if s.pool == "train" and s.kind in ("forward", "train", "grad"))
    train += sum((s.end - s.start) * gen_gpus / 2 for s in timeline.spans if s.pool == "freed")
    gpus = gen_gpus + train_gpus if disaggregated else gen_gpus
    return {"gen_busy": gen / (gen_gpus * total), "train_busy": train / (train_gpus * total),
            "gpu_busy": (gen + train) / (gpus * total)}


def summarize(records: list[StepRecord], mechanisms) -> dict:
    """A row of summary.json: totals and per-step means over the row's steps."""
    n = len(records)
    total = records[-1].end if records else 0.0
    prompts = sum(r.prompts for r in records)
    mean = lambda f: float(np.mean([getattr(r, f) for r in records])) if records else 0.0
    kinds = collections.Counter(r.kind for r in records)
    return {"mechanisms": list(mechanisms), "steps": n, "seconds": total, "step_s": total / max(n, 1),
            "s_per_prompt": total / max(prompts, 1), "rollout_s": mean("rollout_s"), "reward_s": mean("reward_s"),
            "forward_s": mean("forward_s"), "train_s": mean("train_s"), "sync_s": mean("sync_s"),
            "driver_s": mean("driver_s"), "switch_s": mean("switch_s"), "engine_steps": mean("engine_steps"),
            "preemptions": int(sum(r.preemptions for r in records)), "switches": int(sum(r.switches for r in records)),
            "rounds": dict(kinds), "tokens_per_s": sum(r.response_tokens for r in records) / max(total, 1e-9),
            "wasted_tokens": int(sum(r.wasted_tokens for r in records)),
            "max_response": int(max((r.max_response for r in records), default=0)),
            "early_train_s": mean("early_train_s")}
