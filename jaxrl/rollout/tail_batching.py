"""RollPacker's tail batching (paper §3): speculative short rounds, a long-prompt queue, long rounds.

In a synchronous step a few long responses hold the whole batch. Tail batching keeps them out of most
steps:

* a **short round** launches ⌈η_p·P0⌉ prompts × ⌈η_r·R0⌉ responses, keeps the first R0 finished
  responses of each prompt and the first P0 prompts to have R0 of them, and aborts everything else at
  once (pages freed). The prompts it did not keep join the **long-prompt queue**;
* when the queue holds ≥ P0 prompts, the next step is a **long round**: the P0 oldest queued prompts ×
  R0 responses, no speculation, run to completion.

Every prompt drawn is trained exactly once, in its short round or in a later long round (at any step,
drawn = trained ⊎ queued). With η_p = 1.25 the queue grows by P0/4 per short round: a period is four
short rounds and one long round, as in the paper.

"First to finish" is measured in generated tokens, not wall time: response j of a prompt finishes
before response j' when it is shorter (ties: the lower sample index), and prompts complete in the order
of their R0-th shortest response (ties: the earlier draw). When every live sequence decodes one
token per engine step — the race the paper runs — this is exactly the order in which they finish; and
unlike a wall-clock race it does not depend on the layout, the number of processes, preemptions or
admission delays, so a round's accepted set is the same on one process or several, after a resume, and
under any TP. The price: a sequence that lags (waiting for pages, preempted) is waited for until its
length proves it out of the race (`Race`: a live sequence with g tokens will have at least g + 1).

With several processes the accepted set is agreed globally (`Race.poll` gathers each process's
decided prompts and the lower bound of its undecided ones), and the queue is the same global list on
every process, dealt out by position in a long round, so every process runs the same program and the
checkpoint (process 0's `state_dict`) resumes under any process count.

DAPO's dynamic sampling (`Race(filter_equal=True)`) rides on the same race: a prompt counts towards
the P0 only once its kept group is scored (`scored(p, rewards)`) and its rewards are not all equal;
a group whose rewards are all equal is dropped (neither trained nor queued: it carries no gradient).
The order stays length-first, so the outcome depends on lengths and rewards only, never on timing.
When every prompt of the round is resolved and fewer than P0 are eligible, the round keeps all the
eligible ones; the caller then draws another wave (`jaxrl.train.rounds`).

Simplified relative to the paper: the queue is FIFO by the step a prompt was deferred (then dataset
index); the paper does not specify an order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from .partial_carry import Partial, from_state, pack, to_state, unpack

INF = 2**30       # above any length or key; int32-safe (multi-process gathers go through JAX, x64 off)
ROUND_KINDS = ("short", "long")


def launch_counts(P0: int, R0: int, eta_prompts: float, eta_responses: float, process_count: int = 1):
    """(prompts launched per process, responses launched per prompt) of a short round: ⌈η_p·P0⌉ rounded
    up to a multiple of the process count (every process draws the same number), and ⌈η_r·R0⌉."""
    prompts = math.ceil(eta_prompts * P0 - 1e-9)
    prompts = -(-prompts // process_count) * process_count
    return prompts // process_count, math.ceil(eta_responses * R0 - 1e-9)


@dataclasses.dataclass
class RoundPlan:
    """One step's rollout: `kind` ("short" or "long"), this process's prompt `rows` (dataset rows with their
    "index"), `responses` launched per prompt, `keep` (R0) kept per prompt and `accept` (P0, global)
    prompts kept; a long round keeps every prompt (`accept` = the global prompt count). `keys`: each
    row's position in the round's global order (row k of process r is k·processes + r, as the loader
    deals), unique even when a row is drawn twice: the race's tie-break."""

    kind: str
    rows: list[dict]
    responses: int
    keep: int
    accept: int
    keys: list[int]
    carried: list | None = None   # long round with carry_partial: per row (step deferred, [Partial]) or None


class Race:
    """Which responses and prompts of one round are kept, decided from response lengths as they grow.

    Call `finished(p, j, length)` when response j of local prompt p finishes, `progress(p, j, generated)`
    with live responses' generated counts, then `poll()` after each engine step: it returns the (p, j)
    to abort now — the extra responses of a prompt whose first R0 are known, and, once the global first
    P0 prompts are known, every response of the other prompts. `accepted` (local prompt indices) and
    `kept(p)` (sample indices, ascending) are final once `decided`.

    `keys[p]` is prompt p's global tie-break key (`RoundPlan.keys`); `gather(array)` returns the array
    of every process stacked on a new first axis (identity-stacked on one process). With several
    processes every process must call `poll` equally often until `decided` (it gathers each time).

    `filter_equal` (DAPO dynamic sampling): a decided prompt is eligible only after `scored(p, rewards)`
    with rewards not all equal. Once decided, `dropped` lists the all-equal prompts ahead of the cut-off
    (the others not accepted are the caller's to queue). If the whole round resolves with fewer than
    `accept` eligible prompts (globally), every eligible prompt is accepted and every all-equal one dropped.
    """

    def __init__(self, keys: Sequence[int], responses: int, keep: int, accept: int,
                 gather: Callable[[np.ndarray], np.ndarray] | None = None, *, filter_equal: bool = False):
        if keep > responses:
            raise ValueError(f"keep={keep} > responses={responses}")
        self.keys = [int(k) for k in keys]
        self.n, self.m, self.keep, self.accept = len(self.keys), responses, keep, accept
        self.gather = gather or (lambda a: a[None])
        self.final = np.full((self.n, self.m), -1, np.int64)      # final length, -1 while live
        self.lower = np.ones((self.n, self.m), np.int64)          # lower bound of the final length
        self.aborted = np.zeros((self.n, self.m), bool)
        self._kept: dict[int, list[int]] = {}                     # decided prompts: their first R0 responses
        self.filter_equal = filter_equal
        self._scored: set[int] = set()
        self._equal: set[int] = set()                             # scored groups whose rewards are all equal
        self.dropped: list[int] = []                              # final: the dropped ones (up to the cut-off)
        self.accepted: list[int] | None = None

    @property
    def decided(self) -> bool:
        return self.accepted is not None

    def finished(self, p: int, j: int, length: int) -> None:
        self.final[p, j] = self.lower[p, j] = length

    def progress(self, p: int, j: int, generated: int) -> None:
        if self.final[p, j] < 0:
            self.lower[p, j] = max(self.lower[p, j], generated + 1)

    @property
    def known(self) -> list[int]:
        """Prompts whose first R0 responses are known (`kept(p)` is final)."""
        return sorted(self._kept)

    def kept(self, p: int) -> list[int]:
        return sorted(self._kept[p])

    def scored(self, p: int, rewards) -> None:
        """Prompt p's kept group is scored (`rewards` in sample order); call once, after p is decided."""
        if p not in self._kept:
            raise ValueError(f"prompt {p} is scored before its first {self.keep} responses are known")
        if p in self._scored or self.decided:
            return
        self._scored.add(p)
        r = np.asarray(rewards)
        if self.filter_equal and r.size and bool(np.all(r == r.flat[0])):
            self._equal.add(p)

    def _resolved(self, p: int) -> bool:
        return p in self._kept and (not self.filter_equal or p in self._scored)

    def _eligible(self, p: int) -> bool:
        return self._resolved(p) and p not in self._equal

    def _decide_prompt(self, p: int) -> bool:
        """Prompt p's first R0 finishers are known when the R0-th shortest finished response beats every
        live response's lower bound (length, then sample index)."""
        if p in self._kept:
            return True
        done = [(int(self.final[p, j]), j) for j in range(self.m) if self.final[p, j] >= 0]
        if len(done) < self.keep:
            return False
        done.sort()
        cut = done[self.keep - 1]
        live = [(int(self.lower[p, j]), j) for j in range(self.m) if self.final[p, j] < 0 and not self.aborted[p, j]]
        if live and min(live) < cut:
            return False
        self._kept[p] = [j for _, j in done[:self.keep]]
        return True

    def _prompt_key(self, p: int) -> tuple[int, int]:
        """(R0-th shortest length, dataset index): exact for a decided prompt, a lower bound otherwise."""
        if p in self._kept:
            return int(max(self.final[p, j] for j in self._kept[p])), self.keys[p]
        return int(np.sort(self.lower[p])[self.keep - 1]), self.keys[p]

    def poll(self) -> list[tuple[int, int]]:
        """(p, j) pairs to abort now (each returned once); decides the accepted prompts when it can."""
        out = []
        for p in range(self.n):
            if p not in self._kept and self._decide_prompt(p):
                out += [(p, j) for j in range(self.m) if j not in self._kept[p] and self.final[p, j] < 0]
        if not self.decided:
            self._decide_round()
            if self.decided:
                drop = set(range(self.n)) - set(self.accepted)
                out += [(p, j) for p in sorted(drop) for j in range(self.m) if self.final[p, j] < 0]
        out = [(p, j) for p, j in dict.fromkeys(out) if not self.aborted[p, j]]
        for p, j in out:
            self.aborted[p, j] = True
        return out

    def _decide_round(self) -> None:
        """Global: the first `accept` prompts are known when the accept-th smallest decided key is below
        the lower bound of every undecided prompt on every process."""
        decided = sorted(self._prompt_key(p) for p in range(self.n) if self._eligible(p))[:self.accept]
        undecided = [self._prompt_key(p) for p in range(self.n) if not self._resolved(p)]
        local = np.full((self.accept + 1, 2), INF, np.int64)
        if decided:
            local[:len(decided)] = decided
        if undecided:
            local[self.accept] = min(undecided)
        every = np.asarray(self.gather(local)).reshape(-1, self.accept + 1, 2)
        keys = sorted(tuple(map(int, k)) for k in every[:, :self.accept].reshape(-1, 2) if k[0] < INF)
        bound = min(tuple(map(int, k)) for k in every[:, self.accept])
        if len(keys) < self.accept:
            if bound[0] >= INF:        # every prompt everywhere resolved (dynamic sampling): keep all eligible
                self.accepted = [p for p in range(self.n) if self._eligible(p)]
                self.dropped = sorted(self._equal)
            return
        cutoff = keys[self.accept - 1]
        if cutoff >= bound:
            return
        self.accepted = sorted(p for p in range(self.n) if self._eligible(p) and self._prompt_key(p) <= cutoff)
        # dropped: the all-equal groups before the cut-off (all resolved by then); those after it are queued
        # whether or not their rewards had come back, so the outcome never depends on reward timing
        self.dropped = sorted(p for p in self._equal if self._prompt_key(p) <= cutoff)


class TailBatcher:
    """Round planning and the long-prompt queue (global, identical on every process).

    `plan(next_rows, dataset, step)` picks the step's round: long when the queue holds ≥ P0 prompts
    (this process takes the P0 oldest entries at positions ≡ its index mod the process count), else
    short (`next_rows()` draws this process's ⌈η_p·P0⌉ / processes new rows). `settle(plan, accepted,
    step)` after the rollout queues a short round's prompts that were not kept (gathered from every
    process, so the queue stays global). `state_dict()` is the queue and counters: the checkpoint.

    `carry_partial` (`partial_carry`): `settle` also takes each deferred prompt's partial responses (up to
    R0, at most `max_tokens` tokens each), they travel with it in the queue (gathered, so every process
    holds all) and the long round's plan hands them back with the step they were deferred at (`carried`).
    """

    def __init__(self, prompts_per_step: int, group_size: int, eta_prompts: float = 1.25,
                 eta_responses: float = 1.25, *, process_index: int = 0, process_count: int = 1,
                 gather: Callable[[np.ndarray], np.ndarray] | None = None, carry_partial: bool = False,
                 max_tokens: int = 0):
        if eta_prompts < 1 or eta_responses < 1:
            raise ValueError(f"eta_prompts={eta_prompts}, eta_responses={eta_responses}: both must be >= 1")
        if prompts_per_step % process_count:
            raise ValueError(f"prompts_per_step={prompts_per_step} must divide over {process_count} processes")
        self.P0, self.R0 = prompts_per_step, group_size
        self.launch, self.responses = launch_counts(prompts_per_step, group_size, eta_prompts, eta_responses,
                                                    process_count)
        self.rank, self.procs = process_index, process_count
        self.gather = gather or (lambda a: a[None])
        self.queue: list[tuple[int, int]] = []        # (step deferred, dataset index), oldest first
        self.carried: list[list[Partial]] = []        # carry_partial: each queue entry's partial responses
        self.carry, self.max_tokens = carry_partial, max_tokens
        self.rounds = {"short": 0, "long": 0}

    def next_kind(self) -> str:
        """The next step's round: "long" when the queue holds P0 prompts (what `plan` will pick)."""
        return "long" if len(self.queue) >= self.P0 else "short"

    def plan(self, next_rows: Callable[[], list[dict]], dataset, step: int) -> RoundPlan:
        if self.next_kind() == "long":
            take, self.queue = self.queue[:self.P0], self.queue[self.P0:]
            rows = [{**dataset[i], "index": i} for _, i in take[self.rank::self.procs]]
            carried = None
            if self.carry:
                parts, self.carried = self.carried[:self.P0], self.carried[self.P0:]
                carried = [(s, c) for (s, _), c in zip(take, parts)][self.rank::self.procs]
            return RoundPlan("long", rows, self.R0, self.R0, self.P0, self._keys(len(rows)), carried)
        rows = next_rows()
        if len(rows) != self.launch:
            raise ValueError(f"a short round draws {self.launch} rows per process, got {len(rows)}")
        return RoundPlan("short", rows, self.responses, self.R0, self.P0, self._keys(len(rows)))

    def wave(self, next_rows: Callable[[], list[dict]], accept: int) -> RoundPlan:
        """Another speculative draw of the same short round (dynamic sampling's refill) racing for the
        `accept` prompts (global) the round still lacks."""
        rows = next_rows()
        if len(rows) != self.launch:
            raise ValueError(f"a short round draws {self.launch} rows per process, got {len(rows)}")
        return RoundPlan("short", rows, self.responses, self.R0, accept, self._keys(len(rows)))

    def _keys(self, n: int) -> list[int]:
        return [k * self.procs + self.rank for k in range(n)]

    def settle(self, plan: RoundPlan, accepted: Sequence[int], step: int, dropped: Sequence[int] = (), *,
               count: bool = True, partials: dict[int, list[Partial]] | None = None) -> list[int]:
        """Queue the short round's prompts this and every other process neither kept nor `dropped` (dynamic
        sampling's all-equal groups); returns the global list of dataset indices queued. `count=False`
        for a round's later waves (one round, however many waves). `partials` (carry_partial): local prompt
        index -> the responses it carries (`partial_carry.select`), for the prompts queued."""
        if count:
            self.rounds[plan.kind] += 1
        if plan.kind == "long":
            return []
        keep = set(accepted) | set(dropped)
        local = np.full(len(plan.rows), -1, np.int64)
        deferred = [k for k in range(len(plan.rows)) if k not in keep]
        local[:len(deferred)] = [plan.rows[k]["index"] for k in deferred]
        every = np.asarray(self.gather(local)).reshape(-1)
        order = sorted(range(len(every)), key=lambda n: (int(every[n]), n))
        queued = [int(every[n]) for n in order if every[n] >= 0]
        self.queue += [(step, i) for i in queued]
        if self.carry:
            ints = np.zeros((len(plan.rows), self.R0, 3 + 2 * self.max_tokens), np.int64)
            floats = np.zeros((len(plan.rows), self.R0, self.max_tokens), np.float64)
            for r, k in enumerate(deferred):
                ints[r], floats[r] = pack((partials or {}).get(k, []), self.R0, self.max_tokens)
            ints = np.asarray(self.gather(ints)).reshape(-1, *ints.shape[1:])
            floats = np.asarray(self.gather(floats)).reshape(-1, *floats.shape[1:])
            self.carried += [unpack(ints[n], floats[n]) for n in order if every[n] >= 0]
        return queued

    def state_dict(self) -> dict:
        out = {"queue": [list(e) for e in self.queue], "rounds": dict(self.rounds)}
        if self.carry:
            out["carried"] = [to_state(c) for c in self.carried]
        return out

    def load_state_dict(self, state: dict) -> None:
        self.queue = [(int(s), int(i)) for s, i in state["queue"]]
        self.rounds = {k: int(v) for k, v in state["rounds"].items()}
        if self.carry:     # (a checkpoint written without carry_partial: its queued prompts restart)
            self.carried = [from_state(c) for c in state.get("carried", [[] for _ in self.queue])]
