"""The rollout side of a run: the generation instances and the mechanisms that decide what they run and on
which layout, as one component (ARCHITECTURE.md, "Components").

    rs = RolloutSide.build(cfg, tokenizer, dataset, model_cfg, policy, devices, stream=..., gstream=...)
    got = rs.take(step)             # the step's rollout with its rewards (asynchronous: the one made ahead)
    rs.run_ahead(step, k)           # generation k steps ahead (trainer.max_staleness): rollouts up to step + k
    rs.sync(params)                 # the new weights into the instances, on the layout the next rollout uses

What it owns, each built from its config section:
  * the prompts: the data loader and RollPacker's tail batching (`TailBatcher`: a short round's
    speculative draw and race, dynamic sampling's waves, a long round from the long-prompt queue);
  * the rollout service (`RolloutService`: the instances, PAT's switch driver `svc.adaptive`);
  * StreamRL's skew placement (`SkewStep`: the length ranker, long-tail instances, LPT order);
  * RollPacker's TP planner (the layout of the next round type, from this round's preemptions);
  * multi-turn (`rollout.env`, `jaxrl.train.trajectories`): each sample a trajectory whose environment steps in
    the reward workers as its turns end, continued in the engine with each observation.
The gradient streams (RollPacker's stream trainer, StreamRL's pipelining on the train pool) are fed from
here as groups are scored: each rollout begins them once (dynamic sampling's waves all join one stream).

The rollout side's decisions are taken at the rollout's own end (its metrics too), so one-step-async, whose
next rollout starts before the weight sync, runs every one of them a step ahead: the round plan is saved
with the prefetched rollout and the layout the next rollout starts on is set right there (`relayout`).
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from pathlib import Path

import jax
import numpy as np

from jaxrl.config.train import TrainConfig
from jaxrl.data import DataLoader, PromptDataset, encode_prompts
from jaxrl.data.tasks import DEFAULT_TASKS
from jaxrl.rewards import RewardScheduler
from jaxrl.rollout import RolloutService, SamplingParams
from jaxrl.rollout.memory import DEFAULT_MEMORY_FRACTION, device_memory, holds_request
from jaxrl.rollout.planner import RolloutLayout, TPPlanner, apply as apply_layout, total_preemptions
from jaxrl.rollout.tail_batching import TailBatcher, launch_counts

from . import rl
from .background import BackgroundCompile
from .batch import Sample, trained_mask
from .context import Policy
from .distributed import allgather, exchange, global_sum
from .grad_stream import GradientStream
from .pipeline import Prefetched
from .preflight import StartupError
from .rollout_components import (CarriedPartials, GroupStream, NoScores, PatTicks, Placement, RaceSelection,
                                 StepProgress, StreamedRewards, TrajectoryScores)
from .rollout_loop import Requests, RolloutLoop, uses_rollout_kv
from .rounds import tail_round
from .skew_step import SkewStep
from .shrink import kept_instances
from .stream import StreamTrainer
from .trajectories import MultiTurn, env_metrics
from .weight_swap import MidRolloutSwap

log = logging.getLogger("jaxrl.train")


def requests_in_flight(cfg: TrainConfig, process_count: int) -> int:
    """The most requests one rollout holds at once on one process: its share of the step's prompts x samples;
    a tail-batching short round launches ⌈η_p·P⌉ x ⌈η_r·G⌉ (`launch_counts`; a long round and dynamic
    sampling's refill waves, which run one after another, launch no more). No instance ever runs more, so
    step shapes above it are never reached: the engine's max_batch is capped by it (fewer executables to
    compile at start, a smaller KV pool where it is sized from max_batch)."""
    a, tb = cfg.algo, cfg.rollout.tail_batching
    if tb.enabled:
        prompts, responses = launch_counts(a.prompts_per_step, a.group_size, tb.eta_prompts, tb.eta_responses,
                                           process_count)
        return prompts * responses
    return -(-a.prompts_per_step // process_count) * a.group_size


def load_prompts(cfg: TrainConfig, tokenizer) -> PromptDataset:
    """`data`'s prompts (built-in tasks or a file), those longer than data.max_prompt_len skipped (warned)."""
    d = cfg.data
    if d.source == "builtin":
        ds = PromptDataset.builtin(list(d.tasks) or list(DEFAULT_TASKS), d.num_examples, cfg.seed)
    else:
        ds = PromptDataset.from_file(d.source, prompt_key=d.prompt_key, answer_key=d.answer_key)
    lens = [len(p) for p in encode_prompts(ds, tokenizer, d.chat)]
    keep = [row for row, n in zip(ds, lens) if n <= d.max_prompt_len]
    if len(keep) < len(ds):
        log.warning("skipped %d of %d prompts longer than data.max_prompt_len=%d tokens (longest %d)",
                    len(ds) - len(keep), len(ds), d.max_prompt_len, max(lens))
        if not keep:
            raise SystemExit(f"no prompt fits data.max_prompt_len={d.max_prompt_len}")
        ds = PromptDataset(keep, source=ds.source, skipped=ds.skipped)
    n_proc = jax.process_count()
    if cfg.algo.prompts_per_step % n_proc:
        raise SystemExit(f"algo.prompts_per_step={cfg.algo.prompts_per_step} must divide over {n_proc} processes")
    return ds


class RolloutSide:
    def __init__(self, cfg: TrainConfig, tokenizer, dataset: PromptDataset, svc: RolloutService, policy: Policy,
                 rewards: RewardScheduler, reward_guard: rl.RewardFailureGuard, *, stream: StreamTrainer | None,
                 gstream: GradientStream | None, run_dir: Path, turns: MultiTurn | None = None):
        self.cfg, self.tokenizer, self.dataset, self.svc, self.policy = cfg, tokenizer, dataset, svc, policy
        self.rewards, self.reward_guard, self.stream, self.gstream = rewards, reward_guard, stream, gstream
        self.run_dir, self.is_main = run_dir, jax.process_index() == 0
        self.turns = turns              # multi-turn (rollout.env): trajectories with an environment
        self.engine_version = 0         # the step whose weights the generation instances hold
        self.ahead: collections.deque[Prefetched] = collections.deque()   # rollouts of later steps, already made
        self.background: BackgroundCompile | None = None     # the warm-up's thread, until step 1's rollout starts
        self.instances = cfg.engine.instances   # the instances a rollout starts on: configured, or scaled up (`grow`)
        n_proc, per_step, tb = jax.process_count(), cfg.algo.prompts_per_step // jax.process_count(), \
            cfg.rollout.tail_batching
        self.tail = None
        if tb.enabled:     # RollPacker: short rounds draw eta_prompts x more rows; long rounds draw none
            self.tail = TailBatcher(cfg.algo.prompts_per_step, cfg.algo.group_size, tb.eta_prompts, tb.eta_responses,
                                    process_index=jax.process_index(), process_count=n_proc, gather=allgather,
                                    carry_partial=tb.carry_partial, max_tokens=cfg.rollout.max_new_tokens)
            per_step = self.tail.launch
        self.loader = DataLoader(dataset, per_step, process_index=jax.process_index(), process_count=n_proc,
                                 shuffle=cfg.data.shuffle, seed=cfg.seed)
        sk, e = cfg.rollout.skew, cfg.engine
        self.skew = None
        if sk.enabled:           # StreamRL: length ranker -> long-tail prompts on dedicated instances, LPT inside
            self.skew = SkewStep(sk, max_prompt_len=cfg.data.max_prompt_len, group_size=cfg.algo.group_size,
                                 max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.seed, tp=e.tp)
        if svc.adaptive is not None and n_proc > 1:      # PAT: one decision for all processes, at common ticks
            svc.adaptive.agree = functools.partial(exchange, tag="pat")
        self.planner = TPPlanner.from_config(e.planner, e.num_devices, cfg.model.model_config(), e.tp,  # RollPacker
                                             fits=self.layout_fits)

    def layout_fits(self, tp: int) -> bool:
        """Whether a TP-`tp` rollout instance's memory budget holds one max_seq_len request (the planner)."""
        e, devices = self.cfg.engine, self.svc.devices[:tp]
        budget = e.kv_bytes_per_device
        if budget is None:
            total = device_memory(devices)
            if total is None:
                return True
            budget = int(total * (e.kv_memory_fraction or DEFAULT_MEMORY_FRACTION))
        dtype = jax.tree.leaves(self.policy.params)[0].dtype
        return holds_request(self.svc.cfg, devices, page_size=e.page_size, budget=budget, dtype=dtype,
                             max_seq_len=e.max_seq_len)

    # ------------------------------------------------------------------------------------- rollout
    def take(self, step: int, score: bool = True) -> Prefetched:
        """Step `step`'s rollout: the one made ahead when there is one, else collected now."""
        if self.ahead and self.ahead[0].step == step:
            return self.ahead.popleft()
        if self.ahead:
            raise RuntimeError(f"step {step}: the rollouts made ahead are of steps {[p.step for p in self.ahead]}")
        return self.collect(step, score=score)

    def run_ahead(self, step: int, k: int, score: bool = True, swap: MidRolloutSwap | None = None) -> None:
        """Generation up to `k` policy versions ahead of training (trainer.max_staleness): while step `step`
        trains, the rollouts of the steps up to step + k (and before the run's end) not made yet are collected
        on the weights the instances hold now. With k = 1 it is StreamRL's one-step-async. `swap`
        (trainer.swap_step): step `step`'s update enters the first of them mid-rollout (`weight_swap`)."""
        nxt = self.ahead[-1].step + 1 if self.ahead else step + 1
        while nxt <= min(step + k, self.cfg.steps - 1):
            if swap is not None:
                self.svc.observers.append(swap.observe)
            try:
                self.ahead.append(self.collect(nxt, score=score))
            finally:
                if swap is not None:
                    self.svc.observers.remove(swap.observe)
            if swap is not None:
                swap.finish()
                self.engine_version, swap = swap.version, None
            nxt += 1
        if swap is not None:           # nothing left to generate (the run's last steps): the weights go in now
            swap.finish()
            self.engine_version = swap.version

    def collect(self, step: int, score: bool = True) -> Prefetched:
        """Step `step`'s rollout with its rewards (tail batching: a short round's race, dynamic sampling's
        waves, or a long round from the queue), on the weights the generation instances hold now.
        `score=False`: no rewards here (the graph's reward node scores the batch afterwards)."""
        cfg, version = self.cfg, self.engine_version      # (a mid-rollout swap may raise it: its tokens say so)
        waited = None
        if step > 0 and self.background is not None:      # every later rollout on the exact buckets
            waited, self.background = self.background.finish(self.svc), None
        score = score or self.turns is not None     # multi-turn: the environments score during the rollout
        t0 = time.perf_counter()
        preempted = total_preemptions(self.svc)
        on_group = self.begin_streams()
        drop_equal = self.tail is not None and cfg.rollout.tail_batching.dynamic_sampling

        def rollout(rows, race=None, responses=None, carried=None):     # one round, or a dynamic sampling wave
            turns = self.turns.round(self.svc, rows) if self.turns else None    # an environment reset per row
            prompts = encode_prompts(turns.rows if turns else rows, self.tokenizer, cfg.data.chat)
            scorer = (TrajectoryScores(turns) if turns else StreamedRewards(self.rewards, self.tokenizer, cfg.rewards)
                      if score else NoScores())
            selection = None if race is None else RaceSelection(race, scorer, cfg.rollout.tail_batching.carry_partial,
                                                                keep=cfg.algo.group_size)
            hooks = [CarriedPartials(carried, cfg.seed) if carried is not None else None, PatTicks.of(self.svc),
                     *self._stream_hooks(on_group, prompts, drop_equal)]
            loop = RolloutLoop(self.svc, Requests.from_config(cfg, step, self.tokenizer.eos_ids, responses), scorer,
                               selection, [h for h in hooks if h is not None])
            return loop.run(prompts, rows)

        plan = None
        if self.tail:     # a short round's race (+ dynamic sampling's waves) or a long round from the queue
            tb = cfg.rollout.tail_batching
            got = tail_round(self.tail, lambda: next(self.loader), self.dataset, step, rollout,
                             dynamic_sampling=tb.dynamic_sampling, max_waves=tb.max_waves, gather=allgather,
                             staleness=(cfg.trainer.max_staleness, cfg.trainer.stale_samples))
            plan, rows, comps, rewards, rstats = got.plan, got.rows, got.completions, got.rewards, got.stats
        else:
            rows = next(self.loader)
            comps, rewards, rstats = rollout(rows)
        preempted = int(global_sum(total_preemptions(self.svc) - preempted))
        mech = self._mechanism_metrics(step, plan, preempted)
        if waited is not None:
            mech["warmup/background_wait_s"] = waited
        if self.turns:
            mech.update(env_metrics(rstats["env"]))
        if cfg.trainer.max_staleness and (self.planner or self.svc.adaptive is not None):
            self.relayout()       # the next rollout starts before the sync: its layout is set here, at this one's end
        if score:
            self.reward_guard.update(rstats)     # raises after rewards.max_failed_steps all-failed steps
        t2 = time.perf_counter()
        t1 = t2 - rstats["seconds"]      # rewards overlap the rollout; reward_s is the wait after it
        rstats.update(rollout_s=t1 - t0, reward_s=t2 - t1, preempted=preempted, mechanisms=mech)
        return Prefetched(step, version, list(rows), comps, rewards, rstats, plan)

    def _mechanism_metrics(self, step: int, plan, preempted: int) -> dict:
        """The rollout side's own metrics, taken at the rollout's end (one-step-async: step `step`'s rollout
        runs during the previous step's update, so the step that logs it must not read them later)."""
        mech = {}
        if self.planner:         # this round type's next TP, from this step's preemptions (applied at the sync)
            self.planner.decide(plan.kind if plan else "sync", preempted)
            mech.update(self.planner.metrics())
        if self.svc.adaptive is not None:        # PAT: this rollout's switch decisions (records: pat_decisions.jsonl)
            mech.update(self.svc.adaptive.step_metrics(step, self.run_dir / (
                "pat_decisions.jsonl" if self.is_main else f"pat_decisions.process{jax.process_index()}.jsonl")))
        if self.tail:
            mech["tail/queue_len"] = len(self.tail.queue)
        return mech

    def _stream_hooks(self, on_group, prompts: list[list[int]], drop_equal: bool) -> list:
        """This rollout's hooks for the gradient streams and StreamRL's placement: each scored group, with its
        advantages, to the stream (`on_group`; dynamic sampling drops an all-equal group after the round, as a
        long round's filter does); the stream trainer's milestone checks after each engine step (it may free
        half the devices); the skew-aware placement (long-tail instances among those the stream trainer keeps)."""
        cfg, hooks = self.cfg, []
        if on_group is not None:
            def group(p, comps, rewards):
                if drop_equal and np.all(rewards == rewards[0]):
                    return
                adv = rl.advantages(cfg, rewards, [len(c.tokens) for c in comps])
                on_group([Sample(prompts[p], c.tokens, a, kv=c.kv, mask=trained_mask(c)) for c, a in zip(comps, adv)])
            hooks.append(GroupStream(group))
        if self.stream:
            hooks.append(StepProgress(lambda finished, total: self.stream.on_progress(
                self.svc, finished, total, self.instance_classes())))
        if self.skew:
            hooks.append(Placement(lambda ps: self.skew.place(
                self.svc, ps, max_long=kept_instances(self.svc) if self.stream else None)))
        return hooks

    def instance_classes(self) -> dict[int, str] | None:
        """StreamRL's skew placement of the running layout: instance -> "long" / "regular" (None: none)."""
        return self.skew.instance_classes(self.svc) if self.skew else None

    def begin_streams(self):
        """Start the step's gradient stream, once per step (dynamic sampling's waves add to it): RollPacker's
        stream trainer, or StreamRL's dynamic-batch pipelining on the train pool, both at this step's
        weights; both when disaggregated, the train pool streaming from the start and the devices a shrink
        frees beside it. Returns where scored groups go (None: nothing streams)."""
        p = self.policy
        if self.stream:           # (begins its gradient stream: the train pool's one when disaggregated)
            self.stream.begin(p.params, p.ref_params, svc=self.svc)
        elif self.gstream:
            self.gstream.begin(p.ref_params)
        if self.gstream:
            self.gstream.target(p.params, p.ref_params, self.gstream.train_rows)
        return self.stream.add_group if self.stream else self.gstream.add if self.gstream else None

    def observe(self, step: int, prompts, lens) -> dict:
        """After the step: the length ranker learns its (prompt, response length) pairs; skew/... metrics."""
        if not self.skew:
            return {}
        G = self.cfg.algo.group_size
        self.skew.observe(prompts, [lens[k * G:(k + 1) * G] for k in range(len(prompts))],
                          log=self.run_dir / "length_pairs.jsonl" if self.is_main else None)
        return self.skew.finish(step)

    # --------------------------------------------------------------------------------- weights, layout
    def sync(self, params, version: int, *, base_changed: bool = False):
        """The new weights (of step `version`) into the rollout instances, on the layout the next rollout
        starts on (`relayout`: one reshard; a layout seen for the first time compiles its step set here). With
        LoRA only the adapters move unless `base_changed` (a resume: the base came from the checkpoint) or the
        layout changes. Weights a mid-rollout swap already put there (`weight_swap`) do not move again."""
        swapped = version == self.engine_version and not base_changed
        if self.planner or self.svc.adaptive is not None or len(self.svc.instances) != self.instances:
            self.relayout(None if swapped else params, adapters_only=not base_changed)
        elif not swapped:
            self.svc.update_weights(params, adapters_only=not base_changed)
        self.engine_version = self.svc.version = version

    def relayout(self, weights=None, *, adapters_only: bool = False):
        """The generation layout the next rollout starts on: the planner's for the next round type, else the
        configured TP over `instances` (PAT may have switched mid-rollout), syncing `weights` on the way when
        given."""
        e = self.cfg.engine
        layout = self.planner.layout_for(self.tail.next_kind() if self.tail else "sync") if self.planner \
            else RolloutLayout(e.tp, self.instances)
        warm = self.sampling_params() if self.planner and self.cfg.trainer.warmup else None
        if self.svc.adaptive is not None:
            self.svc.adaptive.home(self.svc, layout, weights, warm=warm, adapters_only=adapters_only,
                                   devices=self.instances * e.tp)
        else:
            apply_layout(self.svc, layout, weights, warm=warm, adapters_only=adapters_only)

    def grow(self, instances: int, weights) -> None:
        """StreamRL's scale-up (`balance.ScaleUp`, between steps): every rollout from now on starts on
        `instances` instances, and the service moves there now, `weights` into the new one. The rollout side
        owns the generation layout: the planner's TP and PAT's switches spread over the grown pool."""
        self._set_pool(instances)
        self.relayout(weights)

    def _set_pool(self, instances: int) -> None:
        """The instances a rollout starts on from now on (the planner's layouts follow); more than the devices
        asked for at start (`stage_balance.max_instances`) raise a one-line StartupError."""
        e = self.cfg.engine
        most = self.cfg.stage_balance.max_instances or e.instances
        if instances > most:
            raise StartupError(f"stage_balance.max_instances={self.cfg.stage_balance.max_instances}: the checkpoint's "
                               f"rollout runs on {instances} generation instances (scaled up); resume with "
                               f"stage_balance.max_instances={instances} or more")
        self.instances = instances
        if self.planner:
            self.planner.resize(instances * e.tp)

    def sampling_params(self) -> list:
        """The sampling params every rollout request of this run uses (what `svc.warm` compiles for)."""
        return [SamplingParams.from_config(self.cfg.rollout, n=self.cfg.algo.group_size,
                                           stop_token_ids=self.tokenizer.eos_ids,
                                           return_kv=uses_rollout_kv(self.cfg))]

    # ------------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """The checkpoint meta of the rollout side: the loader's position, the long-prompt queue (global, the
        same on every process), the planner's, the length ranker and the rollouts made ahead (asynchronous)."""
        meta = {"loader": self.loader.state_dict(), "instances": self.instances}
        if self.tail:
            meta["tail"] = self.tail.state_dict()
        if self.planner:
            meta["planner"] = self.planner.state_dict()
        if self.skew:
            meta["skew"] = self.skew.state_dict()
        if self.ahead:
            meta["ahead"] = [p.state_dict() for p in self.ahead]
        return meta

    def load_state_dict(self, meta: dict) -> None:
        self.loader.load_state_dict(meta["loader"])
        self._set_pool(int(meta.get("instances", self.cfg.engine.instances)))    # (the resume's sync moves there)
        if self.tail:
            self.tail.load_state_dict(meta.get("tail", {"queue": [], "rounds": {"short": 0, "long": 0}}))
        if self.planner and "planner" in meta:
            self.planner.load_state_dict(meta["planner"])
        if self.skew and "skew" in meta:
            self.skew.load_state_dict(meta["skew"])
        saved = meta.get("ahead", [meta["prefetched"]] if "prefetched" in meta else [])   # (older checkpoints)
        self.ahead = collections.deque(Prefetched.from_state(d) for d in saved)

    def warm_start_ranker(self) -> None:
        """StreamRL's length ranker from rollout.skew.ranker.pairs (a fresh run); a bad row raises ValueError
        naming the file and line."""
        pairs = self.cfg.rollout.skew.ranker.pairs
        if self.skew and pairs:
            n = self.skew.load_pairs(pairs, self.tokenizer)
            log.info("length ranker: %d warm-start pairs from %s", n, pairs)
