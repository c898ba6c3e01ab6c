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
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl import algos
from jaxrl.config.train import TrainConfig
from jaxrl.rewards.registry import one_line, reward_fn_for, reward_item, reward_name
from jaxrl.rewards.scheduler import RewardScheduler
from jaxrl.rollout import Completion, RolloutService

from .batch import Sample, pack, pack_rows, row_bucket, trained_tokens
from .distributed import global_max, global_sum
from .rollout_components import (CarriedPartials, GroupStream, NoScores, PatTicks, Placement, RaceSelection,
                                 RequestParams, StepProgress, StreamedRewards, TrajectoryScores)
from .rollout_loop import Requests, RolloutLoop, request_seed, uses_rollout_kv  # noqa: F401 (request_seed: rl's API)


def rollout_and_score(svc: RolloutService, pool, tokenizer, cfg: TrainConfig, prompts: list[list[int]],
                      rows: list[dict], step: int, eos_ids, *, race=None, responses: int | None = None,
                      params_fn=None, on_step=None, on_group=None, route=None,
                      score: bool = True, turns=None, carried=None,
                      carry: bool = False) -> tuple[list[Completion], np.ndarray, dict]:
    """All kept samples of the local prompts, prompt-major (row p*G + g), with their rewards: the rollout loop
    (`jaxrl.train.rollout_loop`) with the components its keyword arguments name, for callers written before
    the loop had components (tests, benchmarks, the simulator). New mechanisms join as components.

    `race` -> `RaceSelection` (with `carry`: carried partials out), `params_fn` -> `RequestParams`, `route` ->
    `Placement`, `carried` -> `CarriedPartials`, `on_step` -> `StepProgress`, `on_group` -> `GroupStream`,
    `turns` -> `TrajectoryScores`, `score=False` -> `NoScores` (else `StreamedRewards` on `pool`); PAT's agreed
    ticks join when the service has them. See each component for what it does, and `RolloutLoop.run` for
    what comes back."""
    scorer = (TrajectoryScores(turns) if turns is not None else
              StreamedRewards(pool, tokenizer, cfg.rewards, reward_fn_for) if score else NoScores())
    selection = None if race is None else RaceSelection(race, scorer, carry=carry, keep=cfg.algo.group_size)
    hooks = [h for h in (RequestParams(params_fn) if params_fn is not None else None,
                         Placement(route) if route is not None else None,
                         CarriedPartials(carried, cfg.seed) if carried is not None else None,
                         PatTicks.of(svc),
                         StepProgress(on_step) if on_step is not None else None,
                         GroupStream(on_group) if on_group is not None else None) if h is not None]
    if not score and turns is not None:
        raise ValueError("rollout_and_score(score=False): multi-turn needs the rewards as they come")
    loop = RolloutLoop(svc, Requests.from_config(cfg, step, eos_ids, responses), scorer, selection, hooks)
    return loop.run(prompts, rows)


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
