"""What a checkpoint of an RL run holds, and putting it back: each component's own state.

    save(ckpt, step, cfg, policy, components, rollout, rewards)
    step = restore(ckpt, cfg, policy, components, rollout, rewards)     # None: nothing usable, start fresh
    export(run_dir, cfg, model_cfg, policy, tokenizer)             # the end: Hugging Face (and PEFT) files

Arrays (the checkpoint's state): the policy's params and opt_state (with LoRA: the adapters and theirs), the
reference weights when kl_coef is set or the teacher is the reference (not with LoRA: the base is the reference),
each registered component's own (`jaxrl.train.components`: PPO's critic, under "critic"). Meta (JSON): the step, the config, the rollout side's (`RolloutSide.state_dict`:
the loader's position, the long-prompt queue, the planner, the length ranker, one-step-async's next
rollout) and the reward scheduler's adaptive timeouts.

A resume on another layout (`relayout`: another process count, mesh or rollout instances; preflight.LAYOUT_KEYS)
restores the arrays into the new shardings and the global state as it is (the loader's cursor, the long-prompt
queue, the ranker, the timeouts: the same on every process). Two parts belong to the old layout: StreamRL's
scaled-up pool (instances per process) starts again from `engine.instances`, said in one line; one-step-async's
rollouts made ahead (each process's own prompts and tokens) cannot move to another process count, and such a
resume stops in one line.
"""

from __future__ import annotations

from pathlib import Path

import jax

from jaxrl.config import to_yaml
from jaxrl.config.distill import needs_reference
from jaxrl.config.train import TrainConfig
from jaxrl.rewards import RewardScheduler
from models import save_hf
from models.peft_io import save_peft

from .checkpoint import CheckpointManager
from .context import Policy
from .components import restore_targets, restored_all, saved_states
from .preflight import StartupError
from .rollout_side import RolloutSide


def save(ckpt: CheckpointManager, step: int, cfg: TrainConfig, policy: Policy, components: dict,
         rollout: RolloutSide, rewards: RewardScheduler) -> None:
    meta = {"step": step, "config": to_yaml(cfg), **rollout.state_dict(),
            "reward_scheduler": rewards.state_dict()}       # the adaptive timeouts' anchors
    ckpt.save(step, {**policy.state(), **saved_states(components)}, meta)


def restore(ckpt: CheckpointManager, cfg: TrainConfig, policy: Policy, components: dict,
            rollout: RolloutSide, rewards: RewardScheduler, *, relayout: bool = False) -> int | None:
    """The latest usable checkpoint into the components; its step (None: none, or none usable). `relayout`: the
    layout keys changed (module docstring; another process count is seen here)."""
    if ckpt.latest_step() is None:
        return None
    if needs_reference(cfg):          # shapes and shardings of the restore target
        policy.ref_params = policy.params
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          {**policy.state(), **restore_targets(components, policy)})
    got = ckpt.restore(target=target)
    if got is None:          # every checkpoint was unusable (moved aside, logged): start fresh
        policy.ref_params = None
        restored_all(components, None)
        return None
    step, state, meta = got
    saved = ckpt.processes(step)
    if relayout or saved not in (None, jax.process_count()):
        meta = moved_meta(meta, cfg, saved)
    policy.load_state(state)
    restored_all(components, state)
    rollout.load_state_dict(meta)
    if "reward_scheduler" in meta:
        rewards.load_state_dict(meta["reward_scheduler"])
    return int(meta["step"])


def moved_meta(meta: dict, cfg: TrainConfig, saved_processes: int | None) -> dict:
    """`meta` for a resume on another layout (module docstring): StartupError where a part cannot move."""
    n = jax.process_count()
    if meta.get("ahead") and saved_processes is not None and saved_processes != n:
        raise StartupError(f"trainer.max_staleness={cfg.trainer.max_staleness}: checkpoint step {meta['step']} holds "
                           f"{len(meta['ahead'])} rollout(s) made ahead by each of its {saved_processes} processes "
                           f"(their own prompts and tokens), which cannot move to {n} processes; resume it on "
                           f"{saved_processes}")
    pool = int(meta.get("instances", cfg.engine.instances))
    if pool != cfg.engine.instances and cfg.stage_balance.scale_up and jax.process_index() == 0:
        print(f"[train] stage_balance.scale_up: the checkpoint's pool of {pool} generation instances per process "
              f"belongs to its layout; the scale-up starts again from engine.instances={cfg.engine.instances}",
              flush=True)
    return {**meta, "instances": cfg.engine.instances}


def export(run_dir, cfg: TrainConfig, model_cfg, policy: Policy, tokenizer) -> None:
    """The run's final weights as a Hugging Face checkpoint in RUN_DIR/hf (with LoRA: merged) and, with LoRA,
    the adapter alone as PEFT files in RUN_DIR/adapter."""
    save_hf(Path(run_dir) / "hf", model_cfg, policy.params, tokenizer=tokenizer)
    if policy.lora:
        save_peft(Path(run_dir) / "adapter", model_cfg, policy.params, base_model=cfg.model.hf_path)
