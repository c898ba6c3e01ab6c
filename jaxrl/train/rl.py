"""One RL step's data work, as plain functions the trainer calls in order:
rollout (rewards scored as completions stream out) -> advantages -> packed global batch, as fixed-shape
micro-batches (`micro_batches`) or one bucketed batch (`global_batch`, when trainer.micro_batch_tokens is null).

Seeds: the n samples of a prompt are seeded from (run seed, step, dataset row index), so a step's
rollouts are the same whatever the number of processes, instances or TP size.

Rewards: each sample is scored by its row's reward (`jaxrl.rewards.reward_name`: the row's own
`"reward"` field, else `rewards.fn`, else the task's default; names in `rewards.registry` map to import
paths). To train on your own reward, put `fn(response, answer, task) -> float` in a module the run can
import (the directory it starts in, or `PYTHONPATH`) and set `rewards.fn=my_rewards:score`, or give
rows a `"reward"` field. A reward that crashes or times out scores 0 and is counted; the step's stats
carry the first failure's cause, and `RewardFailureGuard` stops the run after
`rewards.max_failed_steps` steps in a row in which every reward failed (instead of training on zeros).
"""

from __future__ import annotations

import functools
import hashlib
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl import algos
from jaxrl.config.train import TrainConfig
from jaxrl.rewards.registry import one_line, reward_fn_for, reward_item, reward_name
from jaxrl.rewards.scheduler import RewardScheduler
from jaxrl.rollout import Completion, RolloutService, SamplingParams
from jaxrl.rollout.partial_carry import carry_from_round, resume_group

from .batch import Sample, pack, pack_rows, row_bucket, trained_tokens
from .distributed import global_max, global_sum


def request_seed(run_seed: int, step: int, row_index: int) -> int:
    digest = hashlib.blake2b(f"{run_seed}:{step}:{row_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def uses_rollout_kv(cfg: TrainConfig) -> bool:
    """MetroRLHF consumes the rollout's K/V (the engine then exports each completion's on the devices)."""
    return cfg.trainer.backward == "blockwise" and cfg.trainer.kv_source == "rollout"


def rollout_and_score(svc: RolloutService, pool, tokenizer, cfg: TrainConfig, prompts: list[list[int]],
                      rows: list[dict], step: int, eos_ids, *, race=None, responses: int | None = None,
                      params_fn=None, on_step=None, on_group=None, route=None,
                      score: bool = True, turns=None, carried=None,
                      carry: bool = False) -> tuple[list[Completion], np.ndarray, dict]:
    """All kept samples of the local prompts, prompt-major (row p*G + g), with their rewards.

    Each completion goes to the reward pool the moment the engine finishes it, so scoring overlaps the
    rest of the rollout (the long tail especially). `pool` is a `RewardScheduler` (the trainer keeps one,
    so code rewards' adaptive timeouts learn across steps) or a plain `RewardPool` (wrapped for the call);
    a response given up after it was submitted is cancelled there. Returns (completions, rewards [P*G] float32,
    {"items", "timeouts", "crashes", "first_error", "seconds", "engine_steps", ...}) where seconds is the
    wait for rewards after the last completion; crashes and timeouts score 0 and are counted, and
    first_error is the first failure to come back, as "<status> in <reward name>: <cause>" ("" when none
    failed).

    `race` (tail batching, `jaxrl.rollout.tail_batching.Race`): `responses` are launched per prompt; after
    every engine step the race is told the live lengths and the responses it gives up are aborted at once
    (pages freed). Only the accepted prompts' kept responses come back (`stats["accepted"]`: their local
    prompt indices) and only theirs are waited for; the stats count the aborted responses and tokens and
    the decoded tokens thrown away (aborted + finished but not kept). A race with `filter_equal` (DAPO
    dynamic sampling) is told each decided prompt's group rewards as they arrive; `stats["dropped"]` are
    the local prompts whose rewards were all equal (neither returned nor to be queued).

    `params_fn(row, params) -> SamplingParams` may adjust each prompt's request (benchmarks give each prompt
    its own stop tokens). `route(prompts) -> (instances, priorities)` (StreamRL skew-aware placement) picks
    each prompt's instance (None: the engine's router) and LPT priority. Streaming hooks (RollPacker's stream trainer): `on_step(finished, total)` after
    every engine step of a round without a race (responses finished so far, of `total`); `on_group(p,
    completions, rewards)` as soon as prompt p's kept responses are all scored (and, in a race, p is
    accepted), in sample order.

    `score=False`: nothing is scored here (a graph whose reward node does not stream: it scores the batch
    after the rollout, `score_batch`); the rewards come back as zeros and the stats count no items.

    `turns` (multi-turn, a `jaxrl.train.trajectories.TurnRound` of these rows): each sample is a trajectory;
    its turns step its environment as they end and its observations continue it in the engine. A sample
    "finishes" (the race, `on_group`) when its trajectory ends; its reward is the sum of its steps' and the
    stats count environment steps as items (`stats["env"]`: the round's counters).

    Carried partial responses (`jaxrl.rollout.partial_carry`, tail batching's `carry_partial`): `carried[p]`
    is (the step prompt p was deferred at, its carried `Partial`s) or None; those responses continue (or, when
    finished, are scored as they are) in the first slots of p's group. `carry=True` with a race: the
    responses of the prompts the race neither accepts nor drops come back as `stats["partials"]` (local prompt
    -> the `Partial`s it carries).
    """
    if not score and (on_group is not None or (race is not None and race.filter_equal) or turns is not None):
        raise ValueError("rollout_and_score(score=False): on_group, dynamic sampling and multi-turn need the "
                         "rewards as they come")
    r = cfg.rollout
    G = responses or cfg.algo.group_size
    sched = pool if isinstance(pool, RewardScheduler) else RewardScheduler(pool)
    rids, arrived_before = [], []
    placed = [{}] * len(prompts) if route is None else [dict(instance=i, priority=q) for i, q in zip(*route(prompts))]
    for ids, row, where_to in zip(prompts, rows, placed):
        params = SamplingParams.from_config(r, n=G, stop_token_ids=eos_ids,
                                            seed=request_seed(cfg.seed, step, int(row["index"])),
                                            return_kv=uses_rollout_kv(cfg))
        params = params if params_fn is None else params_fn(row, params)
        if turns is not None:
            params = turns.mt.params(params)
        if carried is not None and carried[len(rids)] is not None:
            deferred_at, parts = carried[len(rids)]
            group, done = resume_group(svc, ids, params, parts, request_seed(cfg.seed, deferred_at, int(row["index"])),
                                       **where_to)
            rids.append(group)
            arrived_before += [(len(rids) - 1, j, c) for j, c in done.items()]
            continue
        rids.append(svc.add(ids, params, **where_to))
        if turns is not None:
            turns.start(len(rids) - 1, rids[-1], params)
    where = {rid: (p, j) for p, group in enumerate(rids) for j, rid in enumerate(group) if rid is not None}
    comps: list[list[Completion | None]] = [[None] * G for _ in prompts]
    scores = np.zeros((len(prompts), G), np.float32)
    waiting, results, first_error = {}, {}, []
    aborted = aborted_tokens = engine_steps = finished = 0
    partials = {}                              # carry: (p, j) -> the partial completion an abort returned
    emitted: set[int] = set()
    told: set[int] = set()

    def emit_groups():
        """Hand every prompt whose kept responses are all scored to `on_group`, once."""
        if on_group is None or (race is not None and not race.decided):
            return
        for p in (range(len(prompts)) if race is None else race.accepted):
            js = range(G) if race is None else race.kept(p)
            if p not in emitted and all((p, j) in results for j in js):
                emitted.add(p)
                on_group(p, [comps[p][j] for j in js], np.asarray([scores[p, j] for j in js], np.float32))

    def tell_race():
        """Each decided prompt's kept group, once fully scored, to the race (dynamic sampling decides on it)."""
        for p in race.known if race is not None and not race.decided else ():
            js = race.kept(p)
            if p not in told and all((p, j) in results for j in js):
                told.add(p)
                race.scored(p, [scores[p, j] for j in js])

    def finish(p, j, c):
        nonlocal finished
        comps[p][j] = c
        if race is not None:
            race.finished(p, j, len(c.tokens))
        finished += 1

    def arrived(p, j, c):
        """Response j of prompt p came out of the engine (or was carried in finished): to its reward."""
        if turns is not None:
            turns.turn_ended((p, j), c)
            return
        finish(p, j, c)
        if not score:
            return
        row = rows[p]
        name = reward_name(row, cfg.rewards.fn, cfg.rewards.registry, default=reward_fn_for)
        sched.submit((p, j), reward_item(name, tokenizer.decode(c.tokens), row))
        waiting[p, j] = name

    def take_trajectories(ended):
        for (p, j), c, reward, status in ended:
            finish(p, j, c)
            scores[p, j], results[p, j] = reward, status

    def take(polled):
        for res in polled.responses:
            name = waiting.pop(res.key, None)
            if name is None:          # a response given up after it was submitted
                continue
            p, j = res.key
            scores[p, j] = res.score
            results[p, j] = res.status
            if res.status != "ok" and not first_error:
                first_error.append(f"{res.status} in {name}: {res.error}")

    # with a race, also until it is decided: its poll gathers from every process, so a process whose own
    # requests are done keeps polling with the others (and dynamic sampling waits for group rewards); with
    # PAT over several processes, until every process has finished: its decisions are agreed at common ticks
    for p, j, c in arrived_before:             # carried responses that had finished already
        arrived(p, j, c)
    pat = getattr(svc, "adaptive", None)       # (a stand-in service may have no PAT driver at all)
    pat = pat if pat is not None and pat.agree is not None else None
    if pat is not None:
        pat.begin()
    while (svc.has_work() or (race is not None and not race.decided) or (pat is not None and pat.pending())
           or (turns is not None and turns.pending)):
        if not svc.has_work():       # (in the order a working process runs them: the engine step's tick first)
            if pat is not None and pat.pending():
                pat.idle_tick(svc)
            if turns is not None and turns.pending:      # every live trajectory waits on its environment
                take_trajectories(turns.poll(timeout=0.02 if race is None or race.decided else 0.005))
            if race is not None and not race.decided:
                take(sched.poll(timeout=0.02))
                tell_race()
                race.poll()
            else:
                take(sched.poll(timeout=0))
            continue
        engine_steps += 1
        for c in svc.step():
            arrived(*where[c.request_id], c)
        if turns is not None:
            take_trajectories(turns.poll())
        else:
            take(sched.poll())
        if on_step is not None and race is None:
            on_step(finished, len(prompts) * G)
        if race is not None:
            tell_race()
            for s in svc.sequence_stats():
                race.progress(*where[s["request_id"]], s["generated"])
            for p, j in race.poll():
                if turns is not None:
                    turns.cancel((p, j))
                partial = svc.abort(rids[p][j])
                if partial is not None:
                    aborted += 1
                    aborted_tokens += len(partial.tokens)
                    if carry:
                        partials[p, j] = partial
        emit_groups()
    accepted = list(range(len(prompts))) if race is None else race.accepted
    kept = [(p, j) for p in accepted for j in (range(G) if race is None else race.kept(p))]
    wanted = set(kept)
    for key in [k for k in waiting if k not in wanted]:
        del waiting[key]                       # would be scored for nothing
        sched.cancel(key)
    t0 = time.perf_counter()
    while waiting:
        take(sched.poll(timeout=1.0))
        emit_groups()
    emit_groups()
    statuses = [results[pj] for pj in kept] if score else []
    wasted = sum(len(c.tokens) for p, row in enumerate(comps) for j, c in enumerate(row)
                 if c is not None and (p, j) not in wanted)
    scored = turns.stats() if turns is not None else dict(
        items=len(statuses), timeouts=statuses.count("timeout"), crashes=statuses.count("crash"),
        first_error=first_error[0] if first_error else "")
    stats = dict(**scored, seconds=time.perf_counter() - t0,
                 engine_steps=engine_steps, accepted=accepted,
                 dropped=[] if race is None else list(race.dropped), aborted=aborted, aborted_tokens=aborted_tokens,
                 wasted_tokens=wasted + aborted_tokens)
    if carry and race is not None:
        deferred = [p for p in range(len(prompts)) if p not in set(accepted) | set(race.dropped)]
        stats["partials"] = carry_from_round(comps, partials, deferred, cfg.algo.group_size, svc.version)
    return [comps[p][j] for p, j in kept], np.asarray([scores[p, j] for p, j in kept], np.float32), stats


def score_batch(sched: RewardScheduler, tokenizer, cfg: TrainConfig, rows: list[dict], comps: list[Completion],
                group_size: int) -> tuple[np.ndarray, dict]:
    """Score every completion after the rollout (a reward node that does not stream; `rows[k // group_size]`
    is completion k's row). Returns (rewards float32, {"items", "timeouts", "crashes", "first_error",
    "seconds"}) as `rollout_and_score` counts them; seconds is the whole scoring time."""
    t0 = time.perf_counter()
    waiting = {}
    for k, c in enumerate(comps):
        row = rows[k // group_size]
        name = reward_name(row, cfg.rewards.fn, cfg.rewards.registry, default=reward_fn_for)
        sched.submit(("batch", k), reward_item(name, tokenizer.decode(c.tokens), row))
        waiting["batch", k] = name
    scores, statuses, first_error = np.zeros(len(comps), np.float32), [], ""
    while waiting:
        for res in sched.poll(timeout=1.0).responses:
            name = waiting.pop(res.key, None)
            if name is None:
                continue
            scores[res.key[1]] = res.score
            statuses.append(res.status)
            if res.status != "ok" and not first_error:
                first_error = f"{res.status} in {name}: {res.error}"
    return scores, dict(items=len(statuses), timeouts=statuses.count("timeout"), crashes=statuses.count("crash"),
                        first_error=first_error, seconds=time.perf_counter() - t0)


class RewardsFailedError(RuntimeError):
    """Every reward failed in `rewards.max_failed_steps` consecutive steps (the message is one line)."""


class RewardFailureGuard:
    """Stops a run whose rewards all fail: `update(stats)` after each step's `rollout_and_score` counts
    the consecutive steps in which every reward, over all processes, crashed or timed out, and raises
    `RuntimeError` (one line, with the first failure of that streak) at `max_failed_steps` of them. A
    step with any successful reward resets the count; a step with no rewards at all leaves it alone.
    Every process sees the same global counts, so all of them raise at the same step."""

    def __init__(self, max_failed_steps: int):
        if max_failed_steps < 1:
            raise ValueError(f"max_failed_steps={max_failed_steps} must be >= 1")
        self.max_failed_steps = max_failed_steps
        self.failed_steps = 0
        self.first_error = ""

    def update(self, stats: dict) -> None:
        items, failed = global_sum([stats["items"], stats["timeouts"] + stats["crashes"]])
        if items == 0:
            return
        if failed < items:
            self.failed_steps, self.first_error = 0, ""
            return
        self.failed_steps += 1
        self.first_error = self.first_error or stats.get("first_error", "")
        if self.failed_steps >= self.max_failed_steps:
            first = self.first_error or "the first failure was on another process"
            steps = f"{self.failed_steps} step{'s' * (self.failed_steps > 1)}"
            raise RewardsFailedError(one_line(f"every reward failed in {steps} in a row (first: {first}); fix the reward "
                                              "function or raise rewards.max_failed_steps", 1000))


def token_width(cfg: TrainConfig, resp_lens: list[int]) -> int:
    """The padded response width of per-token host arrays: a fixed width, one compile of each estimator."""
    return max(cfg.rollout.max_new_tokens, *resp_lens, 1)


def padded(per_sample: list[np.ndarray], width: int) -> np.ndarray:
    """Per-sample response arrays as one float32 [B, width] array, zero-padded."""
    out = np.zeros((len(per_sample), width), np.float32)
    for i, x in enumerate(per_sample):
        out[i, :len(x)] = x
    return out


_JITTED: dict = {}


def jitted(fn, **static):
    """`fn` with its `static` keyword arguments bound, jitted once per (fn, static). The scan-based
    estimators need it: an eager `lax.scan` builds its body anew on every call and so compiles every step; the
    others gain one program in place of one per eager op."""
    key = (fn, tuple(sorted(static.items())))
    if key not in _JITTED:
        _JITTED[key] = jax.jit(functools.partial(fn, **static))
    return _JITTED[key]


def advantages(cfg: TrainConfig, rewards: np.ndarray, resp_lens: list[int], kl: list[np.ndarray] | None = None
               ) -> list[np.ndarray]:
    """Per-token advantages for each sample's response (via the `jaxrl.algos` registry).

    Group estimators see the process-local groups (groups never straddle processes). reinforce_pp's
    batch normalisation is over the process-local batch (a stated simplification for multi-process);
    `kl` (algo.kl_in_reward: each sample's per-token KL to the reference) enters its token rewards as
    −kl_coef·KL. (algo.advantage=gae: `jaxrl.train.critic.gae`.)
    """
    a, G = cfg.algo, cfg.algo.group_size
    T = token_width(cfg, resp_lens)
    mask = (np.arange(T)[None, :] < np.asarray(resp_lens)[:, None]).astype(np.float32)
    if a.advantage == "reinforce_pp":
        est = jitted(algos.compute_advantages, name="reinforce_pp", gamma=a.gamma, kl_coef=a.kl_coef if kl else 0.0)
        adv = est(rewards=rewards, mask=mask, kl=None if kl is None else padded(kl, T))
    else:           # (jitted: one program per shape, not one per eager op, ~12 of them, each traced and compiled)
        adv = jitted(algos.compute_advantages, name=a.advantage)(rewards=rewards.reshape(-1, G), mask=mask)
    adv = np.asarray(adv)
    return [adv[i, :n] for i, n in enumerate(resp_lens)]


def batch_weights(samples: list[Sample], cfg: TrainConfig, max_new_tokens: int, *, fold: bool = True):
    """Per-sequence token weights (float64 [n]) of the local samples and the update's denominator.

    The aggregation is `cfg.algo.agg` from the `jaxrl.algos` registry; its denominator (tokens or
    sequences) is counted over all processes. `fold=True` (the synchronous trainer) folds it into the
    weights, 1/(D·q_i) — exactly the float64 expressions the trainer has always packed — and returns
    denominator 1.0; `fold=False` returns the unnormalised 1/q_i and D (streamed, blockwise and
    multi-device-group callers: they sum gradients, and `apply_update` divides by D once). Either way the
    weights are multiplied by `algo.mini_batches`: each of the mini-batch updates sees 1/mini_batches
    of the batch, and its loss is still that part's share of the global mean.
    """
    agg = cfg.algo.agg
    resp = np.asarray([trained_tokens(s) for s in samples])
    n_tok, n_seq = global_sum([resp.sum(), len(samples)])
    denominator = int(n_tok) if algos.AGGREGATIONS[agg].denominator == "tokens" else int(n_seq)
    if fold:
        weights = algos.folded_token_weights(agg, resp, max_new_tokens, denominator=denominator)
        return weights * cfg.algo.mini_batches, 1.0
    return sample_weights(samples, cfg, max_new_tokens), float(max(denominator, 1))


def sample_weights(samples: list[Sample], cfg: TrainConfig, max_new_tokens: int) -> np.ndarray:
    """`batch_weights(fold=False)`'s weights, 1/q_i x algo.mini_batches, without its denominator: nothing
    crosses processes, so a process may call it on its own (the stream trainer's micro-batches on the devices
    this process freed)."""
    weights, _ = algos.token_weights(cfg.algo.agg, np.asarray([trained_tokens(s) for s in samples]), max_new_tokens)
    return weights * cfg.algo.mini_batches


def global_batch(samples: list[Sample], cfg: TrainConfig, mesh, pack_len: int, max_new_tokens: int):
    """Pack local samples into rows, agree on the row count across processes, and assemble global
    arrays sharded over the mesh's data axes (each process contributes only its own rows). The weights
    have the denominator folded in (`batch_weights(fold=True)`): update with denominator 1.0."""
    weights, _ = batch_weights(samples, cfg, max_new_tokens, fold=True)
    data = mesh.shape["dp"] * mesh.shape["fsdp"]
    per_proc = max(1, data // jax.process_count())
    multiple = per_proc * cfg.algo.micro_batches * cfg.algo.mini_batches
    assignment = pack_rows([len(s.prompt) + len(s.response) for s in samples], pack_len)
    rows = global_max(len(assignment))
    rows = -(-row_bucket(rows) // multiple) * multiple     # few shapes (compiles), little padding
    local = pack(samples, weights, pack_len, n_rows=rows, rows=assignment)
    sharding = NamedSharding(mesh, P(("dp", "fsdp"), None))
    shape = (rows * jax.process_count(), pack_len)
    return {k: jax.make_array_from_process_local_data(sharding, v, shape) for k, v in local.items()}


def micro_batch_rows(cfg: TrainConfig, mesh, pack_len: int) -> int:
    """Global rows of one fixed-shape micro-batch: trainer.micro_batch_tokens // pack_len, rounded up to a
    multiple of the data-parallel devices and of the processes (each contributes the same share)."""
    data = mesh.shape["dp"] * mesh.shape["fsdp"]
    unit = np.lcm(data, jax.process_count())
    rows = max(1, cfg.trainer.micro_batch_tokens // pack_len)
    return int(-(-rows // unit) * unit)


def micro_batches(samples: list[Sample], cfg: TrainConfig, mesh, pack_len: int, max_new_tokens: int,
                  rows: int, mini_batches: int = 1, *, with_rows: bool = False, behaviour: bool = False,
                  token_fields: dict[str, list] | None = None):
    """Pack local samples and cut them into micro-batches of exactly `rows` global rows x `pack_len`
    (every process contributes rows / process_count of each, its own; the last ones padded with
    zero-weight rows). The count is agreed across processes and is a multiple of `mini_batches`. Weights
    have the denominator folded in, as in `global_batch`: update with denominator 1.0. `with_rows`: also
    return the packing, local row r -> the sample indices in it, in order (micro-batch r // (rows /
    process_count), its row r % that). `behaviour`: also pack the samples' rollout log-probs as
    "old_logp" (one-step-async's behaviour policy). `token_fields`: more per-response-token fields to pack
    (`batch.pack`)."""
    weights, _ = batch_weights(samples, cfg, max_new_tokens, fold=True)
    local = rows // jax.process_count()
    assignment = pack_rows([len(s.prompt) + len(s.response) for s in samples], pack_len)
    n = global_max(-(-len(assignment) // local))
    n = -(-max(n, 1) // mini_batches) * mini_batches
    packed = pack(samples, weights, pack_len, n_rows=n * local, rows=assignment, behaviour=behaviour,
                  token_fields=token_fields)
    sharding = NamedSharding(mesh, P(("dp", "fsdp"), None))
    mbs = [{k: jax.make_array_from_process_local_data(sharding, v[i * local:(i + 1) * local], (rows, pack_len))
            for k, v in packed.items()} for i in range(n)]
    return (mbs, assignment) if with_rows else mbs
