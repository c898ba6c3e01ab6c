"""RewardScheduler: per-response scoring as responses finish, per-group completion, cancellation, and
adaptive code timeouts (RollPacker §4.3, "reward scheduler"), on top of `RewardPool`.

    sched = RewardScheduler(pool, AdaptiveTimeouts(1.5, 2.0, 30.0), limits=SandboxLimits())
    for c in engine.stream():                                      # as each response finishes
        sched.submit(c.request_id, reward_item(name, text, row), group=p, group_size=G)   # (registry)
        out = sched.poll()                                         # never blocks
        out.responses   # [ScoredResponse(key, group, score, status, error, seconds, elapsed_s, info)]
        out.groups      # [CompletedGroup(group, keys, scores, elapsed_s, wait_s)]: every member scored
    sched.cancel(key)          # an aborted response (the group then completes without it)
    sched.cancel_group(p)      # an aborted prompt (re-queued elsewhere): no result, no completion
    out = sched.drain()        # after the rollout: wait for everything still pending
    metrics = sched.metrics()  # reward/... counters since the last call; state_dict() -> checkpoint

* **Per response, as it finishes**: `submit` hands the item to the pool at once; `poll` returns scored
  responses in completion order, each with `seconds` (how long it ran) and `elapsed_s` (since submit).
* **Per group, as soon as it completes**: a group of `group_size` responses (a prompt's samples) is
  reported by the `poll` that returns its last member's score, so group-normalised advantages (GRPO)
  and a streaming trainer can use a prompt before the whole batch is scored. A group id may be reused
  once its group completed or was cancelled (e.g. prompt slots of the next step).
* **Cancel**: `cancel(key)` withdraws a response whose generation was aborted or that is no longer
  wanted. Queued: dropped. Running: a *code* item's worker is SIGKILLed and replaced (taking its sandbox
  down; a hung program must not hold a worker for T_max), any other item's result is discarded when it
  arrives (a math check ends in milliseconds; a worker restart costs more). Already scored but its group
  not complete: taken out of the group. With `shrink=True` (default) the group's expected size drops by
  one, so it completes with its remaining members; `shrink=False` keeps the size (a replacement will be
  submitted). `resize_group(g, n)` sets the size directly (tail batching keeping the first R0 of ηR0
  samples); `cancel_group(g)` drops a whole prompt.
* **Adaptive timeouts**: for items whose reward is `"code"`, each test case gets
  `timeouts.timeout_for(case_key)` (T = min(max(T_min, λ·T_anchor), T_max)), sent with the item
  (`extra`), and the pool's timeout for the item is their sum plus a per-case allowance. Each returned
  case's run time updates its anchor when the case passed. `state_dict()` holds the anchors.
* **Counters** (`metrics()`): scored items, pool timeouts/crashes, cancellations (by where they were),
  sandbox case outcomes by status and reason (`reward/case_killed/memory`, `reward/case_timeout/wall_time`,
  ...), the adaptive timeouts given out, and the seconds they saved against T_max on cases that timed out.

Single-threaded: call it from the loop that drives the rollout. Simplified relative to RollPacker: no
GPU sharing for judge models; items go to workers FIFO, not by predicted cost.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import time
from typing import Any, Hashable, Mapping, NamedTuple, Sequence

from .code import case_keys
from .pool import RewardItem, RewardPool
from .sandbox import SandboxLimits
from .timeouts import AdaptiveTimeouts

CODE_FNS = ("code",)
_SLUG = re.compile(r"[^A-Za-z0-9_.]+")


class ScoredResponse(NamedTuple):
    key: Hashable
    group: Hashable | None
    score: float
    status: str            # the pool's: ok | timeout | crash
    error: str             # its cause ("" when ok)
    seconds: float         # time it ran in a worker
    elapsed_s: float       # submit to result
    info: dict | None      # the reward's details (code: per-case status/reason/seconds/correct)


class CompletedGroup(NamedTuple):
    group: Hashable
    keys: list             # its members, in submission order (cancelled ones left out)
    scores: list           # their scores, same order
    elapsed_s: float       # first submit to last score
    wait_s: float          # last submit to last score: the reward time the rollout did not hide


class Polled(NamedTuple):
    responses: list        # [ScoredResponse]
    groups: list           # [CompletedGroup]


@dataclasses.dataclass
class _Pending:
    item_id: int
    group: Hashable | None
    submitted: float
    cases: list[str]       # adaptive-timeout case keys (code items), else []
    timeouts: list[float]
    code: bool


@dataclasses.dataclass
class _Group:
    size: int
    members: list = dataclasses.field(default_factory=list)   # live keys, submission order
    scores: dict = dataclasses.field(default_factory=dict)    # key -> score, once scored
    first: float = math.inf
    last: float = 0.0

    def complete(self) -> bool:
        return 0 < self.size == len(self.members) == len(self.scores)


class RewardScheduler:
    """See the module docstring. `timeouts`: the adaptive policy (None: a fixed T_max of 30 s per case,
    i.e. `AdaptiveTimeouts(enabled=False)`); `limits`: the sandbox limits sent with code items;
    `case_overhead_s`: per-case allowance (sandbox start, teardown) added to a code item's pool timeout."""

    def __init__(self, pool: RewardPool, timeouts: AdaptiveTimeouts | None = None, *,
                 limits: SandboxLimits | None = None, code_fns: Sequence[str] = CODE_FNS,
                 case_overhead_s: float = 1.0):
        self.pool = pool
        self.timeouts = timeouts if timeouts is not None else AdaptiveTimeouts(enabled=False)
        self.limits = limits if limits is not None else SandboxLimits()
        self.code_fns = tuple(code_fns)
        self.case_overhead_s = float(case_overhead_s)
        self._items: dict[Hashable, _Pending] = {}
        self._keys: dict[int, Hashable] = {}                  # pool id -> key
        self._groups: dict[Hashable, _Group] = {}
        self._member: dict[Hashable, Hashable] = {}           # key -> group, until the group completes
        self._ready: list[CompletedGroup] = []                # completed by a cancel/resize, for next poll
        self._counts: collections.Counter = collections.Counter()
        self._given: list[float] = []                         # timeouts handed out since metrics()

    @classmethod
    def from_config(cls, section, pool: RewardPool) -> RewardScheduler:
        """The scheduler over `pool` a `jaxrl.config.train.RewardSection` describes: per-response scoring with
        cancellation and, for code rewards, its sandbox limits and adaptive per-test-case timeouts (anchors
        kept across steps)."""
        return cls(pool, AdaptiveTimeouts.from_config(section.adaptive_timeout),
                   limits=SandboxLimits.from_config(section.sandbox))

    # ------------------------------------------------------------------ submit / cancel
    def submit(self, key: Hashable, item: Sequence, *, group: Hashable | None = None,
               group_size: int | None = None) -> None:
        """Score `item` = `(fn, response, answer, task[, extra])` (`registry.reward_item`) for the finished
        response `key` (unique among pending keys). `group`/`group_size`: its prompt and how many responses complete
        the group (needed with the group's first member; later ones may repeat it)."""
        if key in self._items or key in self._member:
            raise ValueError(f"response {key!r} is already submitted")
        it = RewardItem(*item)
        g = None
        if group is not None:
            g = self._groups.get(group)
            if g is None:
                if group_size is None or group_size < 1:
                    raise ValueError(f"group {group!r}: its first submit needs group_size >= 1, got {group_size}")
                g = _Group(int(group_size))
            elif group_size is not None and group_size != g.size:
                raise ValueError(f"group {group!r} has size {g.size}, not {group_size} (resize_group changes it)")
            if len(g.members) >= g.size:
                raise ValueError(f"group {group!r} already has its {g.size} members")
        cases, timeouts, pool_timeout = [], [], None
        code = it.fn in self.code_fns
        if code:
            try:
                cases = case_keys(it.answer)
            except ValueError:
                cases = []   # malformed test cases: the reward raises in the worker, counted as a crash
            if cases:
                timeouts = [self.timeouts.timeout_for(c) for c in cases]
                extra = dict(it.extra or {}, timeouts=timeouts, details=True,     # (after the row's values)
                             limits=dataclasses.asdict(self.limits))
                it = it._replace(extra=extra)
                pool_timeout = sum(timeouts) + self.case_overhead_s * len(cases) + self.limits.grace_s
                self._given += timeouts
        item_id = self.pool.submit(it, timeout_s=pool_timeout)
        now = time.monotonic()
        self._items[key] = _Pending(item_id, group, now, cases, timeouts, code)
        self._keys[item_id] = key
        if g is not None:
            self._groups[group] = g
            g.members.append(key)
            g.first, g.last = min(g.first, now), now
            self._member[key] = group
        self._counts["submitted"] += 1

    def cancel(self, key: Hashable, *, shrink: bool = True) -> str:
        """Withdraw response `key`; returns where it was ("queued", "running", "done": scored by the pool
        but not yet polled, "scored": already returned, its group not complete, "unknown")."""
        p = self._items.pop(key, None)
        if p is not None:
            self._keys.pop(p.item_id, None)
            where = self.pool.cancel(p.item_id, kill_running=p.code)
            where = "done" if where == "unknown" else where
        elif key in self._member:
            where = "scored"
        else:
            return "unknown"
        self._counts[f"cancelled/{where}"] += 1
        group = self._member.pop(key, None)
        if group is not None:
            g = self._groups[group]
            g.members.remove(key)
            g.scores.pop(key, None)
            if shrink:
                g.size -= 1
            self._settle(group)
        return where

    def cancel_group(self, group: Hashable) -> int:
        """Withdraw every member of `group` (an aborted prompt); it will not be reported. Returns how many
        members were withdrawn."""
        g = self._groups.get(group)
        if g is None:
            return 0
        members = list(g.members)
        for key in members:
            self.cancel(key, shrink=False)
        self._groups.pop(group, None)
        return len(members)

    def resize_group(self, group: Hashable, size: int) -> None:
        """Set how many responses complete `group` (>= its live members: cancel extra ones first)."""
        g = self._groups.get(group)
        if g is None:
            raise KeyError(f"unknown group {group!r}")
        if size < len(g.members):
            raise ValueError(f"group {group!r} has {len(g.members)} live members; cancel some before "
                             f"resizing to {size}")
        g.size = int(size)
        self._settle(group)

    # ------------------------------------------------------------------ results
    def poll(self, timeout: float = 0.0) -> Polled:
        """Responses scored since the last call (completion order) and the groups they completed; waits
        up to `timeout` seconds for at least one when something is pending."""
        out = Polled([], self._ready)
        self._ready = []
        results = self.pool.poll(timeout) if self._items else self.pool.poll(0.0)
        for r in results:
            key = self._keys.pop(r.id, None)
            p = self._items.pop(key, None) if key is not None else None
            if p is None:
                continue   # cancelled meanwhile, or an item submitted to the pool by someone else
            self._count(r, p)
            out.responses.append(ScoredResponse(key, p.group, r.score, r.status, r.error, r.seconds,
                                                r.latency_s, r.info))
            if p.group is not None:
                g = self._groups[p.group]
                g.scores[key] = r.score
                done = self._settle(p.group, report=False)
                if done is not None:
                    out.groups.append(done)
        return out

    def drain(self, timeout: float | None = None) -> Polled:
        """`poll` until nothing is pending (or `timeout` seconds pass); everything it returned."""
        end = math.inf if timeout is None else time.monotonic() + timeout
        out = self.poll()
        while self._items and time.monotonic() < end:
            more = self.poll(timeout=min(1.0, max(0.0, end - time.monotonic())))
            out.responses.extend(more.responses)
            out.groups.extend(more.groups)
        return out

    @property
    def pending(self) -> int:
        """Submitted responses not yet returned by `poll`."""
        return len(self._items)

    def _settle(self, group: Hashable, report: bool = True) -> CompletedGroup | None:
        """Finish `group` if complete (or drop it if empty); `report`: queue it for the next poll."""
        g = self._groups.get(group)
        if g is None:
            return None
        if g.size <= 0 and not g.members:
            del self._groups[group]
            return None
        if not g.complete():
            return None
        del self._groups[group]
        for key in g.members:
            self._member.pop(key, None)
        now = time.monotonic()
        done = CompletedGroup(group, list(g.members), [g.scores[k] for k in g.members], now - g.first, now - g.last)
        if report:
            self._ready.append(done)
        return done

    def _count(self, r, p: _Pending) -> None:
        c = self._counts
        c["items"] += 1
        c[f"status/{r.status}"] += 1
        c["elapsed_s"] += r.latency_s
        if not p.code or not isinstance(r.info, Mapping):
            return
        t_max = self.timeouts.t_max
        for i, case in enumerate(r.info.get("cases", [])[:len(p.cases)]):
            self.timeouts.observe(p.cases[i], float(case["seconds"]), bool(case["correct"]))
            c["case_runs"] += 1
            status, reason = case["status"], case["reason"]
            if status == "ok":
                c["case_ok" if case["correct"] else "case_wrong"] += 1
            else:
                c[f"case_{status}/{_SLUG.sub('_', reason) or 'none'}"] += 1
            if status == "timeout":
                c["case_timeouts"] += 1
                c["saved_s"] += max(0.0, t_max - p.timeouts[i])
        c["case_skipped"] += int(r.info.get("skipped", 0))

    # ------------------------------------------------------------------ metrics / state
    def metrics(self, reset: bool = True) -> dict[str, float]:
        """`reward/...` counters since the last call (`reset=False`: keep counting)."""
        c = self._counts
        m: dict[str, float] = {f"reward/{k}": float(v) for k, v in sorted(c.items()) if k != "elapsed_s"}
        m["reward/cancelled"] = float(sum(v for k, v in c.items() if k.startswith("cancelled/")))
        m["reward/timeouts"] = float(c["status/timeout"])
        m["reward/crashes"] = float(c["status/crash"])
        if c["items"]:
            m["reward/elapsed_mean_s"] = c["elapsed_s"] / c["items"]
        if self._given:
            m["reward/adaptive_timeout_mean_s"] = sum(self._given) / len(self._given)
            m["reward/adaptive_timeout_max_s"] = max(self._given)
        m["reward/anchored_cases"] = float(len(self.timeouts))
        if reset:
            self._counts = collections.Counter()
            self._given = []
        return m

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: the adaptive timeouts' anchors (what a resumed run needs)."""
        return {"timeouts": self.timeouts.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.timeouts.load_state_dict(state["timeouts"])
