"""Rollout engine: paged-KV continuous batching on sharded instances whose state can move.

    from jaxrl.rollout import generate, SamplingParams
    outs = generate(cfg, weights, prompts, SamplingParams(max_new_tokens=32, temperature=0.0), tp=1, instances=1)

An instance is a host `Scheduler` (pure Python; live sequences are `SequenceState` values), a `KVStore`
(the paged pool, a sharded pytree) and an `Executor` (compiled steps from an explicit cache);
`RolloutService` adds routing, pause/detach/attach, relayout and weight updates.
"""

from .executor import CACHE, ExecutableCache, Executor
from .instance import Completion, Instance
from .kv_store import KVStore, SequenceKV, move_bytes, move_pages
from .migration import MoveReport, RelayoutReport
from .params import SamplingParams
from .scheduler import Scheduler, SchedulerSnapshot, SequenceState
from .service import RolloutService, generate

__all__ = ["CACHE", "Completion", "ExecutableCache", "Executor", "Instance", "KVStore", "MoveReport",
           "RelayoutReport", "RolloutService", "SamplingParams", "Scheduler", "SchedulerSnapshot", "SequenceKV", "SequenceState",
           "generate", "move_bytes", "move_pages"]
