"""Which mechanisms compose: every mechanism's settings declared once, and the pair matrix computed by the
trainer's own config checks (`TrainConfig`'s cross-section checks), never by a hand-kept list.

    MECHANISMS["tail"].overrides        # the dotted overrides that turn it on, on top of BASE
    pair_matrix()                       # {(a, b): None (accepted) or (key, reason) (refused)}
    recipe_config()                     # configs/all_mechanisms.yaml: RECIPE's mechanisms together

Each entry here says, for the table, what the mechanism decides and needs in words. The refusals between
mechanisms come from `jaxrl.config.declarations` (what each component decides and needs, as values), which
`TrainConfig` checks: the matrix is measured by loading every pair through that check, so the table and the
config's refusals have one source (tests/test_declarations.py breaks a declaration and sees both change).
`scripts/composition.py` writes the matrix to `scripts/results/composition.json`, `scripts/docs.py` renders
docs/composition.md from that JSON, and tests/test_composition.py recomputes it from the code and fails when
the JSON (hence the page) differs, or when a refusal names no reason.

Simplified (said, not pretended done): a pair here is accepted by the config; the issue's matrix also runs
every accepted pair for 2 RL steps on a 4-device train layout, which this module does not do (see
tests/test_composition.py for the pairs that are run).
"""

from __future__ import annotations

import dataclasses
import itertools

from .base import ConfigError
from .loading import CONFIGS_DIR, load_config, to_yaml
from .train import TrainConfig

# Every pair is loaded on top of the quickstart with a 4-device train layout and 4 rollout instances.
BASE = ("engine.instances=4", "train_layout.fsdp=4")


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """One setting of the pair matrix: its overrides, what it decides and needs (for the table), its paper."""
    overrides: tuple[str, ...]
    decides: str
    needs: str
    paper: str


MECHANISMS: dict[str, Mechanism] = {
    "pat": Mechanism(("engine.adaptive_tp.enabled=true", "engine.adaptive_tp.profile=pat_profile.json"),
                     "the generation layout mid-rollout (TP switches)", "a latency profile", "PAT"),
    "tail_batching": Mechanism(("rollout.tail_batching.enabled=true",),
                               "which prompts and responses a step trains (speculative rounds, long-prompt queue)",
                               "its own round state, on the rollout side (one step ahead when async)", "RollPacker"),
    "dynamic_sampling": Mechanism(("rollout.tail_batching.enabled=true",
                                   "rollout.tail_batching.dynamic_sampling=true"),
                                  "refill waves until the batch has signal", "tail batching's rounds",
                                  "RollPacker / DAPO"),
    "planner": Mechanism(("engine.planner.enabled=true", "engine.kv_bytes_per_device=3900000"), "the generation TP per round type (from preemptions)",
                         "a layout change between rollouts (at a rollout's end)", "RollPacker"),
    "stream_trainer": Mechanism(("trainer.stream.enabled=true",),
                                "where gradients run (freed rollout devices, mid-rollout)",
                                "per-group advantages, one update per batch", "RollPacker"),
    "disaggregated": Mechanism(("placement=disaggregated",), "where training runs (its own device pool)",
                               "fixed-shape micro-batches", "StreamRL"),
    "async": Mechanism(("placement=disaggregated", "trainer.max_staleness=1"),
                       "when the update runs (beside the next rollout)", "a separate train pool", "StreamRL"),
    "async_k2": Mechanism(("placement=disaggregated", "trainer.max_staleness=2", "algo.objective=decoupled"),
                          "how far generation runs ahead (up to 2 versions) and the objective that corrects for it",
                          "a separate train pool; the proximal policy's log-probs (decoupled PPO)", "AReaL / slime"),
    "weight_swap": Mechanism(("placement=disaggregated", "trainer.max_staleness=1", "trainer.swap_step=4"),
                             "when an update enters the rollout running ahead (mid-generation, its K/V kept)",
                             "a rollout running ahead (async)", "AReaL / slime"),
    "gspo": Mechanism(("algo.objective=gspo", "algo.agg=seq-mean-token-mean"),
                      "the policy ratio (one per sequence, length-normalised)",
                      "micro-batched updates; per-sequence advantages", "GSPO"),
    "carry_partial": Mechanism(("rollout.tail_batching.enabled=true", "rollout.tail_batching.carry_partial=true",
                                "rollout.tail_batching.eta_prompts=2", "rollout.tail_batching.eta_responses=1",
                                "trainer.stale_samples=correct", "algo.objective=decoupled"),
                               "what a deferred prompt keeps (its partial responses, resumed in the long round)",
                               "tail batching's queue; decoupled PPO for the tokens older than k", "slime"),
    "skew": Mechanism(("rollout.skew.enabled=true",), "which instance generates which prompt (long-tail class)",
                      "several instances", "StreamRL"),
    "scale_up": Mechanism(("placement=disaggregated", "stage_balance.scale_up=true", "stage_balance.max_instances=5"),
                          "the number of generation instances (grows between steps)", "spare devices",
                          "StreamRL"),
    "blockwise": Mechanism(("trainer.backward=blockwise",), "how gradients are computed (blocks, recomputed K/V)",
                           "fixed-shape micro-batches", "MetroRLHF"),
    "blockwise_rollout_kv": Mechanism(("trainer.backward=blockwise", "trainer.kv_source=rollout"),
                                      "how gradients are computed (blocks over the rollout's K/V)",
                                      "on-policy K/V of the whole batch", "MetroRLHF"),
    "repartition": Mechanism(("trainer.repartition=tokens",), "which process trains which sample",
                             "the whole batch before packing", "DistFlow"),
    "ppo": Mechanism(("algo.advantage=gae",), "advantages (a critic's values, GAE over the whole batch)",
                     "the whole batch before the update", "DistFlow (PPO)"),
    "two_processes": Mechanism(("distributed.num_processes=2",), "how many controllers run the graph",
                               "global agreement on counts", "DistFlow"),
    "multi_turn": Mechanism(("rollout.env=tools",),
                            "what a sample is (a trajectory: model turns and environment steps in one live sequence)",
                            "an environment per row; advantages per trajectory (the GRPO family)", "multi-turn tools"),
    "eval": Mechanism(("eval.split=16", "eval.every=1"),
                      "nothing of the training: it samples held-out prompts on the engine between rollouts (a split "
                      "takes its prompts out of the training rows)",
                      "an idle engine between rollouts; single-turn rows scored by rewards.*", "held-out evaluation"),
    "opd": Mechanism(("algo.advantage=opd", "algo.opd.reward_weight=0.5"),
                     "advantages (a teacher's per-token log-probs of the sampled tokens, plus a share of the task "
                     "reward's)", "the batch's sequences after the rollout; a teacher sharing the tokenizer (here the "
                     "reference policy)", "on-policy distillation (GKD)"),
    "lora": Mechanism(("model.lora.rank=8",), "which weights train (low-rank adapters; the base frozen, the reference)",
                      "a base model (initialised or an HF checkpoint)", "LoRA (Hu et al.)"),
}


def overrides(*names: str) -> list[str]:
    """BASE plus the named mechanisms' overrides (later values of a key win; the declared ones never clash)."""
    merged: dict[str, str] = {}
    for item in BASE + tuple(o for n in names for o in MECHANISMS[n].overrides):
        key, value = item.split("=", 1)
        merged[key] = value
    return [f"{k}={v}" for k, v in merged.items()]


def clash(*names: str) -> tuple[str, str] | None:
    """The first key two of the named mechanisms set to different values (two settings of one choice: e.g. two
    advantage estimators), as a refusal (key, message); None when they agree."""
    seen: dict[str, tuple[str, str]] = {}
    for name in names:
        for item in MECHANISMS[name].overrides:
            key, value = item.split("=", 1)
            if key in seen and seen[key][1] != value:
                return key, (f"{seen[key][0]} sets {key}={seen[key][1]} and {name} sets {value}: one value per key "
                             "(two settings of one choice)")
            seen.setdefault(key, (name, value))
    return None


def check(*names: str) -> tuple[str, str] | None:
    """None if the quickstart with these mechanisms on loads, else the refusal (key, message): two settings of
    one key (`clash`), or the config's own refusal."""
    if (both := clash(*names)) is not None:
        return both
    try:
        load_config(TrainConfig, overrides(*names), default_yaml=CONFIGS_DIR / "quickstart.yaml")
    except ConfigError as e:
        return e.key, e.message
    return None


def pair_matrix() -> dict[tuple[str, str], tuple[str, str] | None]:
    """Every unordered pair of MECHANISMS (in declaration order) -> `check` of the pair."""
    return {(a, b): check(a, b) for a, b in itertools.combinations(MECHANISMS, 2)}



# The whole system in one run (configs/all_mechanisms.yaml, written by scripts/composition.py): every mechanism
# that composes with the others in one colocated run of 2 processes. Each process runs 2 generation instances
# (TP 1; the planner may merge them into one TP 2 instance, at most) beside a train mesh of fsdp=4 over the
# 4 devices of both; the blockwise backward recomputes its K/V (the rollout's K/V are refused with token
# repartition over 2 processes: the samples would move to other processes, their K/V would not).
RECIPE = ("tail_batching", "dynamic_sampling", "skew", "planner", "blockwise", "repartition", "multi_turn",
          "two_processes")
RECIPE_OVERRIDES = ("engine.instances=2", "engine.planner.max_tp=2", "rollout.tail_batching.max_waves=3",
                    "trainer.block_size=64")
RECIPE_HEADER = """# Every mechanism that composes, in one run at quickstart size (issue 32): RollPacker's tail batching with
# DAPO dynamic sampling and the TP planner, StreamRL's skew-aware placement with its length ranker,
# MetroRLHF's blockwise backward, DistFlow's token repartition, multi-turn trajectories with the tools
# environment (a turn with a tool call continues the sequence), 2 processes (multi-controller):
#   scripts/launch_local.sh 2 python -m jaxrl.train --config configs/all_mechanisms.yaml
# Written by scripts/composition.py from jaxrl.config.composition (RECIPE: the quickstart plus those
# mechanisms' declared overrides); tests/test_composition.py fails when this file differs.
"""


# Its disaggregated, one-step-async variant (configs/all_mechanisms_async.yaml): one process (to keep CI's
# run small; async composes with 2 processes, tests/test_train_processes.py), 4 train devices beside 2 generation
# instances; the rollout side (tail batching's rounds, dynamic sampling's waves, skew placement, the
# planner's layout) runs one step ahead of the update.
RECIPE_ASYNC = ("tail_batching", "dynamic_sampling", "skew", "planner", "blockwise", "repartition", "multi_turn",
                "async")
RECIPE_ASYNC_HEADER = """# The all-mechanisms recipe on StreamRL's disaggregated pools, one-step-async (issue 32): tail batching with
# dynamic sampling, the TP planner, skew placement, the blockwise backward, token repartition and multi-turn
# trajectories with the tools environment, with the
# next rollout running while each step trains (one process, to keep CI's run small):
#   scripts/venv.sh python -m jaxrl.train --config configs/all_mechanisms_async.yaml
# Written by scripts/composition.py (RECIPE_ASYNC); tests/test_composition.py fails when this file differs.
"""
RECIPES = {"all_mechanisms": (RECIPE, RECIPE_HEADER), "all_mechanisms_async": (RECIPE_ASYNC, RECIPE_ASYNC_HEADER)}


def recipe_config(name: str = "all_mechanisms") -> TrainConfig:
    """The quickstart with every mechanism of recipe `name` on (`overrides`) and RECIPE_OVERRIDES."""
    mechanisms, _ = RECIPES[name]
    return load_config(TrainConfig, overrides(*mechanisms) + list(RECIPE_OVERRIDES) + [f"run_dir=runs/{name}"],
                       default_yaml=CONFIGS_DIR / "quickstart.yaml")


def recipe_yaml(name: str = "all_mechanisms") -> str:
    """configs/<name>.yaml's text."""
    return RECIPES[name][1] + to_yaml(recipe_config(name))
