"""RollPacker's parallelism planner (§4.2): per round type, the rollout TP size from the preemption counts.

    planner = TPPlanner(len(svc.devices), cfg, start_tp=1)
    ...                                                   # a step of round type "short" ran
    d = planner.decide("short", step_preemptions)         # -> Decision(tp, instances, changed, reason)
    apply(svc, planner.layout_for(next_round_type), new_weights)   # the weight sync, riding a relayout

**The rule** (the paper's "lightweight heuristic"), kept separately for every round type (a free string:
tail batching's "short" and "long", or "sync" without it), after each step of that type with its count p:

- *rise*: p > rise x (the previous count of that round type), rise = 1.05 -> TP x2 (the next candidate up);
- *calm*: `calm_steps` (4) consecutive steps of that round type with p == 0 -> TP /2 (the next one down),
  and the calm count starts again (another 4 calm steps before the next halving);
- otherwise the TP stays. A rise at the largest candidate, or calm at the smallest, keeps the TP and says so.

Decided edge cases:
- *The first step of a round type* compares with 0: its start TP is the profiled default that the paper
  expects to run without preemption, so any preemption on the first step (0 -> p > 0) is a rise. Likewise
  a rise from 0 to any p > 0 later is a rise (the ratio is unbounded), e.g. after a halving that preempts.
- The previous count is the raw count of the previous step of that round type, whatever TP it ran at (as in
  the paper); a halving that preempts therefore doubles back at once, and a further halving needs another
  `calm_steps` calm steps, which bounds the oscillation to one round trip per `calm_steps + 1` steps.
- *Candidates* are the powers of two t <= `max_tp` (default: the pool's device count) that divide the
  pool's device count (instances = devices // t, every device used), whose instances' memory budget holds
  one request of max_seq_len (`fits`: the simulator found the calm rule halving a 32B model's TP2 to TP1,
  whose pool could not hold one 32K request), and that the rollout sharding rules accept for the model: `specs_for` of the weights (vocabulary padded by `padded_vocab_for`; heads and mlp
  must divide t) and of the KV cache under `ShardingRules.rollout` (kv heads divide t, or t is a multiple
  of them and they replicate). The same check the service runs, so a candidate always builds. These sets
  are downward closed, so "next candidate up/down" is exactly x2 / /2 whenever that is a candidate.
- A new round type starts at `start_tp`.

**Applying a decision** (between steps, nothing live): `apply(svc, layout, weights)` replaces the per-step
`svc.update_weights(weights)`. Same layout: it is that call. New layout: `svc.relayout(..., weights=weights)`
reshards them *once*, straight into the new instances (the stale rollout copies are freed, the caller's
arrays are never freed or donated): the layout change costs no weight movement beyond the sync itself. Weights that are not addressable from this process (multi-process global
arrays) fall back to relayout (moving the old rollout copy) followed by `update_weights`.

**Preemption counts.** `svc.stats()[i]["preemptions"]` is *cumulative* per instance since that instance was
built, and a relayout rebuilds every instance (the counters restart at 0). Per step, read
`total_preemptions(svc)` after `apply` and again after the rollout and take the difference, or sum
`Completion.preemptions` over the step's completions (aborted ones included), which survives relayouts
mid-step (PAT) because a sequence's count travels with it. Multi-process: decide on the global sum, so every
process takes the same decision.

Simplified versus the paper (said, not hidden): the offline phase (profiling memory over batch sizes and
lengths to choose the default TP) is not implemented: `start_tp` is the configured `engine.tp`. The paper
confines a TP group to one server; here it is confined to the rollout pool this process drives (its
devices, as `RolloutService` takes them), and `max_tp` caps it further. Only TP is planned (no pipeline or
expert parallelism), uniformly over the pool (every instance the same TP).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence as Seq

import jax

from models import ModelConfig, kv_cache_spec, logical_axes
from sharding import Layout, ShardingRules, padded_vocab_for, specs_for


log = logging.getLogger("jaxrl.rollout.planner")

STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
    """A uniform rollout layout: `instances` instances of `tp` devices each."""

    tp: int
    instances: int


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the next step of `round_type` runs at, and why; `changed` when that differs from this step's TP."""

    tp: int
    instances: int
    changed: bool
    reason: str
    round_type: str = ""
    preemptions: int = 0          # the count this decision read
    previous_tp: int = 0          # the TP the step that produced the count ran at

    @property
    def layout(self) -> RolloutLayout:
        return RolloutLayout(self.tp, self.instances)


def rollout_tp_problem(cfg: ModelConfig, tp: int) -> str | None:
    """Why the rollout rules cannot shard `cfg` over `tp` devices (None when they can): the weights with
    the vocabulary padded for `tp`, and the paged KV cache, checked by `sharding.specs_for`."""
    layout = Layout(tp=tp)
    try:
        rules = ShardingRules.rollout(cfg, layout)
        specs_for(logical_axes(cfg, vocab_size=padded_vocab_for(cfg, layout)), rules, layout.mesh_shape)
        specs_for(kv_cache_spec(cfg, 1, 1), rules, layout.mesh_shape)
    except ValueError as e:
        return " ".join(line.strip() for line in str(e).splitlines()[:2])
    return None


def candidate_tps(devices: int, cfg: ModelConfig, max_tp: int | None = None) -> list[int]:
    """Powers of two that divide `devices`, are at most `max_tp`, and that the rollout rules accept for `cfg`."""
    cap = devices if max_tp is None else min(devices, max_tp)
    out, t = [], 1
    while t <= cap:
        if devices % t == 0 and rollout_tp_problem(cfg, t) is None:
            out.append(t)
        t *= 2
    return out


@dataclasses.dataclass
class _Round:
    """One round type's state: its TP, the previous step's count (None before its first step), the run of
    consecutive steps without preemption, steps decided."""

    tp: int
    last: int | None = None
    calm: int = 0
    steps: int = 0


class TPPlanner:
    """Per-round-type rollout TP from preemption counts (see the module docstring for the rule)."""

    def __init__(self, devices: int, cfg: ModelConfig, start_tp: int, *, rise: float = 1.05, calm_steps: int = 4,
                 max_tp: int | None = None, fits: Callable[[int], bool] | None = None):
        """`fits(tp)`: whether an instance of that TP can hold one request of the engine's max_seq_len in its
        memory budget (a layout that cannot would refuse every long request); candidates that do not fit are
        dropped. None: every candidate fits."""
        if not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices={devices!r} must be a positive int (the rollout pool's device count)")
        if not rise >= 1.0:
            raise ValueError(f"rise={rise!r} must be >= 1 (a count must grow by this factor to raise TP)")
        if not isinstance(calm_steps, int) or calm_steps < 1:
            raise ValueError(f"calm_steps={calm_steps!r} must be a positive int")
        if max_tp is not None and (not isinstance(max_tp, int) or max_tp < 1):
            raise ValueError(f"max_tp={max_tp!r} must be a positive int or None")
        self.devices, self.rise, self.calm_steps, self.max_tp = devices, float(rise), calm_steps, max_tp
        self.pool = devices                  # the pool it was built for (`devices` may grow: `resize`)
        self.candidates = candidate_tps(devices, cfg, max_tp)
        if fits is not None:
            dropped = [t for t in self.candidates if not fits(t)]
            self.candidates = [t for t in self.candidates if t not in dropped]
            if dropped:
                log.info("planner: TP %s left out: an instance cannot hold a max_seq_len request in its memory "
                         "budget", dropped)
        if start_tp not in self.candidates:
            why = (f"tp must divide the pool's {devices} devices" if devices % start_tp else
                   "an instance of it cannot hold a max_seq_len request in the memory budget"
                   if fits is not None and start_tp in candidate_tps(devices, cfg, max_tp) else
                   f"above max_tp={max_tp}" if max_tp is not None and start_tp > max_tp else
                   rollout_tp_problem(cfg, start_tp) or "not a power of two")
            raise ValueError(f"start_tp={start_tp} is not a candidate TP ({why}); candidates for {devices} devices "
                             f"and this model: {self.candidates}")
        self.start_tp = start_tp
        self.rounds: dict[str, _Round] = {}
        self.last: Decision | None = None

    # ------------------------------------------------------------------ the rule
    def _round(self, round_type: str) -> _Round:
        if not isinstance(round_type, str) or not round_type:
            raise ValueError(f"round_type={round_type!r} must be a non-empty str")
        return self.rounds.setdefault(round_type, _Round(self.start_tp))

    @classmethod
    def from_config(cls, section, devices: int, cfg: ModelConfig, start_tp: int,
                    fits: Callable[[int], bool] | None = None) -> TPPlanner | None:
        """The planner a `jaxrl.config.planner.PlannerSection` describes for a pool of `devices` starting at
        `start_tp`; None when it is off. `fits`: as for `TPPlanner`."""
        if not section.enabled:
            return None
        return cls(devices, cfg, start_tp, rise=float(section.rise), calm_steps=section.calm_steps,
                   max_tp=section.max_tp, fits=fits)

    def resize(self, devices: int) -> None:
        """StreamRL's scale-up grew the pool to `devices`: every layout from now on is tp x (devices // tp).
        The candidates stay those of the pool the planner was built for (each divides it); on a grown pool a TP
        that does not divide it runs devices // tp instances and leaves the rest idle."""
        if not isinstance(devices, int) or devices < self.pool:
            raise ValueError(f"devices={devices!r}: a pool only grows (built for {self.pool})")
        self.devices = devices

    def layout_for(self, round_type: str) -> RolloutLayout:
        """The layout the next step of `round_type` should run at (`start_tp` for a round type not seen yet)."""
        tp = self.rounds[round_type].tp if round_type in self.rounds else self.start_tp
        return RolloutLayout(tp, self.devices // tp)

    def decide(self, round_type: str, preemptions: int) -> Decision:
        """Read the preemption count of the step of `round_type` that just ran; returns the TP its next step
        runs at, with the reason (logged)."""
        if not isinstance(preemptions, int) or isinstance(preemptions, bool) or preemptions < 0:
            raise ValueError(f"preemptions={preemptions!r} must be a non-negative int (this step's count)")
        st = self._round(round_type)
        old, prev, p = st.tp, st.last, preemptions
        baseline = 0 if prev is None else prev
        seen = "first step, vs 0" if prev is None else f"previous {prev}"
        st.calm = st.calm + 1 if p == 0 else 0
        i = self.candidates.index(st.tp)
        if p > self.rise * baseline:
            if i + 1 < len(self.candidates):
                st.tp = self.candidates[i + 1]
                reason = f"preemptions rose to {p} ({seen}; > {self.rise:g}x): tp {old} -> {st.tp}"
            else:
                reason = (f"preemptions rose to {p} ({seen}; > {self.rise:g}x) but tp {old} is the largest "
                          f"candidate {self.candidates}: tp stays {old}")
        elif st.calm >= self.calm_steps:
            if i > 0:
                st.tp = self.candidates[i - 1]
                reason = f"{st.calm} consecutive steps without preemption: tp {old} -> {st.tp}"
                st.calm = 0
            else:
                reason = (f"{st.calm} consecutive steps without preemption but tp {old} is the smallest "
                          f"candidate: tp stays {old}")
        else:
            reason = (f"preemptions {p} ({seen}; not > {self.rise:g}x), {st.calm}/{self.calm_steps} calm steps: "
                      f"tp stays {old}")
        st.last, st.steps = p, st.steps + 1
        d = Decision(st.tp, self.devices // st.tp, st.tp != old, reason, round_type, p, old)
        self.last = d
        log.info("planner [%s step %d] %s (next %s step: tp %d x %d instances)", round_type, st.steps, reason,
                 round_type, d.tp, d.instances)
        return d

    # ------------------------------------------------------------------ metrics and checkpoints
    def metrics(self) -> dict[str, float | int]:
        """`planner/tp`, `planner/instances`, `planner/changed`, `planner/preemptions` of the latest decision,
        and `planner/<round type>/{tp,instances,calm_steps,preemptions}` per round type seen."""
        out: dict[str, float | int] = {}
        if self.last is not None:
            out.update({"planner/tp": self.last.tp, "planner/instances": self.last.instances,
                        "planner/changed": int(self.last.changed), "planner/preemptions": self.last.preemptions})
        for name, st in sorted(self.rounds.items()):
            out.update({f"planner/{name}/tp": st.tp, f"planner/{name}/instances": self.devices // st.tp,
                        f"planner/{name}/calm_steps": st.calm,
                        f"planner/{name}/preemptions": -1 if st.last is None else st.last})
        return out

    def state_dict(self) -> dict:
        """Plain JSON-able state (checkpointed next to the data cursor, so resume decides identically)."""
        return {"version": STATE_VERSION, "devices": self.devices, "start_tp": self.start_tp,
                "rounds": {k: dataclasses.asdict(v) for k, v in self.rounds.items()},
                "last": None if self.last is None else dataclasses.asdict(self.last)}

    def load_state_dict(self, state: dict):
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"planner state version {state.get('version')!r}; this code reads {STATE_VERSION}")
        if state["devices"] != self.devices:
            raise ValueError(f"planner state is for a pool of {state['devices']} devices, this planner has "
                             f"{self.devices}")
        rounds = {k: _Round(**v) for k, v in state["rounds"].items()}
        bad = {k: r.tp for k, r in rounds.items() if r.tp not in self.candidates}
        if bad:
            raise ValueError(f"planner state has TP {bad}, not among this planner's candidates {self.candidates} "
                             f"(max_tp or the model changed)")
        self.rounds = rounds
        self.last = None if state["last"] is None else Decision(**state["last"])


# ---------------------------------------------------------------------- applying a layout
def total_preemptions(svc) -> int:
    """Preemptions counted by the service's current instances (cumulative since each was built)."""
    return sum(int(s["preemptions"]) for s in svc.stats())


def _addressable(tree) -> bool:
    return all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in jax.tree.leaves(tree))


def apply(svc, layout: RolloutLayout | Decision, weights=None, *, warm: Seq | None = None,
          adapters_only: bool = False):
    """Bring `svc` to `layout` between steps (no live sequence), syncing `weights` (any layout) on the way.
    Returns the `RelayoutReport` when the layout changed, else None. `warm`: sampling params to compile the
    new layout's bounded step set right away (`svc.warm`) instead of lazily during the next rollout.
    `adapters_only`: on an unchanged layout, a LoRA sync moves the adapters only (`update_weights`)."""
    if svc.live():
        raise RuntimeError(f"apply() runs between steps; {len(svc.live())} sequences are live (abort or finish them)")
    target = [layout.tp] * layout.instances
    if layout.tp * layout.instances > len(svc.devices):
        raise ValueError(f"layout tp={layout.tp} x {layout.instances} needs more than the pool's {len(svc.devices)} "
                         f"devices")
    if svc.layout == target:
        if weights is not None:
            svc.update_weights(weights, adapters_only=adapters_only)
        return None
    if weights is not None and _addressable(weights):
        # One reshard: the new weights go straight into the new instances and the stale rollout copies are
        # freed (`relayout(weights=)`: the caller's arrays are never freed or donated).
        report = svc.relayout(layout.tp, layout.instances, weights=weights)
    else:
        report = svc.relayout(layout.tp, layout.instances)
        if weights is not None:
            svc.update_weights(weights)
    if warm:
        svc.warm(warm)
    return report
