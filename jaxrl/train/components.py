"""A run's optional components, each built from its config section by one registration (issue 70's "a
mechanism is one module, its config section and one registration"): the trainer builds whatever is on and
hands the nodes a typed context; it holds no branch per component.

    @register("teacher", section="teacher", active=lambda cfg: cfg.algo.advantage == "opd")
    def build(section: TeacherSection, parts: Parts) -> Teacher: ...

    comps = build_components(cfg, parts)        # {name: component} of the registered ones that are on
    TrainContext(..., components=comps)         # a node: ctx.train.component("teacher")

A component may also have, and the trainer calls on every component that has them:
    start(policy)          when RL starts (after the warm start; before the warm-up): e.g. the critic's trunk
                           from the policy, the teacher's frozen reference copy
    warm(mb, policy) -> n  compile what it runs for the update's abstract micro-batch `mb` (the warm-up), so
                           nothing compiles after step 0; returns how many executables it compiled
    saved() -> dict|None   its arrays in a checkpoint, under its name (`jaxrl.train.run_state`)
    restore_target(policy) -> dict, restored(state|None)    the shapes a checkpoint restores into; the result

The modules of the built-in components are listed in BUILTIN (imported when components are built, so their
`@register` runs); a user's component is registered the same way from any module imported before the run.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

from jaxrl.config.declarations import value_at
from jaxrl.config.train import TrainConfig

from .context import UpdateContext

BUILTIN = ("jaxrl.train.teacher", "jaxrl.train.critic")


@dataclasses.dataclass(frozen=True)
class Parts:
    """What a component may use when it is built (never the trainer): the student's model config and
    tokenizer source, the update side (train mesh, loss spec, micro-batch shape, policy), the devices the
    train mesh spans and the devices reserved for components (teacher.placement=pool's; else none), the run's
    seed and parameter dtype."""

    model_cfg: Any
    tokenizer_source: str
    update: UpdateContext
    train_devices: list
    reserved_devices: list
    seed: int
    dtype: Any


@dataclasses.dataclass(frozen=True)
class Registration:
    name: str
    section: str                         # the dotted config key of the section `build` takes
    active: Callable[[TrainConfig], bool]
    build: Callable[[Any, Parts], Any]


REGISTRY: dict[str, Registration] = {}


def register(name: str, *, section: str, active: Callable[[TrainConfig], bool]):
    """Decorator: `build(section, parts)` makes component `name` when `active(cfg)`; a repeated name is an
    error."""
    def deco(build):
        if name in REGISTRY:
            raise ValueError(f"component {name!r} is already registered")
        REGISTRY[name] = Registration(name, section, active, build)
        return build
    return deco


def build_components(cfg: TrainConfig, parts: Parts) -> dict[str, Any]:
    """Every registered component `cfg` turns on, built from its section, in registration order."""
    for module in BUILTIN:
        importlib.import_module(module)
    return {r.name: r.build(value_at(cfg, r.section), parts) for r in REGISTRY.values() if r.active(cfg)}


def start_all(components: dict[str, Any], policy) -> None:
    for comp in components.values():
        if hasattr(comp, "start"):
            comp.start(policy)


def warm_all(components: dict[str, Any], mb: dict, policy) -> int:
    return sum(comp.warm(mb, policy) for comp in components.values() if hasattr(comp, "warm"))


def saved_states(components: dict[str, Any]) -> dict[str, Any]:
    """{name: arrays} of the components a checkpoint holds (those with `saved()` returning arrays)."""
    out = {}
    for name, comp in components.items():
        state = comp.saved() if hasattr(comp, "saved") else None
        if state is not None:
            out[name] = state
    return out


def restore_targets(components: dict[str, Any], policy) -> dict[str, Any]:
    return {name: comp.restore_target(policy) for name, comp in components.items() if hasattr(comp, "restore_target")}


def restored_all(components: dict[str, Any], state: dict | None) -> None:
    for name, comp in components.items():
        if hasattr(comp, "restored"):
            comp.restored(None if state is None else state[name])
