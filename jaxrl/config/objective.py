"""`algo.objective`, `algo.is_correction` and `algo.is_cap`: the policy objective and its off-policy correction
(`jaxrl.algos.offpolicy`, applied per micro-batch by `jaxrl.train.corrections`).

* "ppo" (default): the clipped ratio π_θ/π_old, π_old the rollout's own log-probs when generation runs ahead
  (trainer.max_staleness ≥ 1: the behaviour policy), else the step's weights.
* "decoupled": AReaL's decoupled PPO, the clip on π_θ/π_prox (π_prox: the weights at the step's start,
  recomputed) and the importance weight π_prox/π_behav (each token's own sampling log-prob) corrected by
  `is_correction` ("truncate": min(w, is_cap), TIS; "mask": 0 above is_cap, MIS; "none"). With
  max_staleness=0 it is the sampler/trainer-mismatch correction alone (the engine's log-probs vs the trainer's).
* "gspo": GSPO's sequence-level ratio (clip with algo.clip_low/clip_high: the paper's 3e-4/4e-4), aggregated
  "seq-mean-token-mean" (the paper's 1/G Σ_i).
"""

from __future__ import annotations

from jaxrl.algos import IS_MODES

from .base import ConfigError, check_choice, check_float

OBJECTIVES = ("ppo", "decoupled", "gspo")


def check_objective_fields(algo) -> None:
    check_choice("objective", algo.objective, OBJECTIVES)
    check_choice("is_correction", algo.is_correction, IS_MODES)
    check_float("is_cap", algo.is_cap, above=0.0)
    if algo.objective == "gspo" and algo.agg != "seq-mean-token-mean":
        raise ConfigError("agg", f"{algo.agg} with objective=gspo: GSPO averages its sequence-level terms over "
                          "sequences; set algo.agg=seq-mean-token-mean")
    if algo.objective == "gspo" and algo.dual_clip is not None:
        raise ConfigError("dual_clip", "objective=gspo clips the sequence ratio only (no dual clip)")


def check_objective(cfg) -> None:
    """Refuse, naming the key, what an off-policy objective cannot run with."""
    a, t = cfg.algo, cfg.trainer
    if a.objective == "ppo":
        return
    why = f"algo.objective={a.objective}"
    if t.micro_batch_tokens is None:
        raise ConfigError("trainer.micro_batch_tokens", f"null with {why}: the proximal log-probs and the "
                          "corrections are computed per fixed micro-batch; set a token budget")


def check_carry(cfg) -> None:
    """Refuse, naming the key, what carried partial responses (rollout.tail_batching.carry_partial) cannot run
    with, and a staleness rule that would carry nothing."""
    t, a = cfg.trainer, cfg.algo
    if t.stale_samples == "correct" and a.objective != "decoupled":
        raise ConfigError("trainer.stale_samples", f"correct with algo.objective={a.objective}: the correction is "
                          "decoupled PPO's importance weight; set algo.objective=decoupled")
    if not cfg.rollout.tail_batching.carry_partial:
        return
    why = "rollout.tail_batching.carry_partial"
    if t.stale_samples == "drop" and t.max_staleness == 0:
        raise ConfigError("trainer.stale_samples", f"drop with {why} and trainer.max_staleness=0: every carried "
                          "token is at least one version old, so all would be dropped; set "
                          "trainer.stale_samples=correct (with algo.objective=decoupled) or max_staleness >= 1")
