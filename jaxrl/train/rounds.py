"""One RL step's rollout under tail batching: the round, its race, DAPO dynamic sampling's waves, the queue.

`tail_round(tail, draw, dataset, step, rollout)` plans the step's round (`TailBatcher.plan`), runs it
(`rollout(rows, race, responses) -> (completions, rewards, stats)`, i.e. `rl.rollout_and_score`) and
settles the long-prompt queue. It returns the trained rows, in order, with their kept completions and
rewards, and the stats of every wave merged.

Dynamic sampling (DAPO, `rollout.tail_batching.dynamic_sampling`): a group whose rewards are all equal
has zero advantage everywhere and trains nothing, so it is dropped — neither trained nor queued — and
the batch is filled from more draws:

* a short round's race counts a prompt towards the P0 only once its group is scored and not all equal
  (`Race(filter_equal=True)`); if the whole round resolves with fewer than P0 eligible prompts (over all
  processes), it keeps them all and another wave of ⌈η_p·P0⌉ fresh prompts races for the rest, up to
  `max_waves` waves. Each wave's slow prompts join the queue as in a plain short round;
* a long round (queued prompts, no speculation) drops its all-equal groups and is not refilled.

Carried partial responses (`rollout.tail_batching.carry_partial`, `jaxrl.rollout.partial_carry`): a short
round's deferred prompts take their partial responses into the queue (`TailBatcher.settle`), and the long
round resumes them after the staleness rule (`resumed`).

Every drawn prompt ends in exactly one of trained, queued or dropped. A batch still short of P0 after
`max_waves` (or a long round's drops) trains what it has: `batch_short` counts the missing prompts
(DAPO's `max_num_gen_batches` behaves alike). Simplified relative to DAPO: the waves refill a short
round only, and a wave is a whole speculative draw (not a bare batch of prompts).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import numpy as np

from jaxrl.rollout.partial_carry import apply_staleness
from jaxrl.rollout.tail_batching import Race, RoundPlan, TailBatcher

from .distributed import global_sum
from .trajectories import merge_counters

_SUMMED = ("items", "timeouts", "crashes", "seconds", "engine_steps", "aborted", "aborted_tokens", "wasted_tokens")


@dataclasses.dataclass
class RoundResult:
    """The step's trained rows (this process), their kept completions (row-major, `keep` per row) and
    rewards, the first wave's plan and the merged stats: `accepted` (the first wave's accepted positions
    in its rows: what the stream trainer's hooks index), `launched` (local prompts launched over the waves),
    `queued` (global dataset indices), `dropped` (local count), `waves` and `batch_short` (global)."""

    plan: RoundPlan
    rows: list[dict]
    completions: list
    rewards: np.ndarray
    stats: dict


def equal_groups(rewards: np.ndarray, group: int) -> list[int]:
    """Groups (consecutive runs of `group` rewards) whose rewards are all equal."""
    r = np.asarray(rewards).reshape(-1, group)
    return [p for p in range(len(r)) if bool(np.all(r[p] == r[p, 0]))]


def resumed(carried, step: int, max_staleness: int, rule: str) -> tuple[list | None, dict]:
    """A long round's carried partials (`RoundPlan.carried`) after the staleness rule (`partial_carry.
    apply_staleness`), with the counts summed over this process's prompts: carried responses and tokens
    resumed, and those dropped or kept with their correction."""
    counts = dict(carried_samples=0, carried_tokens=0, stale_dropped=0, stale_corrected=0)
    if carried is None:
        return None, counts
    out = []
    for entry in carried:
        if entry is None or not entry[1]:
            out.append(None)
            continue
        kept, c = apply_staleness(entry[1], step, max_staleness, rule)
        counts["stale_dropped"] += c["dropped"]
        counts["stale_corrected"] += c["corrected"]
        counts["carried_samples"] += len(kept)
        counts["carried_tokens"] += sum(len(p.tokens) for p in kept)
        out.append((entry[0], kept) if kept else None)
    return out, counts


def tail_round(tail: TailBatcher, draw: Callable[[], list[dict]], dataset, step: int, rollout, *,
               dynamic_sampling: bool = False, max_waves: int = 1, gather=None,
               staleness: tuple[int, str] = (0, "drop")) -> RoundResult:
    """`staleness`: (trainer.max_staleness, trainer.stale_samples), the rule for carried partial responses."""
    plan = tail.plan(draw, dataset, step)
    if plan.kind == "long":
        carried, counts = resumed(plan.carried, step, *staleness)
        comps, rewards, st = rollout(plan.rows, None, plan.responses,
                                     **({} if carried is None else {"carried": carried}))
        st = dict(st, queued=tail.settle(plan, st["accepted"], step), waves=1, **counts)
        dropped = equal_groups(rewards, plan.keep) if dynamic_sampling else []
        keep = [p for p in range(len(plan.rows)) if p not in dropped]
        comps = [c for p in keep for c in comps[p * plan.keep:(p + 1) * plan.keep]]
        rewards = np.asarray(rewards).reshape(-1, plan.keep)[keep].reshape(-1)
        st.update(accepted=keep, dropped=len(dropped), launched=len(plan.rows),
                  batch_short=int(global_sum([len(dropped)])[0]) if dynamic_sampling else 0)
        return RoundResult(plan, [plan.rows[p] for p in keep], comps, rewards, st)

    rows, comps, rewards, merged = [], [], [], {k: 0 for k in _SUMMED}
    merged.update(first_error="", queued=[], accepted=[], dropped=0, waves=0, launched=0, carried_samples=0,
                  carried_tokens=0, stale_dropped=0, stale_corrected=0)
    wave, trained = plan, 0                    # trained: global prompts accepted so far
    while True:
        race = Race(wave.keys, wave.responses, wave.keep, wave.accept, gather=gather, filter_equal=dynamic_sampling)
        c, r, st = rollout(wave.rows, race, wave.responses)
        merged["queued"] += tail.settle(wave, st["accepted"], step, st["dropped"], count=merged["waves"] == 0,
                                        partials=st.get("partials"))
        if merged["waves"] == 0:
            merged["accepted"] = list(st["accepted"])       # hooks (the stream trainer) see the first wave only
        merged["waves"] += 1
        merged["launched"] += len(wave.rows)
        for k in _SUMMED:
            merged[k] += st[k]
        merged["first_error"] = merged["first_error"] or st["first_error"]
        if "env" in st:                        # multi-turn counters
            merged["env"] = merge_counters(merged.get("env", Counter()), st["env"])
        merged["dropped"] += len(st["dropped"])
        rows += [wave.rows[p] for p in st["accepted"]]
        comps += c
        rewards.append(np.asarray(r, np.float32))
        trained += int(global_sum([len(st["accepted"])])[0])
        if not dynamic_sampling or trained >= tail.P0 or merged["waves"] >= max_waves:
            break
        wave = tail.wave(draw, accept=tail.P0 - trained)
    merged["batch_short"] = tail.P0 - trained
    return RoundResult(plan, rows, comps, np.concatenate(rewards), merged)
