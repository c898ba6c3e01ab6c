"""The rollout loop's components (`jaxrl.train.rollout_loop`): each mechanism's part in a step's rollout, built
from what it needs and nothing else.

Scorers (one per rollout): `StreamedRewards` (each finished response to the reward pool at once, so scoring
overlaps the rest of the rollout), `NoScores`, `TrajectoryScores` (multi-turn: the environments score).
Selection: `RaceSelection` (RollPacker's tail batching, with DAPO's dynamic sampling and slime's carried
partials). Hooks: `Placement` (StreamRL's skew-aware placement), `RequestParams`, `CarriedPartials`,
`StepProgress` and `GroupStream` (RollPacker's stream trainer, StreamRL's dynamic-batch pipelining), and
`PatTicks` (PAT over several processes: decisions agreed at common ticks).
"""

from __future__ import annotations

import numpy as np

from jaxrl.rewards.registry import reward_fn_for, reward_item, reward_name
from jaxrl.rewards.scheduler import RewardScheduler
from jaxrl.rollout.partial_carry import carry_from_round, resume_group

from .rollout_loop import Hooks, RolloutState, request_seed


class Scorer(Hooks):
    """The scorer role: takes each response out of the engine (`arrived`), polls for rewards into the state
    (`poll`, `idle_poll`), forgets what the selection gives up (`cancel`, `cancel_unwanted`), says whether any
    reward is still `waiting`, and counts (`stats`). `streams`: rewards arrive during the rollout."""

    streams = True
    waiting: dict = {}

    def arrived(self, state: RolloutState, p: int, j: int, c) -> None:
        state.finish(p, j, c)

    def poll(self, state: RolloutState, timeout: float | None) -> None:
        pass

    def idle_poll(self, state: RolloutState) -> None:
        pass

    def cancel(self, key) -> None:
        pass

    def cancel_unwanted(self, wanted: set) -> None:
        pass

    def stats(self, state: RolloutState, kept: list) -> dict:
        return dict(items=0, timeouts=0, crashes=0, first_error="")


class NoScores(Scorer):
    """Nothing is scored during the rollout (a graph whose reward node scores the batch afterwards,
    `rl.score_batch`): rewards come back as zeros and no items are counted."""

    streams = False


class StreamedRewards(Scorer):
    """Each response goes to the reward pool the moment the engine finishes it. `pool` is a `RewardScheduler`
    (the trainer keeps one, so code rewards' adaptive timeouts learn across steps) or a plain `RewardPool`
    (wrapped for the rollout); `rewards` is the config's `rewards` section (each row's reward name; `default`:
    a task's reward name when neither the row nor `rewards.fn` names one). A failed
    reward scores 0 and is counted; `first_error` is the first failure to come back, as
    "<status> in <reward name>: <cause>"."""

    def __init__(self, pool, tokenizer, rewards, default=reward_fn_for):
        self.sched = pool if isinstance(pool, RewardScheduler) else RewardScheduler(pool)
        self.tokenizer, self.rewards, self.default = tokenizer, rewards, default
        self.waiting: dict = {}
        self.first_error: list[str] = []

    def arrived(self, state, p, j, c):
        state.finish(p, j, c)
        row = state.rows[p]
        name = reward_name(row, self.rewards.fn, self.rewards.registry, default=self.default)
        self.sched.submit((p, j), reward_item(name, self.tokenizer.decode(c.tokens), row))
        self.waiting[p, j] = name

    def poll(self, state, timeout):
        polled = self.sched.poll() if timeout is None else self.sched.poll(timeout=timeout)
        for res in polled.responses:
            name = self.waiting.pop(res.key, None)
            if name is None:          # a response given up after it was submitted
                continue
            p, j = res.key
            state.scores[p, j] = res.score
            state.results[p, j] = res.status
            if res.status != "ok" and not self.first_error:
                self.first_error.append(f"{res.status} in {name}: {res.error}")

    def idle_poll(self, state):
        # with a race, also until it is decided: its poll gathers from every process, so a process whose own
        # requests are done keeps polling with the others (and dynamic sampling waits for group rewards)
        self.poll(state, 0.02 if state.racing else 0)

    def cancel_unwanted(self, wanted):
        for key in [k for k in self.waiting if k not in wanted]:
            del self.waiting[key]                       # would be scored for nothing
            self.sched.cancel(key)

    def stats(self, state, kept):
        statuses = [state.results[pj] for pj in kept]
        return dict(items=len(statuses), timeouts=statuses.count("timeout"), crashes=statuses.count("crash"),
                    first_error=self.first_error[0] if self.first_error else "")


class TrajectoryScores(Scorer):
    """Multi-turn (`turns`, a `jaxrl.train.trajectories.TurnRound` of the rollout's rows): each sample is a
    trajectory; its turns step its environment as they end and its observations continue it in the engine. A
    sample finishes (for the race and the `group` hooks) when its trajectory ends; its reward is the sum of its
    steps' and the stats count environment steps as items (`stats["env"]`: the round's counters)."""

    def __init__(self, turns):
        self.turns = turns

    def request(self, state, p, row, params):
        return self.turns.mt.params(params)

    def started(self, state, p, group, params):
        self.turns.start(p, group, params)

    def pending(self, state):
        return bool(self.turns.pending)

    def arrived(self, state, p, j, c):
        self.turns.turn_ended((p, j), c)

    def _take(self, state, ended) -> None:
        for (p, j), c, reward, status in ended:
            state.finish(p, j, c)
            state.scores[p, j], state.results[p, j] = reward, status

    def poll(self, state, timeout):
        self._take(state, self.turns.poll() if timeout is None else self.turns.poll(timeout=timeout))

    def idle_poll(self, state):
        if self.turns.pending:          # every live trajectory waits on its environment
            self._take(state, self.turns.poll(timeout=0.005 if state.racing else 0.02))

    def cancel(self, key):
        self.turns.cancel(key)

    def stats(self, state, kept):
        return self.turns.stats()


class RaceSelection(Hooks):
    """Tail batching's race (`jaxrl.rollout.tail_batching.Race`) as the rollout's selection: after every engine
    step the race is told the live lengths and the responses it gives up are aborted at once (pages freed).
    Only the accepted prompts' kept responses come back and only theirs are waited for. With `filter_equal`
    (DAPO dynamic sampling) it is told each decided prompt's group rewards as they arrive; `dropped` are the
    prompts whose rewards were all equal. `carry` (tail batching's `carry_partial`, with `keep` = R0 responses
    per prompt): the responses of the prompts neither accepted nor dropped come back as `stats["partials"]`
    (local prompt -> the `Partial`s it carries)."""

    races = True

    def __init__(self, race, scorer: Scorer, carry: bool = False, keep: int = 0):
        self.race, self.scorer, self.carry, self.keep = race, scorer, carry, keep
        self.needs_streamed_rewards = race.filter_equal
        self.told: set[int] = set()
        self.partials: dict = {}

    @property
    def decided(self) -> bool:
        return self.race.decided

    @property
    def accepted(self) -> list[int]:
        return self.race.accepted

    @property
    def dropped(self) -> list[int]:
        return self.race.dropped

    def kept(self, state, p):
        return self.race.kept(p)

    def finished(self, p, j, length):
        self.race.finished(p, j, length)

    def _tell(self, state) -> None:
        """Each decided prompt's kept group, once fully scored, to the race (dynamic sampling decides on it)."""
        for p in self.race.known if not self.race.decided else ():
            js = self.race.kept(p)
            if p not in self.told and all((p, j) in state.results for j in js):
                self.told.add(p)
                self.race.scored(p, [state.scores[p, j] for j in js])

    def idle_poll(self, state):
        if not self.race.decided:
            self._tell(state)
            self.race.poll()

    def engine_step(self, state):
        self._tell(state)
        for s in state.svc.sequence_stats():
            self.race.progress(*state.where(s["request_id"]), s["generated"])
        for p, j in self.race.poll():
            partial = state.abort(p, j, self.scorer)
            if partial is not None and self.carry:
                self.partials[p, j] = partial

    def done(self, state, stats):
        if self.carry:
            gone = set(self.race.accepted) | set(self.race.dropped)
            deferred = [p for p in range(len(state.prompts)) if p not in gone]
            stats["partials"] = carry_from_round(state.comps, self.partials, deferred, self.keep, state.svc.version)


class Placement(Hooks):
    """`route(prompts) -> (instances, priorities)` (StreamRL's skew-aware placement) picks each prompt's
    instance (None: the engine's router) and LPT priority."""

    def __init__(self, route):
        self.route = route

    def place(self, state, prompts):
        return [dict(instance=i, priority=q) for i, q in zip(*self.route(prompts))]


class RequestParams(Hooks):
    """`fn(row, params) -> SamplingParams` adjusts each prompt's request (benchmarks give each prompt its own
    stop tokens; evaluation its temperature and seed)."""

    def __init__(self, fn):
        self.fn = fn

    def request(self, state, p, row, params):
        return self.fn(row, params)


class CarriedPartials(Hooks):
    """Carried partial responses (`jaxrl.rollout.partial_carry`, a long round's): `carried[p]` is (the step
    prompt p was deferred at, its carried `Partial`s) or None; those responses continue (or, when finished,
    are scored as they are) in the first slots of p's group, resumed with the seed of the step that sampled
    them (`seed`: the run seed)."""

    def __init__(self, carried, seed: int):
        self.carried, self.seed = carried, seed

    def resume(self, state, p, ids, params, where):
        if self.carried[p] is None:
            return None
        deferred_at, parts = self.carried[p]
        return resume_group(state.svc, ids, params, parts,
                            request_seed(self.seed, deferred_at, int(state.rows[p]["index"])), **where)


class StepProgress(Hooks):
    """`on_step(finished, total)` after every engine step of a rollout without a race (responses finished so
    far, of all launched): RollPacker's stream trainer checks its shrink milestones here."""

    def __init__(self, on_step):
        self.on_step = on_step

    def engine_step(self, state):
        if not getattr(state.selection, "races", False):
            self.on_step(state.finished, len(state.prompts) * state.n)


class GroupStream(Hooks):
    """`on_group(p, completions, rewards)` as soon as prompt p's kept responses are all scored (in a race, once
    p is accepted), in sample order: the gradient streams start on it."""

    needs_streamed_rewards = True

    def __init__(self, on_group):
        self.on_group = on_group

    def group(self, state, p, completions, rewards):
        self.on_group(p, completions, rewards)


class PatTicks(Hooks):
    """PAT over several processes (`svc.adaptive` with `agree`): its decisions are agreed at common ticks, so a
    process keeps ticking, with no engine work, until every process has finished the generation."""

    def __init__(self, pat):
        self.pat = pat

    def begin(self, state):
        self.pat.begin()

    def pending(self, state):
        return self.pat.pending()

    def idle(self, state):
        if self.pat.pending():
            self.pat.idle_tick(state.svc)

    @classmethod
    def of(cls, svc) -> "PatTicks | None":
        pat = getattr(svc, "adaptive", None)       # (a stand-in service may have no PAT driver at all)
        return cls(pat) if pat is not None and pat.agree is not None else None
