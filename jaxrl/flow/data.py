"""What one RL step's nodes share on this process (DistFlow's databuffer, §5): every node reads its deps'
outputs from a `StepData` and writes its own there. It holds only this process's shard of the step: the
rows this process loaded, its rollouts, their rewards and advantages, its training samples. Moving data
between processes is the databuffer's job (`jaxrl.flow.databuffer`), on the devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np



@dataclasses.dataclass
class StepData:
    step: int
    rows: list[dict] = dataclasses.field(default_factory=list)          # the dataset rows trained, prompt order
    prompts: list[list[int]] = dataclasses.field(default_factory=list)  # their token ids
    completions: list = dataclasses.field(default_factory=list)         # rollout.Completion, prompt-major (p*G + g)
    rewards: np.ndarray | None = None                                   # [len(completions)] float32
    stats: dict = dataclasses.field(default_factory=dict)               # the rollout's and rewards' stats
    plan: Any = None                        # tail batching's round plan (None: a plain synchronous step)
    version: int = 0                        # the weights version that generated the rollout
    group_size: int = 1
    advantages: list[np.ndarray] | None = None    # per sample, per response token
    samples: list | None = None             # train.batch.Sample, one per completion
    values: list[np.ndarray] | None = None  # critic: per sample, per response token (V at rollout time)
    returns: list[np.ndarray] | None = None  # GAE: per sample, per response token (the critic's targets)
    kl: list[np.ndarray] | None = None      # algo.kl_in_reward: per sample, KL to the reference per response token
    teacher_logp: list[np.ndarray] | None = None   # opd: per sample, the teacher's log-prob per response token
    student_logp: list[np.ndarray] | None = None   # opd (student_logp=trainer): the trainer's, per response token
    train_metrics: dict | None = None       # the update's statistics (host values)
    metrics: dict = dataclasses.field(default_factory=dict)     # extra per-step metrics written by nodes
    train_wait_s: float = 0.0               # StreamRL: time the step waited for the train pool
    extra: dict = dataclasses.field(default_factory=dict)       # user nodes' own outputs
    times: dict = dataclasses.field(default_factory=dict)       # the runner's: node id -> (start, end)
    cache: dict = dataclasses.field(default_factory=dict)       # packed batches (built once, `jaxrl.flow.nodes`)

    @property
    def lens(self) -> list[int]:
        return [len(c.tokens) for c in self.completions]

    @property
    def groups(self) -> int:
        return len(self.completions) // max(self.group_size, 1)

    def keep_groups(self, keep) -> int:
        """Keep the prompt groups where `keep[p]` is true (rows, prompts, completions, rewards and whatever
        per-sample outputs exist), in order; returns how many were dropped. Packed batches are rebuilt."""
        keep = [bool(k) for k in keep]
        if len(keep) != self.groups:
            raise ValueError(f"keep_groups: {len(keep)} flags for {self.groups} groups")
        G = self.group_size
        self.extra.setdefault("rollout", (np.asarray(self.rewards), self.lens))    # the step's metrics use all
        idx = [g * G + j for g, k in enumerate(keep) if k for j in range(G)]
        self.rows = [r for r, k in zip(self.rows, keep) if k]
        self.prompts = [p for p, k in zip(self.prompts, keep) if k]
        self.completions = [self.completions[i] for i in idx]
        if self.rewards is not None:
            self.rewards = np.asarray(self.rewards)[idx]
        for name in ("advantages", "samples", "values", "returns", "kl", "teacher_logp", "student_logp"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, [v[i] for i in idx])
        self.cache.clear()
        return keep.count(False)
