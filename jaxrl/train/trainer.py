"""The RL trainer, stage by stage: synchronous and colocated by default (what verl does); StreamRL's
disaggregated pools, dynamic-batch pipelining and one-step-async with `placement=disaggregated`
(`pipeline.py`; the update stage itself is `update_stage.py`).

    setup:   tokenizer -> data shard -> reward pool (every reward name resolved, here and in a worker)
             -> model + train mesh (fsdp x tp over all devices) -> optimizer -> rollout instances on
             this process's devices -> checkpoints/metrics (resume if any)
    warm-up: every rollout step shape (the instances' bounded buckets) and the update's executables
             over its fixed micro-batch shape are compiled, so the RL steps compile nothing
    warm start (optional): supervised steps on the built-in tasks' demonstrations (skipped for other data)
    each RL step: the chain `algo.graph` plans (`jaxrl.flow`; built-in nodes in `jaxrl/flow/nodes.py`):
             prompts (tail batching: a short round's speculative draw, or a long round from the
             long-prompt queue) -> rollout (the short round's race aborts the slow responses and prompts)
             => rewards (streamed) -> advantages -> [databuffer repartition] -> packed micro-batches
             -> [reference log-probs] -> [old log-probs] + update(s); then the weights resharded into the
             rollout instances (with the planner: on the TP layout it picked for the next round type)
    disaggregated: the groups' gradients run on the train pool's thread as they arrive, one update after
             the rollout; one-step-async: step n's update runs there while step n+1 rolls out on the
             step-before weights (saved in the checkpoint); stage_balance may add an instance after a step
    end:     checkpoint, HF export (weights, tokenizer, generation config), curves.png

A run that fails before its first RL step completes leaves nothing a later run would resume from: its
checkpoint 0 and the config.yaml it wrote are removed, so a retry with another config starts clean.

Every stage lives in its own module; the graph orders them; this file sets them up, times the step and
records its metrics.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

from jaxrl.config import to_yaml
from jaxrl.config.train import WHOLE_BATCH_ADVANTAGES, TrainConfig
from jaxrl.rewards import RewardPool, RewardScheduler, check_rewards, reward_names
from jaxrl.runtime import CompileCounter
from jaxrl.data import DataLoader, PromptDataset, encode_prompts
from jaxrl.data.tasks import DEFAULT_TASKS
from models import init, load_hf, load_tokenizer, logical_axes, save_hf
from sharding import ShardingRules, padded_vocab_for, shardings_for

from jaxrl.flow import Flow, GraphError, SampleBuffer, StepData

from . import rl
from .batch import FIELDS, INT_FIELDS, Sample
from .blockwise import BlockwiseUpdater
from .critic import Critic
from .rollout_kv import KVStager, kv_capacity
from .rounds import tail_round
from jaxrl.rollout.memory import DEFAULT_MEMORY_FRACTION, device_memory, holds_request
from jaxrl.rollout import RolloutService, SamplingParams
from jaxrl.rollout.planner import RolloutLayout, TPPlanner, apply as apply_layout, total_preemptions
from jaxrl.rollout.tail_batching import TailBatcher
from .checkpoint import CheckpointManager
from .curves import plot_run
from .distributed import allgather, global_sum
from .metrics import MetricsLogger, Profiler
from .skew_step import SkewStep
from .step_metrics import step_metrics, tail_metrics
from .warm_start import supervised_warm_start
from .optim import init_state, make_optimizer
from .preflight import ResumePlan, StartupError, check_tokenizer, plan_resume, write_config
from .step import LossSpec, make_logprob_fn, make_train_step
from .balance import ScaleUp
from .grad_stream import GradientStream, warm_sum
from .pipeline import Prefetched, TrainWorker, check_staleness, split_devices
from .stream import StreamTrainer, kept_instances
from .update import Updater

log = logging.getLogger("jaxrl.train")


class Trainer:
    def __init__(self, cfg: TrainConfig, plan: ResumePlan | None = None, timeline=None):
        """`plan`: the start-up decision of `preflight.plan_resume` (made here when None). `timeline`
        (`pipeline.Timeline`): record each pool's busy spans (benchmarks)."""
        self.cfg, self.run_dir = cfg, Path(cfg.run_dir)
        self.plan = plan if plan is not None else plan_resume(cfg)
        self.is_main = jax.process_index() == 0
        self.model_cfg, self.dtype = cfg.model.model_config(), cfg.model.jnp_dtype()
        self.tokenizer = load_tokenizer(check_tokenizer(cfg))
        self._setup_data()
        self.pool = RewardPool.from_config(cfg.rewards)
        try:
            check_rewards(reward_names(self.dataset, cfg.rewards.fn, cfg.rewards.registry), self.pool)
        except ValueError as e:
            self.pool.close()
            raise StartupError(str(e)) from None
        self.reward_guard = rl.RewardFailureGuard(cfg.rewards.max_failed_steps)
        self.rewards = RewardScheduler.from_config(cfg.rewards, self.pool)   # cancellation; code: sandbox, timeouts
        layout = cfg.train_layout.build()
        train_devices, self.gen_devices = jax.devices(), jax.local_devices()
        if cfg.placement == "disaggregated":     # StreamRL: disjoint generation and train pools
            sb, e = cfg.stage_balance, cfg.engine
            spare = ((sb.max_instances or e.instances) - e.instances) * e.tp
            try:
                train_devices, gen, spare = split_devices(train_size=layout.size, gen_per_process=e.num_devices,
                                                          spare_per_process=spare)
            except ValueError as err:
                raise SystemExit(str(err)) from None
            self.gen_devices = gen + spare
        elif layout.size != jax.device_count():
            raise SystemExit(f"train_layout {layout.name} needs {layout.size} devices; "
                             f"{jax.device_count()} are visible over {jax.process_count()} process(es)")
        self.mesh = layout.make_mesh(train_devices)
        self.padded_vocab = padded_vocab_for(self.model_cfg, layout)     # vocab rows padded to a multiple of tp
        self.shardings = shardings_for(logical_axes(self.model_cfg, vocab_size=self.padded_vocab), self.mesh,
                                       ShardingRules.train(self.model_cfg, layout))
        if cfg.model.hf_path:
            _, self.params = load_hf(cfg.model.hf_path, dtype=self.dtype, shardings=self.shardings,
                                     vocab_size=self.padded_vocab)
        else:
            self.params = init(jax.random.key(cfg.seed), self.model_cfg, self.dtype, shardings=self.shardings,
                               vocab_size=self.padded_vocab)
        self.ref_params = None
        self.tx, self.lr = make_optimizer(cfg.optim, cfg.steps * cfg.algo.mini_batches)
        self.opt_state = init_state(self.tx, self.params, self.shardings, self.mesh)
        temperature = cfg.rollout.temperature or 1.0
        a = cfg.algo
        self.spec = LossSpec.from_config(a, temperature=temperature, trainer=cfg.trainer)
        self.critic = None        # PPO's value model (algo.advantage=gae); its weights are made when RL starts
        if a.advantage == "gae":
            self.critic = Critic(self.model_cfg, cfg.critic, cfg.trainer, self.mesh, self.shardings,
                                 cfg.steps * a.mini_batches)
        # Fused grad_step scan + apply_update; rl.global_batch folds the denominator into the weights,
        # so every update passes denominator 1.0 (bitwise the pre-split update).
        e = cfg.engine
        self.pack_len = cfg.pack_len or -(-(cfg.data.max_prompt_len + cfg.rollout.max_new_tokens) // 32) * 32
        t = cfg.trainer
        self.stager = None
        if t.micro_batch_tokens and t.backward == "blockwise":      # MetroRLHF: blocks over cached K/V
            self.updater = BlockwiseUpdater(self.model_cfg, self.spec, self.tx, block_size=t.block_size,
                                            kv_source=t.kv_source)
            self.mb_rows = rl.micro_batch_rows(cfg, self.mesh, self.pack_len)
            if rl.uses_rollout_kv(cfg):
                self.stager = KVStager(self.model_cfg, self.mesh, kv_capacity(cfg), self.dtype)
        elif t.micro_batch_tokens:      # fixed-shape micro-batches: one compiled gradient step
            self.updater = Updater(self.model_cfg, self.spec, self.tx)
            self.mb_rows = rl.micro_batch_rows(cfg, self.mesh, self.pack_len)
        else:
            self.updater = None
            self.train_step = make_train_step(self.model_cfg, self.spec, self.tx, a.micro_batches)
            self.logprob_fn = make_logprob_fn(self.model_cfg, self.spec)
        self.stream = None
        if t.stream.enabled:       # RollPacker: gradients on rollout devices freed mid-rollout, one update
            self.stream = StreamTrainer(cfg, t.stream, self.model_cfg, self.spec, self.updater, self.mesh,
                                        pack_len=self.pack_len, mb_rows=self.mb_rows)
        # Global params: every process's instances get their copies by an on-device reshard (no host trip).
        sk = cfg.rollout.skew
        self.svc = RolloutService.from_config(e, self.model_cfg, self.params, devices=self.gen_devices,
                                              order="lpt" if sk.enabled and sk.lpt else "fcfs")
        self.engine_version = 0         # the step whose weights the generation instances hold
        self.prefetched: Prefetched | None = None      # one-step-async: the next step's rollout, already made
        self.worker = self.gstream = self.balance = None
        self.timeline = timeline
        if timeline is not None:        # each engine step is a busy span of the generation pool
            self.svc.observers.append(lambda a, b: timeline.add("gen", "decode", a, b))
        if cfg.placement == "disaggregated":     # the train pool's thread; streamed gradients (one process)
            self.worker = TrainWorker(timeline)
            if not (t.async_steps or jax.process_count() > 1 or a.advantage in WHOLE_BATCH_ADVANTAGES
                    or rl.uses_rollout_kv(cfg)):      # (the rollout K/V are staged for the whole batch at once)
                self.gstream = GradientStream(cfg, self.spec, self.updater, self.mesh, pack_len=self.pack_len,
                                              mb_rows=self.mb_rows, executor=self.worker)
            if cfg.stage_balance.scale_up:
                self.balance = ScaleUp(cfg.stage_balance, e.tp)
        self.skew = None
        if sk.enabled:           # StreamRL: length ranker -> long-tail prompts on dedicated instances, LPT inside
            self.skew = SkewStep(sk, max_prompt_len=cfg.data.max_prompt_len, group_size=cfg.algo.group_size,
                                 max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.seed, tp=e.tp)
        self.planner = TPPlanner.from_config(e.planner, e.num_devices, self.model_cfg, e.tp,   # RollPacker
                                             fits=self._layout_fits)
        try:        # DistFlow: the step's graph, planned and bound to its functions before any work
            self.flow = Flow.build(cfg, streamed_update=bool(self.stream or self.gstream))
        except GraphError as err:
            self.pool.close()
            raise StartupError(str(err)) from None
        self.databuffer = SampleBuffer(self.mesh, self.pack_len) if t.repartition == "tokens" else None
        self.log = log
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", keep=cfg.keep_checkpoints)
        self.step = 0
        self.resumed = self._maybe_resume()
        if self.skew and cfg.rollout.skew.ranker.pairs and not self.resumed:    # the ranker's warm start
            try:
                n = self.skew.load_pairs(cfg.rollout.skew.ranker.pairs, self.tokenizer)
            except ValueError as e:           # a bad row: file and line in one line
                self.pool.close()
                raise StartupError(f"rollout.skew.ranker.pairs: {e}") from None
            log.info("length ranker: %d warm-start pairs from %s", n, cfg.rollout.skew.ranker.pairs)
        self.metrics = MetricsLogger(self.run_dir, is_main=self.is_main, resume_step=self.step)
        self.compiles = CompileCounter()     # per-step XLA compilations (metrics: compiles, compile_s)
        self.profiler = Profiler(self.run_dir, cfg.profile_steps)

    def _layout_fits(self, tp: int) -> bool:
        """Whether a TP-`tp` rollout instance's memory budget holds one max_seq_len request (the planner)."""
        e, devices = self.cfg.engine, self.svc.devices[:tp]
        budget = e.kv_bytes_per_device
        if budget is None:
            total = device_memory(devices)
            if total is None:
                return True
            budget = int(total * (e.kv_memory_fraction or DEFAULT_MEMORY_FRACTION))
        dtype = jax.tree.leaves(self.params)[0].dtype
        return holds_request(self.model_cfg, devices, page_size=e.page_size, budget=budget, dtype=dtype,
                             max_seq_len=e.max_seq_len)

    # ---------------------------------------------------------------------------------------- setup
    def _setup_data(self):
        d, cfg = self.cfg.data, self.cfg
        if d.source == "builtin":
            ds = PromptDataset.builtin(list(d.tasks) or list(DEFAULT_TASKS), d.num_examples, cfg.seed)
        else:
            ds = PromptDataset.from_file(d.source, prompt_key=d.prompt_key, answer_key=d.answer_key)
        lens = [len(p) for p in encode_prompts(ds, self.tokenizer, d.chat)]
        keep = [row for row, n in zip(ds, lens) if n <= d.max_prompt_len]
        if len(keep) < len(ds):
            log.warning("skipped %d of %d prompts longer than data.max_prompt_len=%d tokens (longest %d)",
                        len(ds) - len(keep), len(ds), d.max_prompt_len, max(lens))
            if not keep:
                raise SystemExit(f"no prompt fits data.max_prompt_len={d.max_prompt_len}")
            ds = PromptDataset(keep, source=ds.source, skipped=ds.skipped)
        self.dataset = ds
        n_proc = jax.process_count()
        if cfg.algo.prompts_per_step % n_proc:
            raise SystemExit(f"algo.prompts_per_step={cfg.algo.prompts_per_step} must divide over {n_proc} processes")
        per_step = cfg.algo.prompts_per_step // n_proc
        tb = cfg.rollout.tail_batching
        self.tail = None
        if tb.enabled:     # RollPacker: short rounds draw eta_prompts x more rows; long rounds draw none
            self.tail = TailBatcher(cfg.algo.prompts_per_step, cfg.algo.group_size, tb.eta_prompts, tb.eta_responses,
                                    process_index=jax.process_index(), process_count=n_proc, gather=allgather)
            per_step = self.tail.launch
        self.loader = DataLoader(ds, per_step, process_index=jax.process_index(),
                                 process_count=n_proc, shuffle=d.shuffle, seed=cfg.seed)

    def _state(self):
        state = {"params": self.params, "opt_state": self.opt_state}
        if self.ref_params is not None:
            state["ref_params"] = self.ref_params
        if self.critic is not None and self.critic.params is not None:
            state["critic"] = self.critic.state()
        return state

    def _save(self):
        meta = {"step": self.step, "loader": self.loader.state_dict(), "config": to_yaml(self.cfg)}
        if self.tail:
            meta["tail"] = self.tail.state_dict()      # the long-prompt queue (global, same on every process)
        if self.planner:
            meta["planner"] = self.planner.state_dict()
        meta["reward_scheduler"] = self.rewards.state_dict()       # the adaptive timeouts' anchors
        if self.skew:
            meta["skew"] = self.skew.state_dict()          # the length ranker and its history
        if self.prefetched is not None:
            meta["prefetched"] = self.prefetched.state_dict()      # one-step-async: the next step's rollout
        self.ckpt.save(self.step, self._state(), meta)

    def _maybe_resume(self) -> bool:
        if self.ckpt.latest_step() is None:
            return False
        if self.cfg.algo.kl_coef:
            self.ref_params = self.params
        if self.critic is not None:       # shapes and shardings of the restore target
            self.critic.init(self.params)
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self._state())
        got = self.ckpt.restore(target=target)
        if got is None:          # every checkpoint was unusable (moved aside, logged): start fresh
            self.ref_params = None
            if self.critic is not None:
                self.critic.params = self.critic.opt_state = None
            return False
        step, state, meta = got
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.ref_params = state.get("ref_params")
        if self.critic is not None:
            self.critic.load(state["critic"])
        self.step = int(meta["step"])
        self.loader.load_state_dict(meta["loader"])
        if self.tail:
            self.tail.load_state_dict(meta.get("tail", {"queue": [], "rounds": {"short": 0, "long": 0}}))
        if self.planner and "planner" in meta:
            self.planner.load_state_dict(meta["planner"])
        if "reward_scheduler" in meta:
            self.rewards.load_state_dict(meta["reward_scheduler"])
        if self.skew and "skew" in meta:
            self.skew.load_state_dict(meta["skew"])
        if "prefetched" in meta:
            self.prefetched = Prefetched.from_state(meta["prefetched"])
        self.engine_version = self.step
        self._sync_weights()
        if self.is_main:
            print(f"[train] resumed from {(self.run_dir / 'checkpoints').resolve()} at RL step {self.step}", flush=True)
        return True

    # ----------------------------------------------------------------------------------- warm start
    def warm_start(self):
        """Supervised steps on demonstrations (built-in tasks), before RL; skipped on resume."""
        if self.cfg.warm_start.steps == 0 or self.resumed:
            return
        self.params = supervised_warm_start(self.cfg, self.dataset, self.tokenizer, self.params, self.shardings,
                                            self.mesh, self.pack_len, self.mb_rows if self.updater else None,
                                            self.model_cfg, self.metrics, is_main=self.is_main)
        self.svc.update_weights(self.params)

    # ------------------------------------------------------------------------------------- RL step
    def collect(self, step: int, score: bool = True) -> Prefetched:
        """Step `step`'s rollout with its rewards (tail batching: a short round's race, dynamic sampling's
        waves, or a long round from the queue), on the weights the generation instances hold now.
        `score=False`: no rewards here (the graph's reward node scores the batch afterwards)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        preempted = total_preemptions(self.svc)
        on_group = self._begin_streams()
        drop_equal = self.tail is not None and cfg.rollout.tail_batching.dynamic_sampling

        def rollout(rows, race=None, responses=None):      # one round, or one of dynamic sampling's waves
            prompts = encode_prompts(rows, self.tokenizer, cfg.data.chat)
            hooks = {}
            if on_group is not None:     # each scored group, with its advantages, to the gradient stream
                def group(p, comps, rewards):
                    if drop_equal and np.all(rewards == rewards[0]):
                        return           # dynamic sampling drops it after the round (a long round's filter)
                    adv = rl.advantages(cfg, rewards, [len(c.tokens) for c in comps])
                    on_group([Sample(prompts[p], c.tokens, a) for c, a in zip(comps, adv)])
                hooks["on_group"] = group
            if self.stream:              # milestone checks after each engine step (may free half the devices)
                hooks["on_step"] = lambda finished, total: self.stream.on_progress(self.svc, finished, total,
                                                                                   self._instance_classes())
            if self.skew:                # (the long-tail instances: among those the stream trainer never frees)
                hooks["route"] = lambda ps: self.skew.place(
                    self.svc, ps, max_long=kept_instances(self.svc) if self.stream else None)
            return rl.rollout_and_score(self.svc, self.rewards, self.tokenizer, cfg, prompts, rows, step,
                                        self.tokenizer.eos_ids, race=race, responses=responses, score=score,
                                        **hooks)

        plan = None
        if self.tail:     # a short round's race (+ dynamic sampling's waves) or a long round from the queue
            tb = cfg.rollout.tail_batching
            got = tail_round(self.tail, lambda: next(self.loader), self.dataset, step, rollout,
                             dynamic_sampling=tb.dynamic_sampling, max_waves=tb.max_waves, gather=allgather)
            plan, rows, comps, rewards, rstats = got.plan, got.rows, got.completions, got.rewards, got.stats
        else:
            rows = next(self.loader)
            comps, rewards, rstats = rollout(rows)
        preempted = int(global_sum(total_preemptions(self.svc) - preempted))
        # The rollout side's own metrics, taken at the rollout's end (one-step-async: step `step`'s rollout
        # runs during the previous step's update, so the step that logs it must not read them later)
        mech = {}
        if self.planner:         # this round type's next TP, from this step's preemptions (applied at the sync)
            self.planner.decide(plan.kind if plan else "sync", preempted)
            mech.update(self.planner.metrics())
        if self.svc.adaptive is not None:        # PAT: this rollout's switch decisions (records: pat_decisions.jsonl)
            mech.update(self.svc.adaptive.step_metrics(step, self.run_dir / "pat_decisions.jsonl"
                                                       if self.is_main else None))
        if self.tail:
            mech["tail/queue_len"] = len(self.tail.queue)
        if self.cfg.trainer.async_steps and (self.planner or self.svc.adaptive is not None):
            self._relayout()       # the next rollout starts before the sync: its layout is set here, at this one's end
        if score:
            self.reward_guard.update(rstats)     # raises after rewards.max_failed_steps all-failed steps
        t2 = time.perf_counter()
        t1 = t2 - rstats["seconds"]      # rewards overlap the rollout; reward_s is the wait after it
        rstats.update(rollout_s=t1 - t0, reward_s=t2 - t1, preempted=preempted, mechanisms=mech)
        return Prefetched(step, self.engine_version, list(rows), comps, rewards, rstats, plan)

    def rl_step(self) -> dict:
        """One step: the planned chain of the graph's nodes (`jaxrl.flow`) on this process's data, then the
        weight sync and the step's metrics."""
        cfg, G = self.cfg, self.cfg.algo.group_size
        t0 = time.perf_counter()
        if self.timeline is not None:
            self.timeline.step = self.step
        data = self.flow.run(self, StepData(self.step))
        plan, rows, rewards, rstats, m = data.plan, data.rows, data.rewards, data.stats, data.train_metrics
        lens, prompts, wait = data.lens, data.prompts, data.train_wait_s
        staleness = check_staleness(self.step, [data.version])
        t2 = data.extra["times"][self.flow.plan.stages[0].head.id][1]     # the rollout's end
        all_rewards, all_lens = data.extra.get("rollout", (rewards, lens))   # before a group filter: every rollout
        t3 = time.perf_counter()
        self._sync_weights()
        self.engine_version = self.step + 1
        t4 = time.perf_counter()
        if self.timeline is not None:
            if self.worker is None:      # colocated: the update ran on the shared devices, after the rollout
                self.timeline.add("train", "update", t2, t3)
            jax.block_until_ready(jax.tree.leaves([i.weights for i in self.svc.instances]))
            self.timeline.add("gen", "sync", t3, time.perf_counter())
        if int(m["skipped"]):
            log.warning("step %d: non-finite loss or gradient norm; update skipped", self.step)
        out = step_metrics(all_rewards, all_lens, rstats, m, dict(rollout_s=rstats["rollout_s"], reward_s=rstats["reward_s"],
                                                          train_s=t3 - t2, sync_s=t4 - t3, step_seconds=t4 - t0),
                           lr=float(self.lr(self.step * cfg.algo.mini_batches)), svc=self.svc)
        out["preemptions"] = rstats["preempted"]
        out["flow/samples"] = int(global_sum([len(data.samples or [])])[0])    # trained, over all processes
        out.update(data.metrics)                   # the nodes' own (flow/...: group filter, repartition)
        out.update(self.rewards.metrics())         # reward/...: cancellations, elapsed time, adaptive timeouts
        if plan:
            out.update(tail_metrics(plan, rstats, all_lens, trained=len(rows)))
        out.update(rstats["mechanisms"])           # the rollout's: tail/queue_len, planner/, pat/
        if self.skew:            # the ranker learns this step's lengths (refresh every k steps)
            self.skew.observe(prompts, [lens[k * G:(k + 1) * G] for k in range(len(prompts))],
                              log=self.run_dir / "length_pairs.jsonl" if self.is_main else None)
            out.update(self.skew.finish(self.step))
        if cfg.placement == "disaggregated":     # StreamRL: the pools, the streamed groups, staleness, the bubble
            out.update(self._placement_metrics(staleness, wait, rstats))
        return out

    def _placement_metrics(self, staleness: int, wait: float, rstats: dict) -> dict:
        gs, cfg = self.gstream, self.cfg
        out = {"placement/gen_devices": sum(self.svc.layout), "placement/train_devices": self.mesh.size,
               "placement/gen_instances": len(self.svc.instances), "placement/staleness": staleness,
               "placement/train_wait_s": wait}
        if gs is not None:
            out.update({"placement/groups_streamed": gs.groups_early, "placement/groups": gs.groups,
                        "placement/micro_batches_streamed": gs.micro_batches_early})
        if self.balance is not None:
            out.update(self.balance.step(self.svc, rstats["rollout_s"], self.worker.take_busy(), self.params,
                                         warm=self._rollout_params() if cfg.trainer.warmup else None))
        return out

    def _instance_classes(self) -> dict[int, str] | None:
        """StreamRL's skew placement of the running layout: instance -> "long" / "regular" (None: none)."""
        return self.skew.instance_classes(self.svc) if self.skew else None

    def _begin_streams(self):
        """Start the step's gradient stream, once per step (dynamic sampling's waves add to it): RollPacker's
        stream trainer, or StreamRL's dynamic-batch pipelining on the train pool, both at this step's
        weights. Returns where scored groups go (None: nothing streams)."""
        if self.stream:
            self.stream.begin(self.params, self.ref_params)
            return self.stream.add_group
        if self.gstream:
            self.gstream.begin(self.ref_params)
            self.gstream.target(self.params, self.ref_params, self.gstream.train_rows)
            return self.gstream.add
        return None

    def _sync_weights(self):
        """The new weights into the rollout instances, on the layout the next rollout starts on (`_relayout`:
        one reshard; a layout seen for the first time compiles its step set here)."""
        if self.planner or self.svc.adaptive is not None:
            self._relayout(self.params)
        else:
            self.svc.update_weights(self.params)

    def _relayout(self, weights=None):
        """The generation layout the next rollout starts on: the planner's for the next round type, else the
        configured one (PAT may have switched mid-rollout), syncing `weights` on the way when given."""
        e = self.cfg.engine
        layout = self.planner.layout_for(self.tail.next_kind() if self.tail else "sync") if self.planner \
            else RolloutLayout(e.tp, e.instances)
        warm = self._rollout_params() if self.planner and self.cfg.trainer.warmup else None
        if self.svc.adaptive is not None:
            self.svc.adaptive.home(self.svc, layout, weights, warm=warm)
        else:
            apply_layout(self.svc, layout, weights, warm=warm)

    def _rollout_params(self) -> list:
        """The sampling params every rollout request of this run uses (what `svc.warm` compiles for)."""
        return [SamplingParams.from_config(self.cfg.rollout, n=self.cfg.algo.group_size,
                                           stop_token_ids=self.tokenizer.eos_ids,
                                           return_kv=rl.uses_rollout_kv(self.cfg))]

    # -------------------------------------------------------------------------------------- warm-up
    def warm_up(self):
        """Compile every executable the RL steps will run: the rollout instances' bounded step shapes and
        the update over the fixed micro-batch shape (grad, apply, log-probs), and the weight sync."""
        if not self.cfg.trainer.warmup:
            return
        t0 = time.perf_counter()
        n = self.svc.warm(self._rollout_params())
        if self.svc.adaptive is not None and self.cfg.engine.adaptive_tp.warm:   # PAT: a switch compiles nothing
            n += self.svc.adaptive.warm_layouts(self.svc, self._rollout_params())
        if self.updater:
            sharding = NamedSharding(self.mesh, P(("dp", "fsdp"), None))
            keys = list(FIELDS) + ["ref_logp"] * bool(self.spec.kl_coef) + ["old_logp"] * (
                self.cfg.algo.mini_batches > 1 or self.cfg.trainer.async_steps > 0)
            mb = {k: jax.ShapeDtypeStruct((self.mb_rows, self.pack_len),
                                          jnp.int32 if k in INT_FIELDS else jnp.float32, sharding=sharding)
                  for k in keys}
            extra = {}
            if self.stager:          # the rollout K/V path: staging writes, the packed gather, the block step on it
                row_len = self.updater.padded_len(self.pack_len)
                ps = self.cfg.engine.page_size
                max_pages = -(-(self.cfg.data.max_prompt_len + self.cfg.rollout.max_new_tokens) // ps)
                self.stager.warm(ps, max_pages, self.mb_rows, row_len)
                extra["kv"] = self.stager.abstract(self.mb_rows, row_len)
            n += self.updater.warm(self.params, self.opt_state, mb,
                                   logp_params=[self.ref_params] if self.ref_params is not None else [], **extra)
            if self.critic is not None:      # PPO: the value pass and the critic's update
                n += self.critic.warm(mb)
            if self.stream:      # the freed devices' gradient / reference executables
                n += self.stream.warm(self.params, self.opt_state, self.ref_params, svc=self.svc)
            if self.gstream:     # the final sum's add program (plain jitted: counted by the compile counter)
                warm_sum(self.gstream, self.params)
        if self.balance:         # every spare instance's step set, so a scale-up compiles nothing
            e, k = self.cfg.engine, len(self.svc.instances)
            self.svc.relayout(e.tp, self.cfg.stage_balance.max_instances, weights=self.params)
            n += self.svc.warm(self._rollout_params())
            self.svc.relayout(e.tp, k, weights=self.params)
        if self.skew:            # the length ranker's train step and forward
            self.skew.ranker.warm()
        self.svc.update_weights(self.params)
        if self.is_main:     # (step 0's `compiles` metric counts them, with the warm start's)
            print(f"[train] warm-up: {n} rollout/update executables compiled in {time.perf_counter() - t0:.1f} s",
                  flush=True)

    # ------------------------------------------------------------------------------------------ run
    def run(self) -> list[dict]:
        """Warm start, then RL steps until `cfg.steps`; returns this process's per-step metrics."""
        cfg, history = self.cfg, []
        if self.plan.resume and not self.resumed:    # every checkpoint proved unusable: a fresh start after all
            self.plan = ResumePlan(False, "config.yaml")
        if self.is_main:
            write_config(cfg, self.plan)
        if self.resumed and self.step >= cfg.steps and self.is_main:
            print(f"[train] {self.run_dir.resolve()} is already at step {self.step} of steps={cfg.steps}; "
                  f"raise steps= to train further", flush=True)
        try:
            self.warm_start()
            if self.cfg.algo.kl_coef and self.ref_params is None:
                # The reference policy: the weights RL starts from (after the warm start). A copy, because
                # the train step donates (and so deletes) the live params.
                self.ref_params = jax.tree.map(jnp.copy, self.params)
            if self.critic is not None and self.critic.params is None:    # PPO: the critic starts from the policy
                self.critic.init(self.params)
            if not self.resumed and self.step == 0:
                self._save()
            self.warm_up()
            self.first_step = self.step
            bar = tqdm(total=cfg.steps, initial=self.step, desc="rl", disable=not self.is_main)
            while self.step < cfg.steps:
                self.profiler.maybe_start(self.step)
                m = self.rl_step()
                self.profiler.maybe_stop(self.step)
                late = self.compiles.names() if self.step > self.first_step else []
                m.update(self.compiles.take())   # this step's compilations (warm start's count in step 0's)
                if late:
                    log.info("step %d compiled %d executable(s) after warm-up (%.1f s): %s", self.step, len(late),
                             m["compile_s"], ", ".join(sorted(set(late))))
                self.metrics.log(self.step, m)
                history.append(m)
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward_mean']:.3f}", len=f"{m['response_len_mean']:.1f}")
                self.step += 1
                if (cfg.save_every is not None and self.step % cfg.save_every == 0) or self.step == cfg.steps:
                    self._save()
            bar.close()
            if cfg.export_hf:
                save_hf(self.run_dir / "hf", self.model_cfg, self.params, tokenizer=self.tokenizer)
        except BaseException:
            if self.step == 0 and not self.resumed:
                self._discard_unstarted()
            raise
        finally:
            self.close()
            self._draw_curves()
        return history

    def _discard_unstarted(self):
        """A run that failed before its first RL step: remove its checkpoint 0 and the config.yaml it wrote,
        so the next run in this directory starts clean (with whatever config it has)."""
        self.profiler.close()
        self.ckpt.close()
        if not self.is_main:
            return
        shutil.rmtree(self.run_dir / "checkpoints" / "0", ignore_errors=True)
        try:
            (self.run_dir / "checkpoints").rmdir()      # only when nothing else (e.g. *.corrupt) is there
        except OSError:
            pass
        if self.plan.write_config == "config.yaml":
            (self.run_dir / "config.yaml").unlink(missing_ok=True)
        print(f"[train] the run failed before its first RL step; removed its checkpoint 0 and config.yaml from "
              f"{self.run_dir.resolve()}, so the next run there starts fresh", file=sys.stderr, flush=True)

    def _draw_curves(self):
        if not self.is_main or not self.metrics.path.exists() or not self.metrics.path.stat().st_size:
            return
        try:
            plot_run(self.run_dir)
        except Exception as e:   # a plot must never hide the run's own outcome
            log.warning("could not draw %s: %s", (self.run_dir / "curves.png").resolve(), e)

    def close(self):
        self.profiler.close()
        self.pool.close()
        self.metrics.close()
        if self.worker is not None:
            self.worker.close()
