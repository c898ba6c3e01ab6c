"""RL math: advantage estimators, policy/KL/entropy/value losses and aggregation modes.

Pure, jittable jnp functions over per-token [B, T] arrays with a response mask; the estimators,
KL estimators and aggregation modes sit in registries looked up by name, so a recipe names them
in its config and the trainer (orchestration, `jaxrl/train`) stays free of the math.

    from jaxrl import algos
    adv = algos.compute_advantages("grpo", rewards=r.reshape(P, G), mask=mask)
    pg, metrics = algos.policy_loss(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.28)
    loss = pg + beta * algos.kl_loss(logp, ref_logp, mask, kind="k3")
    loss, m = algos.decoupled_policy_loss(logp, prox_logp, behav_logp, adv, mask, is_cap=2.0)   # off-policy
    w, which = algos.token_weights("token-mean", lengths, max_new_tokens)   # Σ w·ℓ / D == aggregate(ℓ)

String arguments (`agg`, `kind`, estimator names) and `None`-able switches (`clip_high`,
`dual_clip`, `kl`, `clip`) choose code paths: keep them static under `jax.jit`.
"""

from .advantages import (ADVANTAGE_ESTIMATORS, compute_advantages, dr_grpo_advantages, gae_advantages,
                         grpo_advantages, outcome_token_rewards, register_advantage, reinforce_pp_advantages,
                         rloo_advantages)
from .distill import opd_advantages, opd_token_terms
from .aggregation import (AGGREGATIONS, Aggregation, aggregate, folded_token_weights, register_aggregation,
                          token_weights)
from .kl import KL_ESTIMATORS, kl_penalty, register_kl_estimator
from .losses import entropy_bonus, kl_loss, policy_loss, ppo_clip_token_loss, value_loss, value_token_loss
from .masked import broadcast_sequence, last_token_mask, masked_mean, masked_sum, masked_var, masked_whiten
from .offpolicy import (IS_MODES, decoupled_policy_loss, gspo_policy_loss, gspo_token_ratio, importance_weights,
                        packed_sequence_ratio, sequence_log_ratio, staleness_mask)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "Aggregation", "IS_MODES", "KL_ESTIMATORS",
    "aggregate", "decoupled_policy_loss", "gspo_policy_loss", "gspo_token_ratio", "importance_weights",
    "packed_sequence_ratio", "sequence_log_ratio", "staleness_mask", "broadcast_sequence", "compute_advantages", "dr_grpo_advantages", "entropy_bonus",
    "folded_token_weights", "gae_advantages", "grpo_advantages", "kl_loss", "kl_penalty", "last_token_mask",
    "masked_mean", "masked_sum", "masked_var", "masked_whiten", "outcome_token_rewards", "policy_loss",
    "opd_advantages", "opd_token_terms", "ppo_clip_token_loss", "register_advantage", "register_aggregation", "register_kl_estimator",
    "reinforce_pp_advantages", "rloo_advantages", "token_weights", "value_loss", "value_token_loss",
]
