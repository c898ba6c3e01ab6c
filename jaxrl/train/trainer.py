"""The synchronous, colocated RL trainer (what verl does), stage by stage.

    setup:   tokenizer -> data shard -> reward pool (every reward name resolved, here and in a worker)
             -> model + train mesh (fsdp x tp over all devices) -> optimizer -> rollout instances on
             this process's devices -> checkpoints/metrics (resume if any)
    warm-up: every rollout step shape (the instances' bounded buckets) and the update's executables
             over its fixed micro-batch shape are compiled, so the RL steps compile nothing
    warm start (optional): supervised steps on the built-in tasks' demonstrations (skipped for other data)
    each RL step: prompts -> rollout -> rewards -> advantages -> packed global batch
             -> fixed-shape micro-batches -> [reference / old log-probs] -> update(s) -> weights
             resharded into the rollout instances
    end:     checkpoint, HF export (weights, tokenizer, generation config), curves.png

A run that fails before its first RL step completes leaves nothing a later run would resume from: its
checkpoint 0 and the config.yaml it wrote are removed, so a retry with another config starts clean.

Every stage lives in its own module; this file only orders them, times them and records metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

from jaxrl.config import to_yaml
from jaxrl.config.train import TrainConfig
from jaxrl.rewards import check_rewards, reward_names
from jaxrl.runtime import CompileCounter
from jaxrl.data import DataLoader, PromptDataset, encode_demonstrations, encode_prompts
from models import init, load_hf, load_tokenizer, logical_axes, save_hf
from sharding import ShardingRules, padded_vocab_for, shardings_for

from . import rl
from .batch import FIELDS, INT_FIELDS, Sample
from .blockwise import BlockwiseUpdater
from .rollout_kv import KVStager
from jaxrl.rollout.shapes import fine_bucket
from .checkpoint import CheckpointManager
from .curves import plot_run
from .distributed import global_sum
from .metrics import MetricsLogger, Profiler
from .optim import init_state
from .preflight import ResumePlan, StartupError, check_tokenizer, plan_resume, write_config
from .step import make_logprob_fn, make_train_step
from .update import Updater

log = logging.getLogger("jaxrl.train")


class Trainer:
    def __init__(self, cfg: TrainConfig, plan: ResumePlan | None = None):
        """`plan`: the start-up decision of `preflight.plan_resume` (made here when None)."""
        self.cfg, self.run_dir = cfg, Path(cfg.run_dir)
        self.plan = plan if plan is not None else plan_resume(cfg)
        self.is_main = jax.process_index() == 0
        self.model_cfg, self.dtype = cfg.model.model_config(), cfg.model.jnp_dtype()
        self.tokenizer = load_tokenizer(check_tokenizer(cfg))
        self._setup_data()
        self.pool = cfg.rewards.build()
        try:
            check_rewards(reward_names(self.dataset, cfg.rewards.fn, cfg.rewards.registry), self.pool)
        except ValueError as e:
            self.pool.close()
            raise StartupError(str(e)) from None
        self.reward_guard = rl.RewardFailureGuard(cfg.rewards.max_failed_steps)
        layout = cfg.train_layout.build()
        if layout.size != jax.device_count():
            raise SystemExit(f"train_layout {layout.name} needs {layout.size} devices; "
                             f"{jax.device_count()} are visible over {jax.process_count()} process(es)")
        self.mesh = layout.make_mesh(jax.devices())
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
        self.tx, self.lr = cfg.optim.build(cfg.steps * cfg.algo.mini_batches)
        self.opt_state = init_state(self.tx, self.params, self.shardings, self.mesh)
        temperature = cfg.rollout.temperature or 1.0
        a = cfg.algo
        self.spec = a.build(temperature=temperature, trainer=cfg.trainer)
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
                self.stager = KVStager(self.model_cfg, self.mesh, self._kv_capacity(), self.dtype)
        elif t.micro_batch_tokens:      # fixed-shape micro-batches: one compiled gradient step
            self.updater = Updater(self.model_cfg, self.spec, self.tx)
            self.mb_rows = rl.micro_batch_rows(cfg, self.mesh, self.pack_len)
        else:
            self.updater = None
            self.train_step = make_train_step(self.model_cfg, self.spec, self.tx, a.micro_batches)
            self.logprob_fn = make_logprob_fn(self.model_cfg, self.spec)
        # Global params: every process's instances get their copies by an on-device reshard (no host trip).
        self.svc = e.build(self.model_cfg, self.params, devices=jax.local_devices())
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", keep=cfg.keep_checkpoints)
        self.step = 0
        self.resumed = self._maybe_resume()
        self.metrics = MetricsLogger(self.run_dir, is_main=self.is_main, resume_step=self.step)
        self.compiles = CompileCounter()     # per-step XLA compilations (metrics: compiles, compile_s)
        self.profiler = Profiler(self.run_dir, cfg.profile_steps)

    def _kv_capacity(self) -> int:
        """Tokens of one step's exported rollout K/V at most: every sequence at its largest page bucket."""
        cfg = self.cfg
        ps = cfg.engine.page_size
        pages = -(-(cfg.data.max_prompt_len + cfg.rollout.max_new_tokens) // ps)
        return cfg.algo.prompts_per_step * cfg.algo.group_size * fine_bucket(pages) * ps

    # ---------------------------------------------------------------------------------------- setup
    def _setup_data(self):
        d, cfg = self.cfg.data, self.cfg
        if d.source == "builtin":
            from jaxrl.data.tasks import BUILTIN_TASKS
            ds = PromptDataset.builtin(list(d.tasks) or sorted(BUILTIN_TASKS), d.num_examples, cfg.seed)
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
        self.loader = DataLoader(ds, cfg.algo.prompts_per_step // n_proc, process_index=jax.process_index(),
                                 process_count=n_proc, shuffle=d.shuffle, seed=cfg.seed)

    def _state(self):
        state = {"params": self.params, "opt_state": self.opt_state}
        if self.ref_params is not None:
            state["ref_params"] = self.ref_params
        return state

    def _save(self):
        meta = {"step": self.step, "loader": self.loader.state_dict(), "config": to_yaml(self.cfg)}
        self.ckpt.save(self.step, self._state(), meta)

    def _maybe_resume(self) -> bool:
        if self.ckpt.latest_step() is None:
            return False
        if self.cfg.algo.kl_coef:
            self.ref_params = self.params
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self._state())
        got = self.ckpt.restore(target=target)
        if got is None:          # every checkpoint was unusable (moved aside, logged): start fresh
            self.ref_params = None
            return False
        step, state, meta = got
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.ref_params = state.get("ref_params")
        self.step = int(meta["step"])
        self.loader.load_state_dict(meta["loader"])
        self.svc.update_weights(self.params)
        if self.is_main:
            print(f"[train] resumed from {(self.run_dir / 'checkpoints').resolve()} at RL step {self.step}", flush=True)
        return True

    # ----------------------------------------------------------------------------------- warm start
    def warm_start(self):
        """Supervised steps on demonstrations (built-in tasks), before RL; skipped on resume."""
        w = self.cfg.warm_start
        if w.steps == 0 or self.resumed:
            return
        from jaxrl.data.tasks import BUILTIN_TASKS

        other = sorted({row["task"] for row in self.dataset} - set(BUILTIN_TASKS))
        if other:
            if self.is_main:
                print(f"[train] warm start skipped: it supervises the built-in tasks only, and the data has task "
                      f"{other[0]!r} (set warm_start.steps=0 to silence this)", flush=True)
            return
        tx, _ = w.optim.build(w.steps)
        opt = init_state(tx, self.params, self.shardings, self.mesh)
        sft = self.cfg.algo.build(temperature=1.0, trainer=self.cfg.trainer, kind="sft")
        updater = Updater(self.model_cfg, sft, tx) if self.updater else None
        step_fn = None if updater else make_train_step(self.model_cfg, sft, tx, 1)
        if w.batch_size % jax.process_count():
            raise SystemExit(f"warm_start.batch_size={w.batch_size} must divide over {jax.process_count()} processes")
        loader = DataLoader(self.dataset, w.batch_size // jax.process_count(), process_index=jax.process_index(),
                            process_count=jax.process_count(), seed=self.cfg.seed + 1)
        sft_cfg = dataclasses.replace(self.cfg, algo=dataclasses.replace(  # NLL: token-mean, one update per batch
            self.cfg.algo, agg="token-mean", micro_batches=1, mini_batches=1))
        bar = tqdm(range(w.steps), desc="warm start", disable=not self.is_main)
        for i in bar:
            pairs = encode_demonstrations(next(loader), self.tokenizer, self.cfg.data.chat)
            samples = [Sample(p, r, 0.0) for p, r in pairs]
            if updater:
                mbs = rl.micro_batches(samples, sft_cfg, self.mesh, self.pack_len, self.cfg.rollout.max_new_tokens,
                                       self.mb_rows)
                self.params, opt, m = updater.update(self.params, opt, mbs)
            else:
                batch = rl.global_batch(samples, sft_cfg, self.mesh, self.pack_len, self.cfg.rollout.max_new_tokens)
                self.params, opt, m = step_fn(self.params, opt, batch, 1.0)   # weights carry the denominator
            if i % 10 == 0 or i == w.steps - 1:
                nll = float(m["nll"])
                bar.set_postfix(nll=f"{nll:.3f}")
                self.metrics.log_tb("warm_start/nll", nll, i)
        self.svc.update_weights(self.params)

    # ------------------------------------------------------------------------------------- RL step
    def rl_step(self) -> dict:
        cfg, G = self.cfg, self.cfg.algo.group_size
        t0 = time.perf_counter()
        rows = next(self.loader)
        prompts = encode_prompts(rows, self.tokenizer, cfg.data.chat)
        comps, rewards, rstats = rl.rollout_and_score(self.svc, self.pool, self.tokenizer, cfg, prompts, rows,
                                                      self.step, self.tokenizer.eos_ids)
        self.reward_guard.update(rstats)         # raises after rewards.max_failed_steps all-failed steps
        t2 = time.perf_counter()
        t1 = t2 - rstats["seconds"]      # rewards overlap the rollout; reward_s is the wait after it
        lens = [len(c.tokens) for c in comps]
        adv = rl.advantages(cfg, rewards, lens)
        samples = [Sample(prompts[k // G], c.tokens, adv[k]) for k, c in enumerate(comps)]
        if self.updater:
            m = self._update(samples, [c.kv for c in comps] if self.stager else None)
        else:
            m = self._update_fused(samples)
        t3 = time.perf_counter()
        self.svc.update_weights(self.params)
        t4 = time.perf_counter()
        if int(m["skipped"]):
            log.warning("step %d: non-finite loss or gradient norm; update skipped", self.step)
        return self._metrics(rewards, lens, rstats, m, dict(rollout_s=t1 - t0, reward_s=t2 - t1, train_s=t3 - t2,
                                                             sync_s=t4 - t3, step_seconds=t4 - t0))

    def _update(self, samples, kvs=None) -> dict:
        """Fixed-shape micro-batches: [reference / old log-probs per micro-batch], then `mini_batches`
        updates over consecutive groups of them. `kvs`: the completions' exported K/V (kv_source=rollout)."""
        cfg, mini = self.cfg, self.cfg.algo.mini_batches
        mbs, rows = rl.micro_batches(samples, cfg, self.mesh, self.pack_len, cfg.rollout.max_new_tokens, self.mb_rows,
                                     mini, with_rows=True)
        caches = None
        if kvs is not None:          # the rollout's K/V, packed like each micro-batch (on the train mesh)
            offsets = self.stager.stage(kvs)
            cached, lengths = [kv.length for kv in kvs], [len(s.prompt) + len(s.response) for s in samples]
            row_len = self.updater.padded_len(self.pack_len)
            caches = [self.stager.packed(self.stager.index(rows, offsets, cached, lengths, j * self.mb_rows,
                                                           self.mb_rows, row_len)) for j in range(len(mbs))]
        for mb in mbs:
            if self.spec.kl_coef:
                mb["ref_logp"] = self.updater.logprobs(self.ref_params, mb)
            if mini > 1:
                mb["old_logp"] = self.updater.logprobs(self.params, mb)
        per = len(mbs) // mini
        blocks = skipped = 0
        for k in range(mini):
            part = slice(k * per, (k + 1) * per)
            kw = {"kv": caches[part]} if caches is not None else {}
            self.params, self.opt_state, m = self.updater.update(self.params, self.opt_state, mbs[part], **kw)
            if isinstance(self.updater, BlockwiseUpdater):
                blocks, skipped = blocks + self.updater.last["blocks"], skipped + self.updater.last["skipped"]
        m = jax.device_get(m)
        if isinstance(self.updater, BlockwiseUpdater):      # it says that it ran (blockwise/... metrics)
            m.update({"blockwise/blocks": blocks, "blockwise/skipped": skipped})
        return m

    def _update_fused(self, samples) -> dict:
        """trainer.micro_batch_tokens=null: one bucketed batch, one fused step per mini-batch."""
        cfg = self.cfg
        batch = rl.global_batch(samples, cfg, self.mesh, self.pack_len, cfg.rollout.max_new_tokens)
        if self.spec.kl_coef:
            batch["ref_logp"] = self.logprob_fn(self.ref_params, batch)
        mb = cfg.algo.mini_batches
        if mb > 1:
            batch["old_logp"] = self.logprob_fn(self.params, batch)
        else:   # on-policy, one update: old log-probs are the current ones (ratio 1, exact)
            batch["old_logp"] = None
        rows_per = batch["tokens"].shape[0] // mb
        for k in range(mb):
            part = {n: v[k * rows_per:(k + 1) * rows_per] for n, v in batch.items() if v is not None}
            self.params, self.opt_state, m = self.train_step(self.params, self.opt_state, part, 1.0)
        return jax.device_get(m)

    # -------------------------------------------------------------------------------------- warm-up
    def warm_up(self):
        """Compile every executable the RL steps will run: the rollout instances' bounded step shapes and
        the update over the fixed micro-batch shape (grad, apply, log-probs), and the weight sync."""
        if not self.cfg.trainer.warmup:
            return
        t0 = time.perf_counter()
        r = self.cfg.rollout
        n = self.svc.warm([r.build(n=self.cfg.algo.group_size, stop_token_ids=self.tokenizer.eos_ids,
                                   return_kv=rl.uses_rollout_kv(self.cfg))])
        if self.updater:
            sharding = NamedSharding(self.mesh, P(("dp", "fsdp"), None))
            keys = list(FIELDS) + ["ref_logp"] * bool(self.spec.kl_coef) + ["old_logp"] * (self.cfg.algo.mini_batches > 1)
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
        self.svc.update_weights(self.params)
        if self.is_main:     # (step 0's `compiles` metric counts them, with the warm start's)
            print(f"[train] warm-up: {n} rollout/update executables compiled in {time.perf_counter() - t0:.1f} s",
                  flush=True)

    def _metrics(self, rewards, lens, rstats, m, times) -> dict:
        from jax.experimental import multihost_utils
        all_r = np.asarray(rewards, np.float64)
        all_l = np.asarray(lens, np.float64)
        if jax.process_count() > 1:
            all_r = np.asarray(multihost_utils.process_allgather(all_r)).ravel()
            all_l = np.asarray(multihost_utils.process_allgather(all_l)).ravel()
        counts = global_sum([rstats["timeouts"], rstats["crashes"], sum(s["preemptions"] for s in self.svc.stats())])
        out = {"reward_mean": all_r.mean(), "reward_std": all_r.std(),
               "pass_rate": float(np.mean(all_r >= 1.0)), "response_len_mean": all_l.mean(),
               "response_len_p50": float(np.percentile(all_l, 50)), "response_len_p90": float(np.percentile(all_l, 90)),
               "response_len_max": all_l.max(), "kl": m["kl"], "entropy": m["entropy"], "clip_frac": m["clip_frac"],
               "grad_norm": m["grad_norm"], "loss": m["loss"], "skipped": m["skipped"],
               "lr": float(self.lr(self.step * self.cfg.algo.mini_batches)),
               "reward_timeouts": counts[0], "reward_crashes": counts[1], "preemptions_total": counts[2],
               "tokens_per_s": all_l.sum() / max(times["rollout_s"], 1e-9), **times,
               **{k: v for k, v in m.items() if k.startswith("blockwise/")}}
        return {k: (float(v) if not isinstance(v, int) else v) for k, v in out.items()}

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
        import shutil

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
