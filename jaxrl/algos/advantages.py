"""Advantage estimators: pure jnp functions in a registry, looked up by name.

    adv = compute_advantages("grpo", rewards=r.reshape(P, G), mask=mask)          # [P*G, T]
    adv, ret = compute_advantages("gae", token_rewards=tr, values=v, mask=mask, gamma=1.0, lam=0.95)

Inputs, by family (all float32 out; shapes checked, mismatches raise ValueError with the shapes):

* outcome, group-relative (`grpo`, `dr_grpo`, `rloo`): `rewards [P, G]` — P prompts × G samples,
  rows of the token batch ordered prompt-major (row b = p·G + g) — and `mask [P·G, T]`. They return
  token advantages [B, T]: the sequence advantage on every valid token, 0 on padding.
* `reinforce_pp`: `rewards [B]`, `mask [B, T]`, optional per-token `kl [B, T]` → advantages [B, T].
* `gae`: `token_rewards [B, T]`, `values [B, T]`, `mask [B, T]` → (advantages [B, T], returns [B, T]).
  Build token rewards with `outcome_token_rewards` (outcome at the last valid token, minus a KL
  penalty per token).

Simplifications, said plainly: groups are rectangular (every prompt has exactly G samples; a ragged
group must be padded by the caller and its padding rows given an all-zero mask, and they then still
count in their group's mean/std); there is no per-sample "invalid trajectory" mask for the group
statistics. A truncated response is treated as terminal (no bootstrap from V at the cut), as in
the LLM RLHF codebases.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from .registry import lookup, registrar
from .masked import (as_mask, broadcast_sequence, check_shapes, last_token_mask, masked_whiten,
                     reverse_discounted_sum)

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}


register_advantage = registrar(ADVANTAGE_ESTIMATORS, "advantage estimator")


def compute_advantages(name: str, **kwargs):
    """Run the estimator registered as `name` with keyword arguments (see each estimator)."""
    return lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")(**kwargs)


def _group_inputs(rewards, mask, what: str) -> tuple[jax.Array, jax.Array]:
    rewards = jnp.asarray(rewards, jnp.float32)
    mask = as_mask(mask, what=what)
    if rewards.ndim != 2:
        raise ValueError(f"{what}: rewards must be [P, G] (prompts x samples per prompt), got shape {list(rewards.shape)}")
    P, G = rewards.shape
    if mask.shape[0] != P * G:
        raise ValueError(f"{what}: rewards [P, G]={[P, G]} need mask [P*G, T] with {P * G} rows, got mask {list(mask.shape)}")
    return rewards, mask


def outcome_token_rewards(rewards, mask, *, kl=None, kl_coef=0.0) -> jax.Array:
    """Per-token rewards r_t = 1[t = last valid token]·R − β·KL_t, [B, T] (0 on padding).

    The outcome reward sits on the final response token and the KL penalty on every token — the
    per-token reward of InstructGPT (Ouyang et al. 2022, eq. 2) and REINFORCE++ (Hu et al. 2025):
    r(s_t, a_t) = I(s_t = [EOS])·r(x, y) − β·KL(t). `kl` is any per-token estimator from
    `kl_penalty` (k1 in both papers).

    rewards [B]; mask [B, T]; kl [B, T] or None; kl_coef β (float).
    """
    mask = as_mask(mask, what="outcome_token_rewards")
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"outcome_token_rewards: rewards [B]={list(rewards.shape)} do not match mask [B, T]={list(mask.shape)}")
    out = last_token_mask(mask) * rewards[:, None]
    if kl is not None:
        check_shapes("outcome_token_rewards", kl=kl, mask=mask)
        out = out - kl_coef * jnp.asarray(kl, jnp.float32)
    return jnp.where(mask > 0, out, 0.0)


@register_advantage("grpo")
def grpo_advantages(rewards, mask, *, std_normalize: bool = True, eps: float = 1e-6, ddof: int = 1) -> jax.Array:
    """GRPO outcome supervision (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, §4.1.2):
    Â_i,t = (r_i − mean(r)) / std(r).

    Mean and std are over each prompt's G samples. `std_normalize=False` drops the division
    (then this equals `dr_grpo`). The std is the sample std (ddof=1), as TRL, verl and tunix use;
    a group whose rewards are all equal gets advantage 0 (0 / (0 + eps)).

    rewards [P, G]; mask [P·G, T] -> token advantages [P·G, T].
    """
    rewards, mask = _group_inputs(rewards, mask, "grpo")
    G = rewards.shape[1]
    centred = rewards - jnp.mean(rewards, axis=1, keepdims=True)
    if std_normalize:
        std = jnp.sqrt(jnp.sum(jnp.square(centred), axis=1, keepdims=True) / max(G - ddof, 1))
        centred = centred / (std + eps)
    return broadcast_sequence(centred.reshape(-1), mask)


@register_advantage("dr_grpo")
def dr_grpo_advantages(rewards, mask) -> jax.Array:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783, §3.1):
    Â_i,t = r_i − mean(r).

    No division by the group std (removes the question-difficulty bias). The matching loss removes
    the 1/|o_i| length normalisation too: aggregate with "seq-mean-token-sum-norm" and a constant
    `norm_len` (the generation budget).

    rewards [P, G]; mask [P·G, T] -> token advantages [P·G, T].
    """
    rewards, mask = _group_inputs(rewards, mask, "dr_grpo")
    return broadcast_sequence((rewards - jnp.mean(rewards, axis=1, keepdims=True)).reshape(-1), mask)


@register_advantage("rloo")
def rloo_advantages(rewards, mask) -> jax.Array:
    """RLOO (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740; Kool et al. 2019):
    A_i = r_i − 1/(G−1) · Σ_{j≠i} r_j, the leave-one-out baseline. Needs G >= 2.

    rewards [P, G]; mask [P·G, T] -> token advantages [P·G, T].
    """
    rewards, mask = _group_inputs(rewards, mask, "rloo")
    G = rewards.shape[1]
    if G < 2:
        raise ValueError(f"rloo: needs at least 2 samples per prompt, got rewards shape {list(rewards.shape)}")
    others = (jnp.sum(rewards, axis=1, keepdims=True) - rewards) / (G - 1)
    return broadcast_sequence((rewards - others).reshape(-1), mask)


@register_advantage("reinforce_pp")
def reinforce_pp_advantages(rewards, mask, *, kl=None, kl_coef: float = 0.0, gamma: float = 1.0,
                            group_size: int | None = None, eps: float = 1e-8) -> jax.Array:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262).

    Token reward r_t = 1[t = last]·R − β·KL_t (`outcome_token_rewards`); return
    G_t = Σ_{k>=t} γ^{k−t} r_k over valid tokens; then global normalisation over every valid token
    of the batch, A = (G − mean) / std (no per-prompt grouping, no critic).

    `group_size=G` gives "REINFORCE++ w/ baseline" (same paper): the outcome rewards are first
    centred by their group mean (rows ordered prompt-major, B = P·G) before the steps above.
    With γ = 1 the return is the paper's A_t = R − β·Σ_{i>=t} KL(i).

    rewards [B]; mask [B, T]; kl [B, T] or None -> token advantages [B, T].
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    if group_size is not None:
        if rewards.ndim != 1 or rewards.shape[0] % group_size:
            raise ValueError(f"reinforce_pp: rewards [B]={list(rewards.shape)} do not split into groups of {group_size}")
        grouped = rewards.reshape(-1, group_size)
        rewards = (grouped - jnp.mean(grouped, axis=1, keepdims=True)).reshape(-1)
    token_rewards = outcome_token_rewards(rewards, mask, kl=kl, kl_coef=kl_coef)
    mask = as_mask(mask)
    returns = reverse_discounted_sum(token_rewards, mask, gamma)
    return masked_whiten(returns, mask, eps=eps)


@register_advantage("gae")
def gae_advantages(token_rewards, values, mask, *, gamma: float = 1.0, lam: float = 0.95,
                   whiten: bool = True) -> tuple[jax.Array, jax.Array]:
    """GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", eq. 16):
    δ_t = r_t + γ·V_{t+1} − V_t,  Â_t = Σ_l (γλ)^l δ_{t+l} = δ_t + γλ·Â_{t+1};  returns R_t = Â_t + V_t.

    `values[b, t]` is V(s_t), the critic's value of the state *before* token t; V after the last
    valid token is 0 (terminal). Padding is skipped: t+1 means the next valid token. Returns are
    formed from the raw advantages; `whiten=True` then normalises advantages over all valid tokens
    of the batch (as the PPO-for-LLM implementations do).

    token_rewards, values, mask [B, T] -> (advantages [B, T], returns [B, T]), 0 on padding.
    """
    mask = as_mask(mask, what="gae")
    check_shapes("gae", token_rewards=token_rewards, values=values, mask=mask)
    r = jnp.asarray(token_rewards, jnp.float32)
    v = jnp.asarray(values, jnp.float32)

    def step(carry, xs):
        next_v, next_a = carry
        rt, vt, mt = xs
        a = rt + gamma * next_v - vt + gamma * lam * next_a
        valid = mt > 0
        return (jnp.where(valid, vt, next_v), jnp.where(valid, a, next_a)), jnp.where(valid, a, 0.0)

    zeros = jnp.zeros(mask.shape[:1], jnp.float32)
    _, adv = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, mask.T), reverse=True)
    adv = adv.T
    returns = jnp.where(mask > 0, adv + v, 0.0)
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv, returns
