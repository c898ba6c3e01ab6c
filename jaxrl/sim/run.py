"""One row of the comparison: `steps` RL steps of one mechanism set, on the virtual clock.

Each step runs the trainer's own code against the simulated engine (`engine.SimService`) and the
simulated reward pool (`rewards.SimRewardPool`):

* the rollout is `rl.rollout_and_score` (rewards scored as responses finish: `async_reward`) or that plus
  `rl.score_batch` after it (the baseline), inside `rounds.tail_round` with tail batching (its
  `TailBatcher` plans the round, its `Race` decides what is kept and aborted);
* PAT is `AdaptiveTP.from_config(engine.adaptive_tp, ...)` — the trainer's `AdaptiveTP` and
  `SwitchController` — attached to the service, switching it mid-generation; between steps
  `AdaptiveTP.home` / `planner.apply` bring it back to the step's layout (RollPacker's `TPPlanner.decide`
  picks it per round type from the step's preemptions, as `Trainer.collect` does);
* the stream trainer is `shrink.milestone_due`, `shrink.shrink_plan` and `shrink.take_shrink` after every
  engine step of a round without a race (as `StreamTrainer.on_progress`); the freed GPUs then compute the
  gradients of groups as they complete;
* StreamRL's skew placement is `skew.plan_placement` with the workload's own mean lengths as the ranker's
  predictions (an oracle, blurred by `ranker_noise`; `Scheduler(order="lpt")` admits longest first), its GPU split
  `balance.best_split` over stage times measured in the baseline row;
* the training-side stages (log-prob forwards, the update, the weight sync) take the cost model's time for
  the step's trained tokens; with a single controller (no `multi_controller`) the driver also spends
  `cluster.driver_s_per_token` on every token of the step's samples (gathered, padded, re-dispatched at each
  stage boundary: veRL's data plane), one process for the whole cluster.

Colocated rows run their stages one after the other on all GPUs. Disaggregated rows run the rollout on the
generation pool while the training pool takes each scored group as it arrives (dynamic-batch pipelining);
with `async_steps` the next rollout starts when this one ends, on weights up to `max_staleness` steps old
(rollout m waits for the weights of step m − k − 1's update, as the trainer's `RolloutSide.run_ahead`).

Simplified (stated): the whole cluster is one engine loop (every instance steps in lockstep, as one
process drives them; across nodes the processes of a real run step independently except where the
race's gather makes them agree every step); the training-side stages are costed per step, not simulated
kernel by kernel.
"""

from __future__ import annotations

import collections
import math

import numpy as np

from jaxrl.flow.databuffer import plan_tokens
from jaxrl.rewards.scheduler import RewardScheduler
from jaxrl.rewards.timeouts import AdaptiveTimeouts
from jaxrl.rollout import skew
from jaxrl.rollout.planner import RolloutLayout, TPPlanner, apply as apply_layout, total_preemptions
from jaxrl.rollout.tail_batching import TailBatcher
from jaxrl.rollout.tp_switch import AdaptiveTP
from jaxrl.train import rl
from jaxrl.train.pipeline import Timeline
from jaxrl.train.rollout_components import (GroupStream, NoScores, Placement, RaceSelection, RequestParams,
                                            StepProgress, StreamedRewards)
from jaxrl.train.rollout_loop import Requests, RolloutLoop
from jaxrl.train.rounds import tail_round
from jaxrl.train.shrink import milestone_due, shrink_plan, take_shrink
from models import preset

from .config import SimConfig, mechanisms_of, train_config
from .cost import attended_pairs
from .records import StepRecord
from .engine import EOS, Clock, SimService
from .workload import _normal
from .rewards import SimRewardPool, SimTokenizer


class _Worker:
    """A device pool's FIFO queue of work items on the virtual clock."""

    def __init__(self, timeline: Timeline, pool: str, devices: int, seconds):
        self.timeline, self.pool, self.devices, self.seconds = timeline, pool, devices, seconds
        self.free = 0.0
        self.spans: list[tuple[float, float]] = []

    def submit(self, at: float, tokens: float, attended: float) -> None:
        start = max(self.free, at)
        self.free = start + self.seconds(tokens, attended, self.devices)
        self.spans.append((start, self.free))

    def done_by(self, t: float) -> float:
        """Seconds of work finished by time `t`."""
        return sum(min(max(0.0, t - a), b - a) for a, b in self.spans)

    def flush(self, until: float = math.inf) -> None:
        """Put the spans (cut at `until`) on the timeline."""
        for a, b in self.spans:
            if a < until:
                self.timeline.add(self.pool, "grad", a, min(b, until))


class RowSim:
    """`steps` RL steps of the mechanisms of `row` (see the module docstring)."""

    def __init__(self, cfg: SimConfig, row: str, cost, workload, *, profile: str | None = None,
                 split: tuple[int, int] | None = None, stage_times: tuple[float, float] | None = None,
                 engine=None, clock=None, params_fn=None):
        """`engine(row_sim) -> service` and `clock` replace the simulated engine and the virtual clock (the
        validation bench runs the same steps on the real `RolloutService` and the wall clock); `params_fn`
        is `rollout_and_score`'s."""
        self.cfg, self.row, self.cost, self.workload = cfg, row, cost, workload
        self.m = set(mechanisms_of(row))
        if "async_steps" in self.m:
            self.m.add("disaggregated")
        G = cfg.cluster.gpus
        self.disagg = "disaggregated" in self.m
        if self.disagg:
            if split is None:
                raise ValueError("a disaggregated row needs the GPU split")
            self.gen_gpus, self.train_gpus = split
        else:
            self.gen_gpus = self.train_gpus = G
        self.model = preset(cfg.model)
        self.tc = train_config(cfg, self.m, gen_gpus=self.gen_gpus, profile=profile,
                               prompt_len=max(workload.prompt_tokens(i) for i in range(min(workload.prompts, 4096))))
        e, tc = self.tc.engine, self.tc
        self.clock = clock if clock is not None else Clock()
        self.params_fn = params_fn
        self.timeline = Timeline()
        self.timeline.t0 = 0.0
        order = "lpt" if "skew" in self.m and tc.rollout.skew.lpt else "fcfs"
        self.order = order
        self.svc = engine(self) if engine is not None else SimService(
            self.model, cost, self.clock, devices=self.gen_gpus, lengths=self._lengths, tp=e.tp,
            instances=e.instances, num_pages=e.num_pages, page_size=e.page_size, max_batch=e.max_batch,
            max_seq_len=e.max_seq_len, prefill_chunk=e.prefill_chunk, prefill_tokens=e.prefill_tokens,
            prefix_sharing=e.prefix_sharing, overlap=e.overlap, batch_buckets_per_octave=e.batch_buckets_per_octave,
            page_buckets=e.page_buckets, order=order, timeline=self.timeline, host_step_s=cfg.cluster.host_step_s)
        self.svc.observers.append(self._engine_step)
        self.svc.adaptive = (AdaptiveTP.from_config(e.adaptive_tp, self.gen_gpus, self.model) if "pat" in self.m
                             else None)
        if self.svc.adaptive is not None:       # adaptive_tp.warm: the trainer's warm-up compiled every candidate
            self.svc.adaptive.seen.update(self.svc.adaptive.controller.candidates)
        a = tc.algo
        tb = tc.rollout.tail_batching
        self.tail = TailBatcher(a.prompts_per_step, a.group_size, tb.eta_prompts, tb.eta_responses) \
            if "tail_batching" in self.m else None
        self.planner = TPPlanner(self.gen_gpus, self.model, e.tp, rise=e.planner.rise, calm_steps=e.planner.calm_steps,
                                 max_tp=e.planner.max_tp, fits=self._layout_fits) if "planner" in self.m else None
        at = tc.rewards.adaptive_timeout
        self.pool = SimRewardPool(self.clock, workload, workers=cfg.cluster.reward_workers,
                                  timeout_s=cfg.cluster.reward_timeout_s, timeline=self.timeline,
                                  timeouts=AdaptiveTimeouts(at.lam, at.t_min, cfg.cluster.reward_timeout_s,
                                                            enabled="async_reward" in self.m))
        self.rewards = RewardScheduler(self.pool)
        self.history: collections.deque = collections.deque(maxlen=tc.trainer.stream.history)
        self.recent: collections.deque = collections.deque(maxlen=tc.rollout.skew.ranker.history)
        self.cursor = 0
        self.seed_rows: dict[int, int] = {}
        self.stage_times = stage_times
        self.records: list[StepRecord] = []
        self._last_engine = 0.0
        self._gen_free = self._weights_ready = 0.0
        self._ready: list[float] = []        # when each finished step's weights reached the generation pool
        self.retired_preemptions = 0

    def _layout_fits(self, tp: int) -> bool:
        """The planner's memory check on the cost model's pools: a TP-tp instance holds a max_seq_len request."""
        e = self.tc.engine
        try:
            pages = self.cost.pages(self.model, tp, page_size=e.page_size, max_batch=e.max_batch,
                                    max_seq_len=e.max_seq_len)
        except ValueError:
            return False
        return pages - 1 >= -(-e.max_seq_len // e.page_size)

    # ------------------------------------------------------------------ the workload as a dataset
    def _lengths(self, prompt, params) -> list[int]:
        index = self.seed_rows[params.seed]
        return self.workload.lengths(index, params.n)

    def dataset_row(self, index: int) -> dict:
        index = int(index) % self.workload.prompts
        return {"index": index, "answer": str(index), "task": "sim", "reward": "sim"}

    def draw(self, n: int | None = None) -> list[dict]:
        n = n or (self.tail.launch if self.tail else self.tc.algo.prompts_per_step)
        rows = [self.dataset_row(self.cursor + k) for k in range(n)]
        self.cursor += n
        return rows

    def __getitem__(self, index: int) -> dict:          # the dataset tail rounds read queued prompts from
        return self.dataset_row(index)

    def _engine_step(self, t0: float, t1: float) -> None:
        self._last_engine = t1

    # ------------------------------------------------------------------ one step
    def _rollout(self, step: int, rec: StepRecord, hooks: list):
        streamed = "async_reward" in self.m or self.disagg

        def rollout(rows, race=None, responses=None):       # (carried partials: refused by SimConfig)
            prompts = [[3] * self.workload.prompt_tokens(r["index"]) for r in rows]
            for r in rows:
                seed = rl.request_seed(self.tc.seed, step, int(r["index"]))
                if self.seed_rows.get(seed, r["index"]) != r["index"]:
                    raise RuntimeError(f"request seed collision at step {step}: rows {self.seed_rows[seed]} and "
                                       f"{r['index']}")
                self.seed_rows[seed] = r["index"]
            scorer = StreamedRewards(self.rewards, SimTokenizer(), self.tc.rewards) if streamed else NoScores()
            parts = [*([Placement(self._place)] if "skew" in self.m else []),
                     *([RequestParams(self.params_fn)] if self.params_fn is not None else []), *hooks]
            loop = RolloutLoop(self.svc, Requests.from_config(self.tc, step, (EOS,), responses), scorer,
                               None if race is None else RaceSelection(race, scorer), parts)
            comps, rewards, st = loop.run(prompts, rows)
            if not streamed:
                t0 = self.clock()
                G = len(comps) // max(1, len(st["accepted"]))
                rewards, _ = rl.score_batch(self.rewards, SimTokenizer(), self.tc, [rows[p] for p in st["accepted"]],
                                            comps, G)
                rec.reward_s += self.clock() - t0
            return comps, rewards, st

        return rollout

    def _place(self, prompts):
        """StreamRL's placement with the workload's mean lengths as the predictions (an oracle ranker)."""
        sk, svc = self.tc.rollout.skew, self.svc
        noise = self.cfg.ranker_noise
        predicted = [float(np.mean(self.workload.lengths(i, self.tc.algo.group_size))) *
                     math.exp(noise * _normal(self.cfg.seed, "ranker", i)) for i in self._placing]
        ptl = skew.linear_ptl(sk.ptl_base_s, sk.ptl_per_seq_s)
        plan = skew.plan_placement(predicted, instances=len(svc.instances), group_size=self.tc.algo.group_size,
                                   cap=min(i.max_batch for i in svc.instances), ptl=ptl, lengths=list(self.recent),
                                   alpha=sk.alpha, default_length=self.tc.rollout.max_new_tokens)
        svc.set_batch_caps(plan.caps)
        return list(plan.instance), list(plan.priority if sk.lpt else [0.0] * len(prompts))

    def step(self, k: int) -> StepRecord:
        tc, svc, clock = self.tc, self.svc, self.clock
        rec = StepRecord(step=k)
        start = self._step_start()
        clock.now = start
        rec.start = start = clock()
        rec.tp = "x".join(map(str, svc.layout[:1])) + f"x{len(svc.layout)}"
        pre0 = total_preemptions(svc) + self._retired()
        sw0 = len(svc.relayouts)
        hooks, early = self._hooks(rec)
        rollout = self._rollout(k, rec, hooks)
        if self.tail:
            tb = tc.rollout.tail_batching
            self._placing = []
            got = tail_round(self.tail, lambda: self._drawn(self.draw()), self, k, self._tracked(rollout),
                             dynamic_sampling=tb.dynamic_sampling, max_waves=tb.max_waves)
            rows, comps, st = got.rows, got.completions, got.stats
            rec.kind, rec.queue = got.plan.kind, len(self.tail.queue)
        else:
            rows = self._drawn(self.draw())
            comps, _, st = self._tracked(rollout)(rows)
        rollout_end = self._last_engine
        rec.rollout_s = rollout_end - start
        rec.reward_s = max(rec.reward_s, clock() - rollout_end)
        rec.engine_steps, rec.aborted, rec.wasted_tokens = st["engine_steps"], st["aborted"], st["wasted_tokens"]
        rec.preemptions = total_preemptions(svc) + self._retired() - pre0
        rec.switches = sum(1 for r in svc.relayouts[sw0:] if r.old_layout != r.new_layout)
        rec.switch_s = sum(r.seconds for r in svc.relayouts[sw0:])
        self.history.extend(len(c.tokens) for c in comps)
        self.recent.extend(len(c.tokens) for c in comps)
        rec.prompts, rec.samples = len(rows), len(comps)
        resp = np.asarray([len(c.tokens) for c in comps], np.float64)
        prompt = np.asarray([len(c.prompt) for c in comps], np.float64)
        rec.response_tokens, rec.max_response = int(resp.sum()), int(resp.max(initial=0))
        tokens, attended = float(resp.sum() + prompt.sum()), attended_pairs(prompt, resp)
        if self.planner:
            self.planner.decide(rec.kind, int(rec.preemptions))
        if "multi_controller" in self.m:
            rec.driver_s = self._repartition_s(comps)
        self._finish(rec, tokens, attended, early, clock())
        self.records.append(rec)
        return rec

    def _repartition_s(self, comps) -> float:
        """DistFlow's databuffer between the rollout and the update (no driver): the token-balanced plan over
        the nodes that `flow.databuffer.SampleBuffer` takes (`plan_tokens` from where the samples are, within
        one packed row); the samples that change node cross the network, every node at once."""
        node = 8
        nodes = self.gen_gpus // node
        bw = getattr(getattr(self.cost, "hw", None), "net_bw", None)
        if nodes < 2 or bw is None or not comps:
            return 0.0
        lengths = [len(c.prompt) + len(c.tokens) for c in comps]
        home = [self.svc.instances[c.instance].devices[0] // node if c.instance < len(self.svc.instances) else 0
                for c in comps]
        pack = self.tc.pack_len or (self.tc.data.max_prompt_len + self.tc.rollout.max_new_tokens)
        plan = plan_tokens(lengths, nodes, home=home, tolerance=pack)
        received = [sum(lengths[i] for i in p if home[i] != q) for q, p in enumerate(plan)]
        return max(received) * self.cfg.cluster.sample_bytes_per_token / bw

    def _drawn(self, rows):
        self._placing = [r["index"] for r in rows]
        return rows

    def _tracked(self, rollout):
        def run(rows, race=None, responses=None):
            self._placing = [r["index"] for r in rows]
            return rollout(rows, race, responses)
        return run

    def _retired(self) -> int:
        return self.svc.retired_preemptions

    def _step_start(self) -> float:
        if not self.records:
            return 0.0
        need = len(self.records) - self.tc.trainer.max_staleness - 1    # rollout m: the update of step m - k - 1
        return max(self._gen_free, self._ready[need] if need >= 0 else 0.0)

    def _hooks(self, rec: StepRecord):
        """Stream trainer / disaggregated pipelining: the rollout loop's hooks (`jaxrl.train.rollout_components`)
        and the train worker."""
        forwards = 1 + int(self.tc.algo.kl_coef > 0)

        def work(tokens, attended, devices):
            return forwards * self.cost.forward_s(tokens, attended, devices) + self.cost.train_s(tokens, attended, devices)

        if self.disagg:
            worker = _Worker(self.timeline, "train", self.train_gpus, work)
            worker.free = max(self._weights_ready, rec.start)

            def on_group(p, comps, rewards):
                resp = np.asarray([len(c.tokens) for c in comps], np.float64)
                prompt = np.asarray([len(c.prompt) for c in comps], np.float64)
                worker.submit(self.clock(), float(resp.sum() + prompt.sum()), attended_pairs(prompt, resp))

            return [GroupStream(on_group)], worker
        if "stream_trainer" not in self.m:
            return [], None
        s = self.tc.trainer.stream
        state = {"last": 0, "freed": None, "held": []}
        worker = _Worker(self.timeline, "freed", self.gen_gpus // 2, work)

        def on_step(finished, total):
            if state["freed"] is not None or not milestone_due(finished, total, state["last"], start=s.start,
                                                               stop=s.stop, step=s.step):
                return
            state["last"] = finished
            plan = shrink_plan(self.svc, s, self.history)
            if not plan.ok:
                return
            take_shrink(self.svc, plan)
            state["freed"] = plan.freed
            rec.shrunk_at = finished / total
            worker.free = self.clock()
            for tokens, attended in state["held"]:
                worker.submit(self.clock(), tokens, attended)

        def on_group(p, comps, rewards):
            resp = np.asarray([len(c.tokens) for c in comps], np.float64)
            prompt = np.asarray([len(c.prompt) for c in comps], np.float64)
            item = (float(resp.sum() + prompt.sum()), attended_pairs(prompt, resp))
            if state["freed"] is None:
                state["held"].append(item)
            else:
                worker.submit(self.clock(), *item)

        return [StepProgress(on_step), GroupStream(on_group)], worker

    def _finish(self, rec: StepRecord, tokens: float, attended: float, early, now: float) -> None:
        """The training side of the step and the weight sync; sets rec.end and the pools' next free times."""
        cost, cfg, tl = self.cost, self.cfg, self.timeline
        forwards = 1 + int(self.tc.algo.kl_coef > 0)
        rollout_end = rec.start + rec.rollout_s
        if not self.disagg:
            t = now
            if "multi_controller" not in self.m:
                rec.driver_s = tokens * cfg.cluster.driver_s_per_token
            if rec.driver_s:
                tl.add("driver", "driver", t, t + rec.driver_s)
                t += rec.driver_s
            fwd = forwards * cost.forward_s(tokens, attended, self.train_gpus)
            train = cost.train_s(tokens, attended, self.train_gpus)
            if early is not None and rec.shrunk_at:          # stream trainer: the freed GPUs' share is done
                whole = forwards * cost.forward_s(tokens, attended, early.devices) + \
                    cost.train_s(tokens, attended, early.devices)
                rec.early_train_s = early.done_by(now)
                share = min(1.0, rec.early_train_s / whole) if whole else 0.0
                fwd, train = fwd * (1 - share), train * (1 - share)
                early.flush(now)
            rec.forward_s, rec.train_s = fwd, train
            for kind, s in (("forward", fwd), ("train", train)):
                tl.add("train", kind, t, t + s)
                t += s
            self._finish_sync(rec, t, across=False)
            self._gen_free = rec.end
            return
        # disaggregated: the train pool took each group as it was scored
        t = max(now, early.free)
        rec.early_train_s = early.done_by(now)
        early.flush()
        rec.train_s = t - now
        self._gen_free = rollout_end
        self._finish_sync(rec, t, across=True)

    def _finish_sync(self, rec: StepRecord, t: float, *, across: bool) -> None:
        """The weight sync (and the layout of the next step: PAT home, the planner's choice)."""
        svc = self.svc
        rec.sync_s = self.cost.sync_s(self.gen_gpus, across_pools=across)
        self.timeline.add("train", "sync", t, t + rec.sync_s)
        t += rec.sync_s
        self.clock.now = max(self.clock.now, t)
        before = len(svc.relayouts)
        synced = getattr(svc, "synced", None)        # the simulator's: the sync rides the layout change (real: None)
        if self.planner:
            kind = self.tail.next_kind() if self.tail else "sync"
            apply_layout(svc, self.planner.layout_for(kind), weights=synced)
        elif svc.adaptive is not None:
            e = self.tc.engine
            svc.adaptive.home(svc, RolloutLayout(e.tp, e.instances), weights=synced)
        moved = svc.relayouts[before:]
        t += sum(r.seconds for r in moved)
        rec.switch_s += sum(r.seconds for r in moved)
        self._weights_ready = t
        self._ready.append(t)
        rec.end = t
        prev_end = self.records[-1].end if self.records else 0.0
        rec.step_s = rec.end - prev_end

    def run(self, progress=None) -> list[StepRecord]:
        for k in range(self.cfg.steps):
            self.step(k)
            if progress is not None:
                progress(self.records[-1])
        return self.records


__all__ = ["RowSim"]
