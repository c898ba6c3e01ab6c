"""PPO's value model (the `critic` role of the `ppo` graph): the policy's architecture with a scalar head,
its values of packed sequences, the clipped value loss under its own optimizer, and GAE on the host.

    critic = Critic(model_cfg, cfg.critic, cfg.trainer, mesh, param_shardings, total_updates)
    critic.init(policy_params)            # trunk copied from the policy (after the warm start), head zeros
    v = critic.values(mb)                 # [rows, L] float32 V at every index of a packed micro-batch
    m = critic.update(mbs)                # Σ_mbs ½·w·max((V−R)², (clip(V)−R)²)·mask, one AdamW update
    adv, ret = gae(cfg, rewards, lens, values, kl)      # per sample; advantages whitened over all processes

Index i of a packed row holds V of the state after tokens[..i], the state in which `targets[i]` is chosen:
the response token t's value sits where its log-prob does (`batch.pack`'s response slice), so values
are read back per sample with `batch.unpack` and returns/old values packed with `token_fields`. The
value loss uses the policy's token weights (`algo.agg`, denominator folded), so its sum is
`algos.value_loss` with that aggregation (tests/test_critic.py).

Simplifications, said plainly: the trunk is a full copy of the policy's weights (an untied lm_head is
carried and never trained; a separate preset for the critic is not offered); the value head reads the
final-normed hidden state in float32; the advantages' whitening sums travel between processes as float32
(`distributed.global_sum`), one process sums in float64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl import algos
from jaxrl.rollout.executor import ExecutableCache, abstract, out_abstract
from models import forward, lora

from . import rl
from .distributed import global_sum
from .optim import init_state, make_optimizer
from .step import make_apply_update
from .components import Parts, register
from .update import ZERO_SUMS, sums_shardings, warm_sums

VALUE_FIELDS = ("tokens", "positions", "segment_ids")
TRAIN_FIELDS = VALUE_FIELDS + ("loss_mask", "weights", "returns", "old_values")
CACHE = ExecutableCache(maxsize=16)


def token_values(params, mb, *, cfg, attention_impl: str = "xla", remat: str = "none") -> jax.Array:
    """V [rows, L] float32 of a packed micro-batch: w·h + b on the trunk's final-normed hidden states."""
    h = forward(params["trunk"], cfg, mb["tokens"], positions=mb["positions"], segment_ids=mb["segment_ids"],
                return_hidden=True, attention_impl=attention_impl, remat=remat)
    return jnp.einsum("rle,e->rl", h.astype(jnp.float32), params["head"]["w"]) + params["head"]["b"]


def value_loss_sum(params, mb, *, cfg, clip, attention_impl: str = "xla", remat: str = "none"):
    """(½ Σ w·ℓ·mask, stats sums) of one micro-batch, ℓ = `algos.value_token_loss` against the packed
    `returns` with clipping around the packed `old_values` (the values at rollout time)."""
    v = token_values(params, mb, cfg=cfg, attention_impl=attention_impl, remat=remat)
    mask = mb["loss_mask"].astype(jnp.float32)
    tok, clipped = algos.value_token_loss(v, mb["old_values"], mb["returns"], clip=clip)
    loss = 0.5 * jnp.sum(mb["weights"] * tok * mask)
    sv, ret = jax.lax.stop_gradient(v), mb["returns"]
    resid = ret - sv
    sums = {"loss": loss, "tokens": jnp.sum(mask), "clipped": jnp.sum(clipped * mask), "value": jnp.sum(sv * mask),
            "returns": jnp.sum(ret * mask), "returns_sq": jnp.sum(ret * ret * mask), "resid": jnp.sum(resid * mask),
            "resid_sq": jnp.sum(resid * resid * mask)}
    return loss, sums


STATS = ("loss", "tokens", "clipped", "value", "returns", "returns_sq", "resid", "resid_sq")   # value_loss_sum's


def _grads(params, mb, acc=None, **kw):
    (_, sums), g = jax.value_and_grad(functools.partial(value_loss_sum, **kw), has_aux=True)(params, mb)
    return (g, sums) if acc is None else jax.tree.map(jnp.add, acc, (g, sums))


def step_metrics(update: dict, sums: dict) -> dict:
    """The critic's per-step metrics (host floats) from one update's metrics and its stats sums."""
    n = max(float(sums["tokens"]), 1.0)
    var_ret = float(sums["returns_sq"]) / n - (float(sums["returns"]) / n) ** 2
    var_res = float(sums["resid_sq"]) / n - (float(sums["resid"]) / n) ** 2
    return {"critic/vf_loss": float(sums["loss"]), "critic/vf_clip_frac": float(sums["clipped"]) / n,
            "critic/value_mean": float(sums["value"]) / n, "critic/returns_mean": float(sums["returns"]) / n,
            # 1 − Var(R − V) / Var(R): 1 = the values predict the returns, 0 = no better than their mean
            "critic/explained_var": 1.0 - var_res / var_ret if var_ret > 1e-12 else 0.0,
            "critic/grad_norm": float(update["grad_norm"]), "critic/skipped": int(update["skipped"])}


class Critic:
    """The value model's params, optimizer state and executables (fixed micro-batch shape, compiled ahead
    of time through an `ExecutableCache` like the policy's `Updater`)."""

    def __init__(self, model_cfg, section, trainer, mesh, param_shardings, total_updates: int, *,
                 cache: ExecutableCache = CACHE):
        self.model_cfg, self.mesh, self.cache = model_cfg, mesh, cache
        self.tx, self.lr = make_optimizer(section.optim, total_updates)
        rep = NamedSharding(mesh, P())
        self.shardings = {"trunk": lora.base(param_shardings), "head": {"w": rep, "b": rep}}
        fwd = dict(cfg=model_cfg, attention_impl=trainer.attention_impl)
        self._values = jax.jit(functools.partial(token_values, **fwd))
        self._grad = jax.jit(functools.partial(_grads, clip=section.value_clip, remat=trainer.remat, **fwd),
                             donate_argnums=(2,))
        self._apply = make_apply_update(self.tx)
        self.params = self.opt_state = None

    def init(self, policy_params) -> None:
        """Trunk = a copy of the policy's weights (the train step donates the live ones), head = zeros. A LoRA
        policy's trunk is its merged weights: the critic trains every weight (simplification: no adapters)."""
        rep = self.shardings["head"]["w"]
        embed = policy_params.final_norm.shape[-1]
        head = {"w": jax.device_put(jnp.zeros((embed,), jnp.float32), rep),
                "b": jax.device_put(jnp.zeros((), jnp.float32), rep)}
        self.params = {"trunk": jax.tree.map(jnp.copy, lora.merge(policy_params)), "head": head}
        self.opt_state = init_state(self.tx, self.params, self.shardings, self.mesh)

    def state(self) -> dict:
        return {"params": self.params, "opt_state": self.opt_state}

    def load(self, state: dict) -> None:
        self.params, self.opt_state = state["params"], state["opt_state"]

    def values(self, mb) -> jax.Array:
        return self.cache("critic_values", self._values, self.params, {k: mb[k] for k in VALUE_FIELDS})

    def update(self, mbs: list[dict]) -> dict:
        """One AdamW update from the summed value-loss gradients of `mbs` (packed with `returns` and
        `old_values`); returns the step's critic metrics (host values)."""
        acc = self.cache("critic_zeros", ZERO_SUMS, self.params, **sums_shardings(self.params), stats=STATS)
        for mb in mbs:       # (every micro-batch adds to the sums: one gradient program, as `Updater`'s)
            acc = self.cache("critic_grad", self._grad, self.params, {k: mb[k] for k in TRAIN_FIELDS}, acc)
        grads, sums = acc
        self.params, self.opt_state, m = self.cache("critic_apply", self._apply, self.params, self.opt_state, grads, 1.0)
        return step_metrics(*jax.device_get((m, sums)))

    # -------------------------------------------- as a run component (`jaxrl.train.components`)
    def start(self, policy) -> None:
        """RL starts: the trunk from the policy's weights (after the warm start), unless a checkpoint gave them."""
        if self.params is None:
            self.init(policy.params)

    def saved(self) -> dict | None:
        """What a checkpoint holds of it (None before RL starts)."""
        return None if self.params is None else self.state()

    def restore_target(self, policy) -> dict:
        """The shapes and shardings a checkpoint restores into (from the policy's weights)."""
        self.init(policy.params)
        return self.state()

    def restored(self, state: dict | None) -> None:
        """The checkpoint's state, or None when none was usable (the critic starts afresh with RL)."""
        if state is None:
            self.params = self.opt_state = None
        else:
            self.load(state)

    def warm(self, mb: dict, policy=None) -> int:
        """Compile the value pass, the zero sums, the gradient step and the update for
        micro-batches shaped like `mb` (ShapeDtypeStructs with shardings; returns/old_values are added),
        following the update's output shardings until they repeat (as `Updater.warm`). Nothing runs."""
        before = self.cache.compiles
        like = mb["weights"]
        mb = {**{k: mb[k] for k in TRAIN_FIELDS if k in mb}, "returns": like, "old_values": like}
        p, o = abstract(self.params), abstract(self.opt_state)
        for _ in range(3):
            self.cache.compile("critic_values", self._values, p, {k: mb[k] for k in VALUE_FIELDS})
            acc = out_abstract(self.cache.compile("critic_zeros", ZERO_SUMS, p, **sums_shardings(p), stats=STATS))
            acc = warm_sums(self.cache, "critic_grad", self._grad, p, mb, acc)
            new_p, new_o, _ = out_abstract(self.cache.compile("critic_apply", self._apply, p, o, acc[0], 1.0))
            if self.cache.key("x", (new_p, new_o)) == self.cache.key("x", (p, o)):
                break
            p, o = new_p, new_o
        return self.cache.compiles - before


def gae(cfg, rewards: np.ndarray, lens: list[int], values: list[np.ndarray], kl: list[np.ndarray] | None = None
        ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """GAE advantages and returns per sample (`algos.gae_advantages`, λ = algo.lam, γ = algo.gamma) from
    the outcome rewards on each response's last token, minus kl_coef·KL per token with `kl`
    (algo.kl_in_reward: `algos.outcome_token_rewards`). The advantages are whitened over every valid token
    of all processes (the sums cross processes, the tokens do not), so N processes train what one does."""
    a = cfg.algo
    T = rl.token_width(cfg, lens)
    mask = (np.arange(T)[None, :] < np.asarray(lens)[:, None]).astype(np.float32)
    tok = algos.outcome_token_rewards(np.asarray(rewards, np.float32), mask,
                                      kl=None if kl is None else rl.padded(kl, T), kl_coef=a.kl_coef)
    adv, ret = rl.jitted(algos.gae_advantages, gamma=a.gamma, lam=a.lam, whiten=False)(tok, rl.padded(values, T), mask)
    adv, ret = np.asarray(adv, np.float64), np.asarray(ret)
    s, ss, n = global_sum([float((adv * mask).sum()), float((adv * adv * mask).sum()), float(mask.sum())])
    mean = s / max(n, 1.0)
    var = max(ss / max(n, 1.0) - mean * mean, 0.0)
    adv = ((adv - mean) / np.sqrt(var + 1e-8)).astype(np.float32)
    return [adv[i, :k] for i, k in enumerate(lens)], [ret[i, :k] for i, k in enumerate(lens)]


@register("critic", section="critic", active=lambda cfg: cfg.algo.advantage == "gae")
def build(section, parts: Parts) -> Critic:
    """PPO's value model (algo.advantage=gae) on the train mesh, in the policy's shardings; its weights are made
    when RL starts (`start`)."""
    uc = parts.update
    cfg = uc.cfg
    return Critic(parts.model_cfg, section, cfg.trainer, uc.mesh, uc.shardings, cfg.steps * cfg.algo.mini_batches)
