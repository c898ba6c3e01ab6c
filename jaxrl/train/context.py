"""The update side of a run, as typed components (ARCHITECTURE.md, "Components"): what the update stage,
the warm-up and the checkpoints read, built once from the config.

    Policy          the policy's train state: params, opt_state, ref_params (kl_coef > 0; with LoRA the base
                    weights, read from params). One object
                    shared by the trainer, the graph's nodes and the train pool's thread, each of which
                    replaces its fields (the update donates the old arrays)
    UpdateContext   the train mesh and its shardings, the loss, the fixed micro-batch shape and the update
                    that runs over it: `Updater` (fixed micro-batches), `BlockwiseUpdater` (MetroRLHF,
                    with a `KVStager` when it reads the rollout's K/V) or `FusedStep` (no micro-batches:
                    one bucketed batch). Every field exists in every run; the ones a config does not use
                    are None, and the update stage branches on `fused`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.config.train import TrainConfig
from models import ModelConfig, lora

from . import rl
from .blockwise import BlockwiseUpdater
from .rollout_kv import KVStager, kv_capacity
from .step import LossSpec, make_logprob_fn, make_train_step
from .update import Updater


class Policy:
    """The policy's train state. With LoRA (`models.lora`) the reference policy is the base model with the
    adapters off: `ref_params` reads it from the live params (no copy, never stale), and a checkpoint holds the
    adapters and their optimizer state only (the base comes back from where it came: the init or the HF
    checkpoint). `save_base`: a checkpoint also holds the base weights, when the run changes them (the
    supervised warm start trains the base of a LoRA run) and their source would not give them back."""

    def __init__(self, params, opt_state, ref_params=None, *, save_base: bool = False):
        self.params, self.opt_state, self._ref, self.save_base = params, opt_state, ref_params, save_base
        self.lora = lora.has_adapters(params)       # (fixed for a run: an update never adds or drops adapters)

    @property
    def ref_params(self):
        return lora.base(self.params) if self.lora else self._ref

    @ref_params.setter
    def ref_params(self, value):
        if not self.lora:
            self._ref = value

    def start_reference(self) -> None:
        """The reference policy RL compares against (algo.kl_coef > 0), when it has none yet: the weights RL
        starts from (after the warm start). A copy, because the update donates (and so deletes) the live
        params; with LoRA the base is the reference, nothing to copy."""
        if self.ref_params is None:
            self.ref_params = jax.tree.map(jnp.copy, self.params)

    def state(self) -> dict:
        """What a checkpoint saves of it."""
        state = {"params": lora.split(self.params)[0], "opt_state": self.opt_state}
        if self._ref is not None and not self.lora:
            state["ref_params"] = self._ref
        if self.save_base and self.lora:
            state["base"] = lora.base(self.params)
        return state

    def load_state(self, state: dict) -> None:
        """`state()`'s inverse: the trainable params joined with this policy's frozen ones."""
        params = lora.rebase(self.params, state["base"]) if "base" in state else self.params
        self.params = lora.join(state["params"], lora.split(params)[1])
        self.opt_state = state["opt_state"]
        self.ref_params = state.get("ref_params")


@dataclasses.dataclass(frozen=True)
class FusedStep:
    """trainer.micro_batch_tokens=null: one fused train step over the bucketed batch (`lax.scan` over
    `algo.micro_batches`) and its log-prob pass."""

    step: Callable
    logprobs: Callable


@dataclasses.dataclass(frozen=True)
class UpdateContext:
    cfg: TrainConfig
    model_cfg: ModelConfig
    mesh: Mesh
    shardings: Any
    spec: LossSpec
    pack_len: int                  # tokens per packed row
    mb_rows: int | None            # rows per fixed micro-batch (None: the fused step's bucketed batch)
    updater: Updater | BlockwiseUpdater | None
    fused: FusedStep | None
    stager: KVStager | None        # MetroRLHF kv_source=rollout: the rollout's K/V on the train mesh
    policy: Policy

    @classmethod
    def build(cls, cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh, shardings, policy: Policy, tx,
              dtype) -> "UpdateContext":
        a, t = cfg.algo, cfg.trainer
        spec = LossSpec.from_config(a, temperature=cfg.rollout.temperature or 1.0, trainer=t)
        pack_len = cfg.pack_len or -(-(cfg.data.max_prompt_len + cfg.rollout.max_new_tokens) // 32) * 32
        updater = fused = stager = mb_rows = None
        if t.micro_batch_tokens and t.backward == "blockwise":      # MetroRLHF: blocks over cached K/V
            updater = BlockwiseUpdater(model_cfg, spec, tx, block_size=t.block_size, kv_source=t.kv_source)
            if rl.uses_rollout_kv(cfg):
                stager = KVStager(model_cfg, mesh, kv_capacity(cfg), dtype)
        elif t.micro_batch_tokens:      # fixed-shape micro-batches: one compiled gradient step
            updater = Updater(model_cfg, spec, tx)
        else:
            fused = FusedStep(make_train_step(model_cfg, spec, tx, a.micro_batches), make_logprob_fn(model_cfg, spec))
        if updater is not None:
            mb_rows = rl.micro_batch_rows(cfg, mesh, pack_len)
        return cls(cfg, model_cfg, mesh, shardings, spec, pack_len, mb_rows, updater, fused, stager, policy)
