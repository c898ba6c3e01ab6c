"""PAT at run time: Algorithm 1 inside the rollout service's decode loop (`engine.adaptive_tp`).

    svc.adaptive = AdaptiveTP(SwitchController(Predictor(Profile.load(path)), [1, 2, 4, 8], 8), check_every=16)
    svc.run()                   # every 16 decode steps: decide; on a switch, svc.relayout(tp, kv=...) mid-generation
    svc.adaptive.decisions      # one record per evaluation: inputs, each candidate's predicted times, the choice,
                                # and the measured times afterwards (the switch's, the remaining decode's)
    svc.adaptive.home(svc, weights)   # between steps: back to the step's starting layout (with the weight sync)

After every engine step that decoded (`RolloutService.step` calls `after_step`), the driver counts decode
steps; every `check_every` of them it reads the live sequences (context length, the tokens each may still
generate, its instance), asks the controller, and on a switch relayouts the service to the chosen uniform
layout with the chosen state handling (`migrate` moves the KV, `recompute` re-prefills it). Several
switches per generation are allowed, in both directions. Waiting sequences count with their context as
well: they will decode under whichever layout runs.

Each decision's `actual` is filled in: `switch_s` (the relayout's measured seconds, with `kv_s`,
`weight_bytes` — what crossed links with the nested device order, `sharding.reuse` — and
`weight_bytes_contiguous`, what contiguous device groups would have moved), and, for every decision,
`remaining_s`: the wall time from the decision to the end of
that generation (the moment the service next runs out of work), to set against `current_s` / the chosen
candidate's `remaining_s`. `warm(tp)` is true for a layout this process has already run (its executables
are in the process-wide cache), or, with `precompile` (`precompile.Precompiler`), one whose small decode
buckets a background thread compiled after the controller first saw it and whose merged batch fits them;
its compile cost then counts as 0.

**StreamRL's classes.** When skew placement is active in a step (`train.skew_step.SkewStep.place` sets
`classes`, a `skew.Classes`), every live sequence is tagged long or regular by the instance it sits on when
first seen, the controller predicts each candidate with each class dealt over its own instances, and a
switch keeps them: the relayout deals the classes the same way (`svc.relayout(..., classes=)`) and the new
instances get their class's batch cap (lifted on a single instance, where the classes merge). The classes
last until the next placement (or `home`).

**Several processes, one decision** (`agree` set: a multi-process run, each process driving the pool of its
own devices, as PAT's intra-node switch is per node). Every process evaluates Algorithm 1 on its own live
sequences at the same tick and the processes agree on one decision: each candidate's cost is the largest
over the processes that still decode (the step's rollout ends with its slowest pool; a process that has
finished contributes nothing), the current layout's time likewise, and the `min_gain` rule then picks one
TP for all. Every process switches at that tick, each moving its own state the way its own prediction
chose (migrate or recompute). Ticks are counted alike on every process: an engine step of a process with
work, one pass of the rollout loop of a process without (`idle_tick`, so it takes part until the processes
have all finished: `pending`); a check tick exchanges the processes' predictions (`agree`: the run's
key-value-store exchange, its own stream of calls).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .adaptive_tp import Live, Predictor, Profile, SwitchController, SwitchDecision, merge_and_redistribute
from .skew import Classes
from .planner import apply, rollout_tp_problem
from .precompile import Precompiler

log = logging.getLogger(__name__)


class AdaptiveTP:
    def __init__(self, controller: SwitchController, *, check_every: int = 16, min_batch: int = 1,
                 precompile: Precompiler | None = None):
        if check_every < 1:
            raise ValueError(f"check_every={check_every} must be >= 1")
        self.controller, self.check_every, self.min_batch = controller, check_every, min_batch
        self.precompile = precompile           # background compiles of unseen candidates' small buckets
        self.decisions: list[SwitchDecision] = []
        self.seen: set[int] = set()            # layouts (TP sizes) this process has run: compiled
        self._steps = 0
        self._open: list[SwitchDecision] = []  # decisions of the running generation, awaiting `remaining_s`
        self._reported = 0
        self.classes: Classes | None = None    # StreamRL's long/regular classes of this step (None: no placement)
        self.agree: Callable[[np.ndarray], list[np.ndarray]] | None = None   # several processes: the exchange
        self._all_done = False                 # several processes: every one has finished this generation

    @classmethod
    def from_config(cls, section, devices: int, model_cfg=None) -> AdaptiveTP | None:
        """The driver a `jaxrl.config.adaptive_tp.AdaptiveTPSection` describes for a rollout pool of `devices`
        devices (None when disabled); with `model_cfg`, a candidate the rollout sharding rules cannot lay the
        model out on is refused."""
        if not section.enabled:
            return None
        path = Path(section.profile).expanduser()
        if not path.is_file():
            raise SystemExit(f"engine.adaptive_tp.profile={path.absolute()}: no such file (python -m "
                             "jaxrl.rollout.profile writes one)")
        prof = Profile.load(path)
        if prof.key.get("devices") not in (None, devices):
            raise SystemExit(f"engine.adaptive_tp.profile={path.absolute()} was measured on a pool of "
                             f"{prof.key['devices']} devices, this engine has {devices}: re-profile")
        pred = Predictor(prof)
        cands = list(section.candidates) or [t for t in pred.layouts if devices % t == 0]
        if model_cfg is not None:
            for t in cands:
                if (why := rollout_tp_problem(model_cfg, t)) is not None:
                    raise SystemExit(f"engine.adaptive_tp.candidates: TP {t} cannot shard this model ({why})")
        try:
            ctl = SwitchController(pred, cands, devices, kv=section.kv, min_gain=section.min_gain)
        except ValueError as e:
            raise SystemExit(f"engine.adaptive_tp: {e}") from None
        pre = Precompiler(section.precompile_fraction) if section.precompile and not section.warm else None
        return cls(ctl, check_every=section.check_every, precompile=pre)

    def warm(self, tp: int, live: list[Live] | None = None) -> bool:
        """Whether a switch to `tp` compiles no decode step: a layout this process has run, or one whose small
        buckets the background compile finished and the merged batch of `live` fits."""
        if tp in self.seen:
            return True
        if self.precompile is None or live is None:
            return False
        groups = merge_and_redistribute(live, self.controller.devices // tp, classes=self.classes)
        return self.precompile.ready(tp, max(len(g) for g in groups))

    def _first_sight(self, svc, current: int) -> None:
        """Start the background compile of every candidate layout not run yet (once per layout)."""
        params = [s.params for inst in svc.instances for s in inst.sched.live]
        truncate = tuple(sorted({p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params})) or (False,)
        for tp in self.controller.candidates:
            if tp != current and tp not in self.seen:
                self.precompile.request(svc, tp, truncate)

    @staticmethod
    def uniform_tp(svc) -> int | None:
        tps = set(svc.layout)
        return tps.pop() if len(tps) == 1 else None

    def live(self, svc) -> list[Live]:
        """The live sequences as the controller sees them (each tagged with its class when classes are kept)."""
        rows = svc.sequence_stats()
        if self.classes is not None:
            for s in rows:
                self.classes.tag(int(s["request_id"]), int(s["instance"]))
        return [Live(int(s["context_len"]), max(0, int(s["max_new_tokens"]) - int(s["generated"])), int(s["instance"]),
                     int(s["request_id"]), s["group"] if s["group"] is not None and s["pages"] else None)
                for s in rows]

    def after_step(self, svc) -> SwitchDecision | None:
        """Called by the service after each engine step; returns the decision when one was evaluated."""
        tp = self.uniform_tp(svc)
        if tp is not None:
            self.seen.add(tp)
        if self.agree is not None:
            return self.idle_tick(svc)
        if not svc.has_work():
            self._close()
            self._steps = 0
            return None
        self._steps += 1
        if self._steps % self.check_every or tp is None:
            return None
        live = self.live(svc)
        if len(live) < self.min_batch:
            return None
        if self.precompile is not None:
            self._first_sight(svc, tp)
        d = self.controller.decide(tp, live, step=self._steps, warm=lambda t: self.warm(t, live),
                                   classes=self.classes)
        return self._apply(svc, d, live)

    def _apply(self, svc, d: SwitchDecision, live: list[Live]) -> SwitchDecision:
        """Carry out decision `d` (relayout on a switch) and record it."""
        d.actual["t0"] = time.perf_counter()
        if d.switch:
            n = self.controller.devices // d.tp
            if self.classes is None:
                report = svc.relayout(d.tp, n, kv=d.kv)
            else:                         # the classes the controller predicted with, then each class's cap
                self.classes = self.classes.to(n, [x.rid for x in live])
                report = svc.relayout(d.tp, n, kv=d.kv, classes=self.classes)
                svc.set_batch_caps([None if c is None else min(c, i.max_batch)
                                    for c, i in zip(self.classes.caps(), svc.instances)])
                d.actual["long_instances"] = self.classes.n_long
            self.seen.add(d.tp)
            d.actual.update(instances=len(svc.instances), switch_s=report.seconds, kv_s=report.kv.seconds,
                            weight_bytes=report.weight_bytes,
                            weight_bytes_contiguous=report.weight_bytes_contiguous,
                            kv_bytes=report.kv.kv_bytes, moved=report.sequences, compiles=report.compiles)
            rest, cost = next(((c.remaining_s, c.switch_s) for c in d.candidates if c.tp == d.tp), (0.0, 0.0))
            log.info("PAT: TP %d -> %d at decode step %d (%d live, %d context tokens; predicted %.3f s -> %.3f s "
                     "+ %.3f s switch, kv %s; switched in %.3f s)", d.current, d.tp, d.step, d.batch, d.tokens,
                     d.current_s, rest, cost, d.kv, report.seconds)
        self.decisions.append(d)
        self._open.append(d)
        return d

    # ------------------------------------------------------------------------------ several processes
    def begin(self) -> None:
        """A generation starts (with `agree`: on every process, together)."""
        self._steps, self._all_done = 0, False

    def pending(self) -> bool:
        """With `agree`: this process must keep ticking, the processes have not all finished the generation."""
        return self.agree is not None and not self._all_done

    def idle_tick(self, svc) -> SwitchDecision | None:
        """One tick of this process (an engine step, or a pass of the rollout loop without work); every
        `check_every` ticks the processes agree (`agree` set)."""
        self._steps += 1
        if self._steps % self.check_every:
            return None
        return self._agree(svc)

    def _agree(self, svc) -> SwitchDecision | None:
        """A check tick of several processes: each one's prediction, exchanged; one decision for all."""
        tp, cands = self.uniform_tp(svc), self.controller.candidates
        live = self.live(svc) if svc.has_work() else []
        mine = None
        if live:
            if self.precompile is not None:
                self._first_sight(svc, tp)
            mine = self.controller.decide(tp, live, step=self._steps, warm=lambda t: self.warm(t, live),
                                          classes=self.classes)
            totals = [next(c.total_s for c in mine.candidates if c.tp == t) for t in cands]
        payload = np.asarray([float(svc.has_work()), len(live), mine.current_s if mine else 0.0,
                              *(totals if mine else [0.0] * len(cands))], np.float64)
        every = np.stack(self.agree(payload))
        if not every[:, 0].any():          # the generation is over on every process
            self._all_done = True
            self._close()
            return None
        if every[:, 1].sum() < self.min_batch:
            return None
        t_cur, cost = float(every[:, 2].max()), every[:, 3:].max(axis=0)
        best, best_t = tp, np.inf
        for t, c in zip(cands, cost):
            if c < best_t:
                best, best_t = t, float(c)
        if not (best != tp and t_cur * (1.0 - self.controller.min_gain) > best_t):
            best = tp
        if mine is None:                   # nothing live here: the state to move is none
            mine = SwitchDecision(self._steps, tp, 0, 0, 0.0, [], tp, "")
        mine.tp = best
        mine.kv = next((c.kv for c in mine.candidates if c.tp == best), "migrate") if best != tp else ""
        mine.actual["agreed"] = {"processes": len(every), "current_s": t_cur,
                                 "cost": {int(t): float(c) for t, c in zip(cands, cost)}}
        return self._apply(svc, mine, live)

    def _close(self) -> None:
        now = time.perf_counter()
        for d in self._open:
            d.actual["remaining_s"] = now - d.actual.pop("t0")
        self._open = []

    def warm_layouts(self, svc, params) -> int:
        """Compile every candidate layout's bounded step set now (`svc.warm(params)` on each, between steps),
        so a switch mid-generation compiles nothing; the service ends on the layout it started on."""
        start = list(svc.layout)
        tp0 = self.uniform_tp(svc)
        if tp0 is None:
            raise ValueError(f"PAT needs a uniform layout, got {start}")
        n = 0
        for tp in self.controller.candidates:
            if tp != tp0:
                svc.relayout(tp, self.controller.devices // tp)
                n += svc.warm(params)
            self.seen.add(tp)
        if svc.layout != start:
            svc.relayout(tp0, len(start))
        return n

    def home(self, svc, layout, weights=None, *, warm=None, adapters_only: bool = False, devices: int | None = None):
        """Between steps: bring the service back to `layout` (a `planner.RolloutLayout`: the step's starting
        one, or the planner's), syncing `weights` on the way (`planner.apply`). The step's classes end here.
        `devices` (default: `layout`'s) is the pool the next generation's switches share (`controller.devices`):
        the configured pool, or one StreamRL's scale-up grew, where a candidate TP that does not divide it runs
        devices // TP instances and leaves the rest idle."""
        self._close()
        self.controller.devices = devices or layout.tp * layout.instances
        self.classes = None
        self._steps = 0
        return apply(svc, layout, weights, warm=warm, adapters_only=adapters_only)

    def metrics(self, decisions=None) -> dict:
        """pat/...: evaluations, switches, their measured seconds (over `decisions`, default all)."""
        ds = self.decisions if decisions is None else decisions
        sw = [d for d in ds if d.switch]
        return {"pat/decisions": len(ds), "pat/switches": len(sw),
                "pat/switch_s": float(sum(d.actual.get("switch_s", 0.0) for d in sw)),
                "pat/max_tp": max([d.tp for d in ds], default=0)}

    def step_metrics(self, step: int, path=None) -> dict:
        """The metrics of the decisions since the last call; their records (with `rl_step`) are appended to
        the JSONL file `path` when given (the train run's `pat_decisions.jsonl`)."""
        new, self._reported = self.decisions[self._reported:], len(self.decisions)
        if path is not None and new:
            with open(path, "a") as f:
                for d in new:
                    f.write(json.dumps({"rl_step": step, **d.record()}) + "\n")
        return self.metrics(new)

    def records(self) -> list[dict]:
        return [d.record() for d in self.decisions]
