"""A step's rollout as one loop over component hooks: requests in, engine steps, completions to their scorer,
groups out. Mechanisms join it as components (`jaxrl.train.rollout_components`), never as new arguments.

    loop = RolloutLoop(svc, Requests.from_config(cfg, step, eos_ids), scorer, selection, hooks)
    completions, rewards, stats = loop.run(prompts, rows)

Three kinds of part, each with a fixed interface:

* the **scorer** (exactly one) decides who scores a finished response and when: the reward pool as responses
  finish (`StreamedRewards`), nobody (`NoScores`: a graph scores the batch afterwards) or the environments of a
  multi-turn round (`TrajectoryScores`). It declares `streams` (rewards arrive during the rollout);
* the **selection** (at most one; `KeepAll` by default) decides what the rollout returns: every response, or
  what tail batching's race keeps (`RaceSelection`: it aborts the rest as they lose);
* **hooks** (any number, called in registration order), the points where today's mechanisms act:

  | hook | when | who uses it |
  |---|---|---|
  | `place(state, prompts)` | prompts chosen | StreamRL's skew-aware placement |
  | `request(state, p, row, params)` | a request is made | per-prompt params, multi-turn stops |
  | `resume(state, p, ids, params, where)` | ... or taken over | carried partial responses |
  | `started(state, p, group, params)` | it is in the engine | multi-turn trajectories |
  | `begin(state)` / `idle(state)` / `pending(state)` | the loop starts / has no engine work / may end | PAT's agreed ticks |
  | `engine_step(state)` | after each engine step | RollPacker's stream-trainer milestones |
  | `group(state, p, completions, rewards)` | a prompt's kept responses are all scored | gradient streams |
  | `done(state, stats)` | the rollout is over | carried partials out |

A part that needs the rewards as they come (`needs_streamed_rewards`) is refused with a scorer that does not
stream, in one line naming both. The loop is the single rollout path of training, evaluation and the simulator.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time

import numpy as np

from jaxrl.config.train import TrainConfig
from jaxrl.rollout import Completion, SamplingParams


def request_seed(run_seed: int, step: int, row_index: int) -> int:
    """A prompt's request seed: the same whatever the number of processes, instances or TP size."""
    digest = hashlib.blake2b(f"{run_seed}:{step}:{row_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def uses_rollout_kv(cfg: TrainConfig) -> bool:
    """MetroRLHF consumes the rollout's K/V (the engine then exports each completion's on the devices)."""
    return cfg.trainer.backward == "blockwise" and cfg.trainer.kv_source == "rollout"


@dataclasses.dataclass(frozen=True)
class Requests:
    """How each prompt's request is made: `sampling` (the `rollout` section), `n` samples, seeded from
    (`seed`, `step`, the row's dataset index), stopping at `stop`, exporting K/V when `return_kv`."""

    sampling: object
    n: int
    seed: int
    step: int
    stop: tuple
    return_kv: bool = False

    @classmethod
    def from_config(cls, cfg: TrainConfig, step: int, eos_ids, responses: int | None = None) -> "Requests":
        return cls(cfg.rollout, responses or cfg.algo.group_size, cfg.seed, step, tuple(eos_ids),
                   uses_rollout_kv(cfg))

    def params(self, row: dict) -> SamplingParams:
        return SamplingParams.from_config(self.sampling, n=self.n, stop_token_ids=self.stop,
                                          seed=request_seed(self.seed, self.step, int(row["index"])),
                                          return_kv=self.return_kv)


class Hooks:
    """A component's part in the rollout loop: override the hooks it acts on (the others do nothing).
    `needs_streamed_rewards`: it reads rewards during the rollout (refused with a scorer that does not stream)."""

    needs_streamed_rewards = False

    def place(self, state: "RolloutState", prompts: list[list[int]]) -> list[dict] | None:
        """Each prompt's `svc.add` placement (instance, priority), or None to leave it to the engine."""
        return None

    def request(self, state: "RolloutState", p: int, row: dict, params: SamplingParams) -> SamplingParams:
        return params

    def resume(self, state: "RolloutState", p: int, ids: list[int], params: SamplingParams, where: dict):
        """Take prompt p's submission over: (request id per sample, {sample: finished Completion}) or None."""
        return None

    def started(self, state: "RolloutState", p: int, group: list[int], params: SamplingParams) -> None:
        pass

    def begin(self, state: "RolloutState") -> None:
        pass

    def idle(self, state: "RolloutState") -> None:
        pass

    def pending(self, state: "RolloutState") -> bool:
        return False

    def engine_step(self, state: "RolloutState") -> None:
        pass

    def group(self, state: "RolloutState", p: int, completions: list[Completion], rewards: np.ndarray) -> None:
        pass

    def done(self, state: "RolloutState", stats: dict) -> None:
        pass


class KeepAll(Hooks):
    """The default selection: every response of every prompt is kept, none aborted. A selection says whether it
    `races`, whether it has `decided`, the `accepted` prompts, each one's `kept` samples and the `dropped` ones."""

    races = False
    decided = True
    dropped: list[int] = []

    def __init__(self, prompts: int):
        self.accepted = list(range(prompts))

    def kept(self, state: "RolloutState", p: int) -> range:
        return range(state.n)

    def finished(self, p: int, j: int, length: int) -> None:
        pass

    def idle_poll(self, state: "RolloutState") -> None:
        pass


@dataclasses.dataclass
class RolloutState:
    """What the parts of one rollout may see and do: the engine (`svc`), the prompts and rows, each response's
    completion, reward and status as they arrive (`comps[p][j]`, `scores[p, j]`, `results[(p, j)]`), the
    request ids (`rids[p][j]`), the counters, and `finish`/`abort` (which keep the selection informed)."""

    svc: object
    prompts: list[list[int]]
    rows: list[dict]
    n: int
    selection: object
    comps: list = dataclasses.field(default_factory=list)
    scores: np.ndarray | None = None
    results: dict = dataclasses.field(default_factory=dict)
    rids: list = dataclasses.field(default_factory=list)
    index: dict = dataclasses.field(default_factory=dict)       # request id -> (p, j)
    engine_steps: int = 0
    finished: int = 0
    aborted: int = 0
    aborted_tokens: int = 0

    def __post_init__(self):
        self.comps = [[None] * self.n for _ in self.prompts]
        self.scores = np.zeros((len(self.prompts), self.n), np.float32)

    @property
    def racing(self) -> bool:
        """A race is still deciding which responses the rollout keeps."""
        return not self.selection.decided

    def where(self, request_id: int) -> tuple[int, int]:
        """(prompt, sample) of a request id."""
        return self.index[request_id]

    def finish(self, p: int, j: int, c: Completion) -> None:
        """Response j of prompt p is final (the scorer calls it when it takes the response)."""
        self.comps[p][j] = c
        self.selection.finished(p, j, len(c.tokens))
        self.finished += 1

    def abort(self, p: int, j: int, scorer) -> object:
        """Give response j of prompt p up: its scorer forgets it, the engine frees its pages; returns the
        partial completion the engine held (None: it had finished)."""
        scorer.cancel((p, j))
        partial = self.svc.abort(self.rids[p][j])
        if partial is not None:
            self.aborted += 1
            self.aborted_tokens += len(partial.tokens)
        return partial


class RolloutLoop:
    """One rollout (module docstring): `run(prompts, rows)` -> (kept completions prompt-major, their rewards
    float32, stats {"items", "timeouts", "crashes", "first_error", "seconds", "engine_steps", "accepted",
    "dropped", "aborted", "aborted_tokens", "wasted_tokens", ...}); seconds is the wait for rewards after the
    last completion."""

    def __init__(self, svc, requests: Requests, scorer, selection=None, hooks=()):
        self.svc, self.requests, self.scorer = svc, requests, scorer
        self.selection = selection
        self.hooks = list(hooks)
        # (checking every prompt after each engine step costs time only where some part takes groups)
        self._grouped = any(type(h).group is not Hooks.group for h in [selection, scorer, *self.hooks] if h is not None)
        if not scorer.streams:
            need = [type(h).__name__ for h in [selection, *self.hooks] if getattr(h, "needs_streamed_rewards", False)]
            if need:
                raise ValueError(f"{', '.join(need)} need the rewards as they come; the scorer "
                                 f"{type(scorer).__name__} gives none during the rollout")

    def run(self, prompts: list[list[int]], rows: list[dict]) -> tuple[list[Completion], np.ndarray, dict]:
        selection = self.selection if self.selection is not None else KeepAll(len(prompts))
        scorer, parts = self.scorer, [selection, *self.hooks, self.scorer]
        st = RolloutState(self.svc, prompts, rows, self.requests.n, selection)
        for p, j, c in self._submit(st, parts):        # carried responses that had finished already
            scorer.arrived(st, p, j, c)
        for h in parts:
            h.begin(st)
        emitted: set[int] = set()
        while self.svc.has_work() or st.racing or any(h.pending(st) for h in parts):
            if not self.svc.has_work():      # (in the order a working process runs them: the engine step's tick first)
                for h in parts:
                    h.idle(st)
                scorer.idle_poll(st)
                selection.idle_poll(st)
                continue
            st.engine_steps += 1
            for c in self.svc.step():
                scorer.arrived(st, *st.where(c.request_id), c)
            scorer.poll(st, None)
            for h in parts:
                h.engine_step(st)
            self._emit_groups(st, parts, emitted)
        return self._finish(st, parts, emitted)

    def _submit(self, st: RolloutState, parts) -> list:
        """Every prompt's request (placed, adjusted and perhaps taken over by the hooks); returns the
        (p, j, completion) of responses that come in finished."""
        placed = next((w for w in (h.place(st, st.prompts) for h in parts) if w is not None), None)
        placed = placed if placed is not None else [{}] * len(st.prompts)
        before = []
        for p, (ids, row, where_to) in enumerate(zip(st.prompts, st.rows, placed)):
            params = self.requests.params(row)
            for h in parts:
                params = h.request(st, p, row, params)
            taken = next((t for t in (h.resume(st, p, ids, params, where_to) for h in parts) if t is not None), None)
            if taken is not None:
                group, done = taken
                st.rids.append(group)
                before += [(p, j, c) for j, c in done.items()]
                continue
            st.rids.append(self.svc.add(ids, params, **where_to))
            for h in parts:
                h.started(st, p, st.rids[-1], params)
        st.index = {rid: (p, j) for p, group in enumerate(st.rids) for j, rid in enumerate(group) if rid is not None}
        return before

    def _emit_groups(self, st: RolloutState, parts, emitted: set[int]) -> None:
        """Hand every accepted prompt whose kept responses are all scored to the `group` hooks, once."""
        if st.racing or not self._grouped:
            return
        for p in st.selection.accepted:
            js = st.selection.kept(st, p)
            if p not in emitted and all((p, j) in st.results for j in js):
                emitted.add(p)
                for h in parts:
                    h.group(st, p, [st.comps[p][j] for j in js], np.asarray([st.scores[p, j] for j in js], np.float32))

    def _finish(self, st: RolloutState, parts, emitted: set[int]) -> tuple[list[Completion], np.ndarray, dict]:
        """Wait for the kept responses' rewards (the others are cancelled), hand out the last groups, count."""
        sel = st.selection
        accepted = sel.accepted
        kept = [(p, j) for p in accepted for j in sel.kept(st, p)]
        wanted = set(kept)
        self.scorer.cancel_unwanted(wanted)
        t0 = time.perf_counter()
        while self.scorer.waiting:
            self.scorer.poll(st, 1.0)
            self._emit_groups(st, parts, emitted)
        self._emit_groups(st, parts, emitted)
        wasted = sum(len(c.tokens) for p, row in enumerate(st.comps) for j, c in enumerate(row)
                     if c is not None and (p, j) not in wanted)
        stats = dict(**self.scorer.stats(st, kept), seconds=time.perf_counter() - t0, engine_steps=st.engine_steps,
                     accepted=accepted, dropped=list(sel.dropped), aborted=st.aborted,
                     aborted_tokens=st.aborted_tokens, wasted_tokens=wasted + st.aborted_tokens)
        for h in parts:
            h.done(st, stats)
        return [st.comps[p][j] for p, j in kept], np.asarray([st.scores[p, j] for p, j in kept], np.float32), stats
