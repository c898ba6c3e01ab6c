"""The RL trainer: it builds the run's components from the config and orders a step's stages; what each
stage does lives in its own module (ARCHITECTURE.md, "Components"). Synchronous and colocated by default
(what verl does); StreamRL's disaggregated pools, dynamic-batch pipelining and one-step-async with
`placement=disaggregated` (`pipeline.py`).

    setup:   tokenizer -> prompts -> reward pool (every reward name resolved) -> train mesh (all devices, or
             the train pool) and the policy -> the update side (`context.UpdateContext`) -> the registered
             components the config turns on (`components.py`: PPO's critic, OPD's teacher) ->
             [stream trainer] -> rollout instances -> [train pool thread, gradient stream, scale-up] -> the
             rollout side (`rollout_side.RolloutSide`: loader, tail batching, skew placement, planner, PAT)
             -> the step's graph (`jaxrl.flow`) -> checkpoints (resume if any: `run_state`) and metrics
    warm start (optional): supervised steps on the built-in tasks' demonstrations (skipped for other data)
    warm-up: every executable the RL steps run (`warm_up.py`; its thread may start with the warm start)
    each RL step: the chain `algo.graph` plans, run on the components (`flow.TrainContext`; built-in
             nodes in `jaxrl/flow/nodes.py`: rollout => rewards -> advantages -> [repartition] ->
             [reference] -> update), then the weights into the rollout instances (`RolloutSide.sync`: on
             the layout the next rollout starts on) and the step's metrics
    end:     checkpoint, HF export (weights, tokenizer, generation config), curves.png

A run that fails before its first RL step leaves nothing to resume from (its checkpoint 0 and config.yaml go).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax
from tqdm import tqdm

from jaxrl.config.distill import teacher_devices
from jaxrl.config.train import WHOLE_BATCH_ADVANTAGES, TrainConfig
from jaxrl.eval.periodic import PeriodicEval
from jaxrl.flow import Flow, SampleBuffer, StepData, TrainContext
from jaxrl.rewards import RewardPool, RewardScheduler, check_rewards, reward_names
from jaxrl.rollout import RolloutService
from jaxrl.runtime import CompileCounter
from models import load_tokenizer, logical_axes, lora
from models.peft_io import load_weights
from sharding import ShardingRules, padded_vocab_for, shardings_for

from . import rl, run_state
from .balance import ScaleUp
from .checkpoint import CheckpointManager
from .components import Parts, build_components, start_all
from .context import Policy, UpdateContext
from .curves import draw_run_curves
from .distributed import global_max, global_sum
from .grad_stream import GradientStream
from .metrics import MetricsLogger, Profiler
from .optim import init_state, make_optimizer
from .pipeline import TrainWorker, check_staleness, split_devices
from .preflight import (ResumePlan, check_tokenizer, discard_unstarted, plan_resume, startup_errors,
                        write_config)
from .rollout_side import RolloutSide, load_prompts, requests_in_flight
from .samples import SamplesLog, step_records
from .step_metrics import carry_metrics, placement_metrics, staleness_metrics, step_metrics, tail_metrics
from .stream import StreamTrainer
from .trajectories import MultiTurn
from .warm_start import supervised_warm_start
from .warm_up import start_early, warm_up

log = logging.getLogger("jaxrl.train")


def _devices(cfg: TrainConfig, layout) -> tuple[list, list, list]:
    """(train devices, this process's generation devices, the devices reserved for components): all of them
    shared (colocated), or StreamRL's disjoint pools (placement=disaggregated: the generation pool with the
    scale-up's spare instances); teacher.placement=pool reserves the last teacher.devices of each process."""
    k = teacher_devices(cfg)
    reserved = [d for p in range(jax.process_count())
                for d in sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)[-k:]] if k else []
    if cfg.placement == "disaggregated":
        sb, e = cfg.stage_balance, cfg.engine
        spare = ((sb.max_instances or e.instances) - e.instances) * e.tp
        try:
            train, gen, spare = split_devices(train_size=layout.size, gen_per_process=e.num_devices,
                                              spare_per_process=spare)
        except ValueError as err:
            raise SystemExit(str(err)) from None
        return train, gen + spare, reserved
    shared = [d for d in jax.devices() if d not in reserved]
    local = [d for d in jax.local_devices() if d not in reserved]
    pool = f" (and {k} per process for the teacher's pool)" if k else ""
    if layout.size != len(shared):
        raise SystemExit(f"train_layout {layout.name} needs {layout.size} devices; {len(shared)} are visible over "
                         f"{jax.process_count()} process(es){pool}")
    if len(local) % layout.tp:     # (each process's batch rows are its own: replicated over tp)
        raise SystemExit(f"train_layout {layout.name}: a tp group of {layout.tp} devices would span processes "
                         f"({len(local)} device(s) in each of {jax.process_count()}{pool}); tp must divide "
                         "a process's devices")
    return shared, local, reserved


def out_of_time(budget_min: float | None, started: float) -> bool:
    """Whether `time_budget_min` has passed since RL started, as every process agrees (the longest clock decides,
    so all stop after the same step)."""
    if budget_min is None:
        return False
    return bool(global_max(int(time.monotonic() - started > 60.0 * budget_min)))


class Trainer:
    exit_watch = None      # closed first in close() (__main__'s multi-process runs: heartbeat.ExitWatch)

    def __init__(self, cfg: TrainConfig, plan: ResumePlan | None = None, timeline=None):
        """`plan`: the start-up decision of `preflight.plan_resume` (made here when None). `timeline`
        (`pipeline.Timeline`): record each pool's busy spans (benchmarks)."""
        self.cfg, self.run_dir, self.timeline = cfg, Path(cfg.run_dir), timeline
        self.plan = plan if plan is not None else plan_resume(cfg)
        self.is_main = jax.process_index() == 0
        model_cfg, dtype, t, a = cfg.model.model_config(), cfg.model.jnp_dtype(), cfg.trainer, cfg.algo
        source = check_tokenizer(cfg)
        self.tokenizer = load_tokenizer(source)
        with startup_errors(prefix="data.source: "):      # (a file without one usable row: one line)
            self.dataset = load_prompts(cfg, self.tokenizer)
        with startup_errors():                            # held-out prompts (a split leaves the training rows)
            self.evaluator, self.dataset = PeriodicEval.build(cfg, self.tokenizer, self.dataset)
        self.pool = RewardPool.from_config(cfg.rewards)
        scored = list(self.dataset) + (self.evaluator.all_rows if self.evaluator is not None else [])
        with startup_errors(self.pool):     # (the held-out rows' rewards too: one check, one worker process)
            check_rewards(reward_names(scored, cfg.rewards.fn, cfg.rewards.registry, columns=True), self.pool)
        rewards = RewardScheduler.from_config(cfg.rewards, self.pool)   # cancellation; code: sandbox, timeouts
        with startup_errors(self.pool, prefix="rollout.env: "):   # multi-turn: environments stepped in the pool
            turns = MultiTurn.from_config(cfg, self.tokenizer, self.pool, self.dataset)
        layout = cfg.train_layout.build()
        train_devices, gen_devices, reserved = _devices(cfg, layout)
        mesh = layout.make_mesh(train_devices)
        vocab = padded_vocab_for(model_cfg, layout)     # vocab rows padded to a multiple of tp
        shardings = shardings_for(logical_axes(model_cfg, vocab_size=vocab), mesh, ShardingRules.train(model_cfg, layout))
        params = load_weights(model_cfg, key=jax.random.key(cfg.seed), dtype=dtype, hf_path=cfg.model.hf_path,
                              adapter=cfg.model.lora.adapter, shardings=shardings, vocab_size=vocab)
        tx, self.lr = make_optimizer(cfg.optim, cfg.steps * a.mini_batches)
        policy = Policy(params, init_state(tx, params, shardings, mesh), save_base=cfg.warm_start.steps > 0)
        uc = UpdateContext.build(cfg, model_cfg, mesh, shardings, policy, tx, dtype)
        with startup_errors(self.pool):     # the registered components that are on (PPO's critic, OPD's teacher)
            components = build_components(cfg, Parts(model_cfg, source, uc, train_devices, reserved, cfg.seed, dtype))
        # Global params: every process's instances get their copies by an on-device reshard (no host trip).
        svc = RolloutService.from_config(cfg.engine, model_cfg, params, devices=gen_devices,
                                         order="lpt" if cfg.rollout.skew.enabled and cfg.rollout.skew.lpt else "fcfs",
                                         max_requests=requests_in_flight(cfg, jax.process_count()))
        if timeline is not None:        # each engine step is a busy span of the generation pool
            svc.observers.append(lambda a_, b: timeline.add("gen", "decode", a_, b))
        worker = gstream = self.balance = None
        if cfg.placement == "disaggregated":     # the train pool's thread; streamed gradients (one process)
            worker = TrainWorker(timeline)
            if not (t.max_staleness or jax.process_count() > 1 or a.advantage in WHOLE_BATCH_ADVANTAGES
                    or a.objective != "ppo"):
                gstream = GradientStream(cfg, uc.spec, uc.updater, mesh, pack_len=uc.pack_len, mb_rows=uc.mb_rows,
                                         executor=worker, stager=uc.stager)
            if cfg.stage_balance.scale_up:
                self.balance = ScaleUp(cfg.stage_balance, cfg.engine.tp)
        stream = None        # RollPacker: gradients also on rollout devices freed mid-rollout, one update
        if t.stream.enabled:
            stream = StreamTrainer(cfg, t.stream, model_cfg, uc.spec, uc.updater, mesh, pack_len=uc.pack_len,
                                   mb_rows=uc.mb_rows, stager=uc.stager, gs=gstream)
        rs = RolloutSide(cfg, self.tokenizer, self.dataset, svc, policy, rewards,
                         rl.RewardFailureGuard(cfg.rewards.max_failed_steps), stream=stream, gstream=gstream,
                         run_dir=self.run_dir, turns=turns)
        with startup_errors(self.pool):     # DistFlow: the step's graph, planned and bound to its functions
            self.flow = Flow.build(cfg, streamed_update=bool(stream or gstream))
        databuffer = SampleBuffer(mesh, uc.pack_len) if t.repartition == "tokens" else None
        self.train = TrainContext(cfg, self.tokenizer, uc, rs, rewards, rs.reward_guard, databuffer, worker, stream,
                                  gstream, log, components)
        self.policy, self.update, self.rollout, self.svc = policy, uc, rs, svc
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", keep=cfg.keep_checkpoints)
        self.step = 0
        self.resumed = self._resume()
        if not self.resumed:      # StreamRL's length ranker from rollout.skew.ranker.pairs (a bad row: file, line)
            with startup_errors(self.pool, prefix="rollout.skew.ranker.pairs: "):
                rs.warm_start_ranker()
        self.metrics = MetricsLogger(self.run_dir, is_main=self.is_main, resume_step=self.step)
        self.samples = SamplesLog(self.run_dir, is_main=self.is_main, resume_step=self.step)
        self.compiles = CompileCounter()     # per-step XLA compilations (metrics: compiles, compile_s)
        self.profiler = Profiler(self.run_dir, cfg.profile_steps)

    # ----------------------------------------------------------------------------------- checkpoints
    def _save(self):
        tc = self.train
        run_state.save(self.ckpt, self.step, self.cfg, self.policy, tc.components, self.rollout, tc.rewards)

    def _resume(self) -> bool:
        tc = self.train
        with startup_errors(self.pool, convert=False):    # (a checkpoint this config cannot resume: one line)
            step = run_state.restore(self.ckpt, self.cfg, self.policy, tc.components, self.rollout, tc.rewards,
                                     relayout=bool(self.plan.relayout))
        if step is None:
            return False
        self.step = step
        self.rollout.sync(self.policy.params, step, base_changed=True)
        if self.is_main:       # (another layout: the process count, the train mesh, the instances)
            saved, now = self.ckpt.processes(step), jax.process_count()
            moved = [*self.plan.relayout, *([f"{saved} -> {now} processes"] if saved not in (None, now) else [])]
            print(f"[train] resumed from {(self.run_dir / 'checkpoints').resolve()} at RL step {self.step}"
                  + (f" on another layout ({', '.join(moved)}): the arrays restored into its shardings" if moved
                     else ""), flush=True)
        return True

    # ------------------------------------------------------------------------------- before RL steps
    def warm_start(self):
        """Supervised steps on demonstrations (built-in tasks), before RL; skipped on resume. With LoRA they
        train the base weights (full-parameter), not the adapters. The warm-up's thread compiles meanwhile."""
        start_early(self.update, self.rollout, balance=self.balance, step=self.step)
        if self.cfg.warm_start.steps == 0 or self.resumed:
            return
        uc, params = self.update, self.policy.params
        # With LoRA the warm start trains the base (it stands for the pretraining/SFT a base model comes with);
        # RL then trains the adapters on it, and the warmed base is the reference policy.
        base = supervised_warm_start(self.cfg, self.dataset, self.tokenizer, lora.base(params),
                                     lora.base(uc.shardings), uc.mesh, uc.pack_len, uc.mb_rows, uc.model_cfg,
                                     self.metrics, is_main=self.is_main, rl_spec=uc.spec)
        self.policy.params = lora.rebase(params, base)
        self.svc.update_weights(self.policy.params)

    def warm_up(self):
        """Compile every executable the RL steps will run (`warm_up.py`)."""
        if not self.cfg.trainer.warmup:
            return
        t0, bg = time.perf_counter(), self.cfg.trainer.background_compile and self.step == 0
        n = warm_up(self.update, self.rollout, balance=self.balance, background=bg, components=self.train.components)
        if self.is_main:     # (step 0's `compiles` metric counts them, with the warm start's)
            print(f"[train] warm-up: {n} rollout/update executables compiled in {time.perf_counter() - t0:.1f} s"
                  + ", the rest on a thread (after step 0)" * bg, flush=True)

    # ------------------------------------------------------------------------------------- RL step
    def rl_step(self) -> dict:
        """One step: the planned chain of the graph's nodes (`jaxrl.flow`) on this process's data, then the
        weight sync and the step's metrics."""
        cfg, tc, pol = self.cfg, self.train, self.policy
        t0 = time.perf_counter()
        if self.timeline is not None:
            self.timeline.step = self.step
        data = self.flow.run(tc, StepData(self.step))
        rstats, m = data.stats, data.train_metrics
        staleness = check_staleness(self.step, [data.version], cfg.trainer.max_staleness)
        t2 = self.flow.rollout_end(data)
        t3, synced = time.perf_counter(), self.svc.synced_bytes
        self.rollout.sync(pol.params, self.step + 1)
        t4 = time.perf_counter()
        if self.timeline is not None:
            if tc.worker is None:      # colocated: the update ran on the shared devices, after the rollout
                self.timeline.add("train", "update", t2, t3)
            jax.block_until_ready(jax.tree.leaves([i.weights for i in self.svc.instances]))
            self.timeline.add("gen", "sync", t3, time.perf_counter())
        if int(m["skipped"]):
            log.warning("step %d: non-finite loss or gradient norm; update skipped", self.step)
        out = self._metrics(data, staleness, dict(rollout_s=rstats["rollout_s"], reward_s=rstats["reward_s"],
                                                  train_s=t3 - t2, sync_s=t4 - t3, step_seconds=t4 - t0), synced)
        if self.balance is not None:          # StreamRL's scale-up, between steps (its stage/ metrics)
            warm = self.rollout.sampling_params() if cfg.trainer.warmup else None
            out.update(self.balance.step(self.svc, rstats["rollout_s"], tc.worker.take_busy(), pol.params,
                                         warm=warm, grow=lambda n: self.rollout.grow(n, pol.params),
                                         instances=self.rollout.instances))
        return out

    def _metrics(self, data: StepData, staleness, times: dict, synced: int) -> dict:
        """The step's metrics: the step's own, then each mechanism's under its prefix."""
        cfg, tc, rstats = self.cfg, self.train, data.stats
        all_rewards, all_lens = data.extra.get("rollout", (data.rewards, data.lens))   # before a group filter
        out = step_metrics(all_rewards, all_lens, rstats, data.train_metrics, times,
                           lr=float(self.lr(self.step * cfg.algo.mini_batches)), svc=self.svc)
        out["preemptions"] = rstats["preempted"]
        out["sync_bytes"] = self.svc.synced_bytes - synced     # weight bytes into the rollout (LoRA: the adapters)
        out["flow/samples"] = int(global_sum([len(data.samples or [])])[0])    # trained, over all processes
        out.update(data.metrics)                   # the nodes' own (flow/...: group filter, repartition)
        self.samples.write(self.step, "train", step_records(data, self.tokenizer, cfg.log_completions))
        out.update(tc.rewards.metrics())           # reward/...: cancellations, elapsed time, adaptive timeouts
        carry = cfg.rollout.tail_batching.carry_partial
        if data.plan:
            out.update(tail_metrics(data.plan, rstats, all_lens, trained=len(data.rows)))
            out.update(carry_metrics(rstats) if carry else {})
        out.update(rstats["mechanisms"])           # the rollout's: tail/queue_len, planner/, pat/
        out.update(self.rollout.observe(self.step, data.prompts, data.lens))     # skew/: the ranker learns
        if cfg.trainer.max_staleness or carry:     # async/: the tokens' staleness histogram
            out.update(staleness_metrics(self.step, data.completions, cfg.trainer.max_staleness, data.version))
        if cfg.placement == "disaggregated":     # StreamRL: the pools, the streamed groups, staleness, the bubble
            out.update(placement_metrics(self.svc, self.update.mesh.size, tc.gstream, staleness, data.train_wait_s))
        return out

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
            pol = self.policy
            if self.cfg.algo.kl_coef:
                pol.start_reference()
            start_all(self.train.components, pol)     # PPO's critic from the policy, OPD's reference teacher
            if not self.resumed and self.step == 0:
                self._save()
            self.warm_up()
            first_step, started, stopped = self.step, time.monotonic(), False
            bar = tqdm(total=cfg.steps, initial=self.step, desc="rl", disable=not self.is_main)
            while self.step < cfg.steps and not stopped:
                evaluated = self.evaluate()
                self.profiler.maybe_start(self.step)
                m = self.rl_step()
                self.profiler.maybe_stop(self.step)
                late = self.compiles.names() if self.step > first_step else []
                m.update(self.compiles.take())   # this step's compilations (warm start's count in step 0's)
                if late:
                    log.info("step %d compiled %d executable(s) after warm-up (%.1f s): %s", self.step, len(late),
                             m["compile_s"], ", ".join(sorted(set(late))))
                m.update(evaluated)      # (the evaluation ran before the step, on the weights its rollout used)
                self.metrics.log(self.step, m)
                history.append(m)
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward_mean']:.3f}", len=f"{m['response_len_mean']:.1f}")
                self.step += 1
                stopped = self.step < cfg.steps and out_of_time(cfg.time_budget_min, started)
                if (cfg.save_every is not None and self.step % cfg.save_every == 0) or self.step == cfg.steps or stopped:
                    self._save()
            bar.close()
            if stopped and self.is_main:
                print(f"[train] time_budget_min={cfg.time_budget_min} spent after RL step {self.step} of steps="
                      f"{cfg.steps}: checkpoint {self.step} saved; the same command continues from it", flush=True)
            final = self.evaluate(force=stopped)   # after the last update: a row of its own (step = steps)
            if final:
                self.metrics.log(self.step, final)
            if cfg.export_hf:
                run_state.export(self.run_dir, cfg, self.update.model_cfg, self.policy, self.tokenizer)
        except BaseException:
            if self.step == 0 and not self.resumed:
                self.profiler.close()
                self.ckpt.close()
                if self.is_main:
                    discard_unstarted(self.run_dir, self.plan)
            raise
        finally:
            self.close()
            if self.is_main and self.cfg.curves:
                draw_run_curves(self.run_dir)
        return history

    def evaluate(self, force: bool = False) -> dict:
        """The held-out evaluation due before RL step `self.step` (`jaxrl.eval.periodic`; `force`: the last one of a
        run its time budget stopped): its eval/ metrics, or {}."""
        if self.evaluator is None or not (force or self.evaluator.due(self.step)):
            return {}
        waited = 0.0
        if self.rollout.background is not None:
            # The warm-up's thread still compiles the exact buckets and the instances run on the cover shapes
            # (`background.py`), which pad every prefill to the largest bucket: many small prefills of held-out
            # prompts would each pay for it (measured: 100 SmolLM2 prompts 490 s instead of ~70). Wait for the
            # exact buckets now, as step 1 would: step 0's rollout then runs on them too (a run with an
            # evaluation at its start is as reproducible as one without, but not bit-equal to it at step 0).
            waited, self.rollout.background = self.rollout.background.finish(self.svc), None
        m = self.evaluator.run(self.step, self.svc, self.pool, self.samples, version=self.rollout.engine_version,
                               turns=self.rollout.turns)
        return m | ({"eval/compile_wait_s": waited} if waited else {})

    def close(self):
        for part in (self.rollout.background, self.exit_watch, self.profiler, self.pool, self.metrics, self.samples,
                     self.train.worker):
            if part is not None:
                part.close()
