"""What each component of a run decides and needs, and the refusals computed from it: the one source of the
config's cross-mechanism refusals and, through the pair matrix `jaxrl.config.composition` measures by loading
configs, of docs/composition.md's table.

    check_declarations(cfg)     # raises ConfigError(key, message) for the first conflict, in COMPONENTS order

A component is on when its `active(cfg)` says so. It **decides** things (`Decides(thing, value)`: e.g. that a
rollout may be trained at later weights, or that a sample is a trajectory) and **needs** things (`Needs(thing,
allowed, message)`). Two components conflict when one needs a thing to be one of `allowed` and another, also on,
decides it otherwise; the refusal names the needing component's key, with its `message` formatted with
`{value}` (that key's value) and `{other}` (the deciding key and its value, `key=value`).

The vocabulary of things:

| thing | decided by | values |
|---|---|---|
| `rollout_policy` | one-step / k-step async (`trainer.max_staleness`) | "current" (the default), "older" |
| `objective` | `algo.objective` other than ppo | "ppo" (the default), "decoupled", "gspo" |
| `advantages` | PPO's critic (`algo.advantage=gae`) | "group" (the default), "critic" (values over the whole batch) |
| `kv_source` | MetroRLHF's rollout K/V (`trainer.kv_source=rollout`) | "recompute" (the default), "rollout" |
| `sample` | multi-turn (`rollout.env`) | "response" (the default), "trajectory" |
| `token_scores` | on-policy distillation (`algo.advantage=opd`) | "none" (the default), "teacher" (a teacher pass over the batch after the rollout) |

Single-section rules (a value out of range, a key that needs another set) stay in each section's checks; only
refusals between mechanisms live here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .base import ConfigError


@dataclasses.dataclass(frozen=True)
class Decides:
    thing: str
    value: Callable[[object], str] | str


@dataclasses.dataclass(frozen=True)
class Needs:
    thing: str
    allowed: frozenset[str]
    message: str


@dataclasses.dataclass(frozen=True)
class Component:
    """A mechanism's declaration: `key` (the dotted config key that turns it on, named in its refusals),
    `active(cfg)`, what it `decides` and what it `needs`."""

    name: str
    key: str
    active: Callable[[object], bool]
    decides: tuple[Decides, ...] = ()
    needs: tuple[Needs, ...] = ()


def value_at(cfg, key: str):
    """The config's value at a dotted key."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def shown(value) -> str:
    """A config value as a refusal shows it (YAML's spelling: true, false, null)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


CURRENT = frozenset({"current"})
PPO = frozenset({"ppo"})
GROUP = frozenset({"group"})
RECOMPUTE = frozenset({"recompute"})

COMPONENTS: tuple[Component, ...] = (
    Component("stream_trainer", "trainer.stream.enabled", lambda c: c.trainer.stream.enabled, needs=(
        Needs("rollout_policy", CURRENT, "{value} with {other}: the stream trainer takes gradients at the weights "
              "of the rollout it frees devices from, and an asynchronous rollout is trained at the weights of later "
              "updates"),
        Needs("objective", PPO, "{value} with {other}: the stream trainer takes each group's gradient as it "
              "arrives, with no proximal log-prob pass (not built yet)"),
        Needs("advantages", GROUP, "{other} (PPO with a critic): the stream trainer computes gradients during the "
              "rollout, before any values exist"),
        Needs("token_scores", frozenset({"none"}), "{value} with {other}: the stream trainer computes each group's "
              "gradient during the rollout, and on-policy distillation's advantages wait for the teacher's pass over "
              "the batch after it (a per-group teacher pass is not built yet)"),
    )),
    Component("async", "trainer.max_staleness", lambda c: isinstance(c.trainer.max_staleness, int) and c.trainer.max_staleness > 0,
              decides=(Decides("rollout_policy", "older"),)),
    Component("objective", "algo.objective", lambda c: c.algo.objective != "ppo",
              decides=(Decides("objective", lambda c: c.algo.objective),),
              needs=(Needs("advantages", GROUP, "{value} with {other}: PPO with a critic trains with objective=ppo"),)),
    Component("ppo", "algo.advantage", lambda c: c.algo.advantage == "gae",
              decides=(Decides("advantages", "critic"),)),
    Component("opd", "algo.advantage", lambda c: c.algo.advantage == "opd",
              decides=(Decides("token_scores", "teacher"),)),
    Component("opd_trainer_logp", "algo.opd.student_logp",
              lambda c: c.algo.advantage == "opd" and c.algo.opd.student_logp == "trainer",
              needs=(Needs("rollout_policy", CURRENT, "{value} with {other}: the trainer's forward gives the log-probs "
                           "of the weights it holds, and an asynchronous rollout was sampled by older ones; use "
                           "algo.opd.student_logp=rollout (the engine's, the behaviour policy's)"),)),
    Component("rollout_kv", "trainer.kv_source", lambda c: c.trainer.kv_source == "rollout",
              decides=(Decides("kv_source", "rollout"),),
              needs=(Needs("rollout_policy", CURRENT, "{value} with {other}: a rollout trained steps late was made by "
                           "the weights before the updates, so its K/V are another policy's and the blockwise "
                           "gradient would not be exact; use kv_source=recompute"),)),
    Component("carry_partial", "rollout.tail_batching.carry_partial", lambda c: c.rollout.tail_batching.carry_partial,
              needs=(Needs("sample", frozenset({"response"}), "with {other}: an environment's state is not carried "
                           "across rounds"),
                     Needs("kv_source", RECOMPUTE, "with {other}: a carried response that had finished has no K/V "
                           "left in the engine; use trainer.kv_source=recompute"))),
    Component("multi_turn", "rollout.env", lambda c: getattr(c.rollout, "env", None) is not None,
              decides=(Decides("sample", "trajectory"),),
              needs=(Needs("advantages", GROUP, "PPO's critic and GAE treat every response token as an action, and a "
                           "trajectory's observation tokens are not: multi-turn trains with grpo, dr_grpo, rloo or "
                           "reinforce_pp"),
                     Needs("kv_source", RECOMPUTE, "a trajectory paused for its environment may lose its KV pages "
                           "under memory pressure (recomputed when it resumes), and one that then ends has no K/V to "
                           "export: use trainer.kv_source=recompute with multi-turn"))),
)


def decided(component: Component, cfg) -> dict[str, str]:
    return {d.thing: d.value(cfg) if callable(d.value) else d.value for d in component.decides}


def conflicts(cfg, components=None) -> list[tuple[str, str]]:
    """Every (key, message) refusal of `cfg` under `components` (COMPONENTS), in declaration order."""
    on = [c for c in (COMPONENTS if components is None else components) if c.active(cfg)]
    out = []
    for a in on:
        for need in a.needs:
            for b in on:
                got = decided(b, cfg).get(need.thing)
                if b is not a and got is not None and got not in need.allowed:
                    out.append((a.key, need.message.format(value=shown(value_at(cfg, a.key)),
                                                           other=f"{b.key}={shown(value_at(cfg, b.key))}")))
    return out


def check_declarations(cfg) -> None:
    """Refuse the first conflict between the components `cfg` turns on (one line, naming the key)."""
    found = conflicts(cfg)
    if found:
        raise ConfigError(*found[0])
