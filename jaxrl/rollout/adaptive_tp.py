"""PAT's latency predictor and switch controller (paper §4.2 Algorithm 1, §4.3 Eq. 1–4).

    profile = Profile.load("profile.json")              # python -m jaxrl.rollout.profile writes it
    pred = Predictor(profile)
    ctl = SwitchController(pred, candidates=[1, 2, 4, 8], devices=8, kv="auto")
    d = ctl.decide(current_tp, live, warm=...)         # every `check_every` decode steps
    if d.switch: svc.relayout(d.tp, kv=d.kv)

**Predictor.** Per layout (TP size), the profile holds decode-step latencies at (batch B, context length
L) points and prefill latencies at (B, L). The per-step latency ℓ(B, T; tp), T = Σ context tokens, is
piecewise linear in T over each profiled B's points (extended linearly past its first and last point)
and linearly interpolated between the two nearest profiled B (clamped outside the profiled range).
T_prefill(B, L; tp) likewise, in L. Exact at every profiled point.

**Remaining time** (`est_rem_time`, Algorithm 1 lines 4 and 8) of one TP group: every live sequence is
assumed to run to its own maximum (`max_new_tokens`; the paper's conservative L_max bound — a sequence may
stop earlier, never later), so at decode step s the group holds the sequences with ≥ s tokens left and T
grows by one per live sequence per step; the time is Σ_s ℓ(B(s), T(s)). DP groups decode concurrently, so
a layout's remaining time is the maximum over its groups. When every sequence started together with the
same maximum this is exactly the paper's est_rem_time(tp, rbs, L_max, L_gen).

**Merged batch** (`compute_merged_bs`, line 7): a candidate layout's groups receive the live sequences
dealt as `RolloutService.relayout` attaches them (`migration.deal`: request-id order, each to the
least-loaded group by context tokens; a prompt's samples that share KV pages move as one unit when the KV
migrates, one by one when it is recomputed; with StreamRL's skew placement active, each long/regular class
over its own groups: `skew.Classes`).

**Switch cost** (line 9): state handling + weight reshard + compile + control.
- Migration (Eq. 1–2): S_kv^rank = Σ_i 2·M·L_i·(H_kv / TP_src)·s over the sequences of a source group
  (M layers, H_kv = kv heads × head dim — the KV width, which is the paper's hidden size H for
  multi-head attention; s bytes per element); the critical path is the largest group, and
  T_move = S_kv^rank / B_net with B_net the profiled one-way per-rank migration bandwidth.
- Recomputation (Eq. 3–4): L_RMS = sqrt(mean L̃_i²) over a target group's sequences, T_recomp =
  T_prefill(B, L_RMS; TP_target), the maximum over target groups.
- `kv="auto"` takes min(T_move, T_recomp) (and reports which); `migrate` / `recompute` force one.
- Weight reshard: the profiled seconds for (TP_src → TP_target); compile: 0 when the target's step set is
  warm, else the profiled compile seconds of that layout; control: the profiled fixed overhead.

**Decision** (lines 5–19): the candidate with the least remaining time + switch cost; switch only when
it differs from the current TP and beats continuing (T_cur > T_best). Every decision is a record (inputs,
each candidate's predicted times, the choice) that the caller completes with measured times.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np

from .skew import Classes, deal_units

KV_CHOICES = ("auto", "migrate", "recompute")
PROFILE_VERSION = 1


# ------------------------------------------------------------------------------------------ profile
@dataclasses.dataclass
class LayoutProfile:
    """Measurements of one layout (TP size, instances = devices / tp), for one TP group:
    `decode` rows (batch, context, seconds per decode step), `prefill` rows (batch, length, seconds),
    `compile_seconds` (its whole step set, for a layout seen the first time), `shapes`: the padded decode
    shapes its instances run ({"batch", "pages", "page_size"}: `Padded`), None for a paged kernel;
    `contention`: [(batch, κ)], how much the layout's instances slow each other when all decode at once, as a
    fraction of perfectly serial (a step of all n instances takes t·(1 + κ·(n − 1)) when one alone takes t),
    per batch size: 0 on devices of their own (a GPU), up to 1 where fake devices share the CPU's cores
    (the simulator reads it; PAT's predictor, per TP group, does not)."""

    tp: int
    decode: list[tuple[int, int, float]]
    prefill: list[tuple[int, int, float]]
    compile_seconds: float = 0.0
    shapes: dict | None = None
    contention: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Profile:
    """The profiler's output (`python -m jaxrl.rollout.profile`), keyed by `key` (model shape, device kind,
    dtype, pool size). `migrate_bytes_per_s`: one-way per-rank KV bandwidth of a relayout; `reshard_seconds`:
    {"src->dst": seconds} of the weight reshard (with the service rebuild: the control overhead of a
    relayout with nothing live); `control_seconds`: the controller's own fixed cost per switch.
    `kv_bytes_per_token_layer`: 2·H_kv·s, the K+V bytes of one token in one layer (Eq. 1); `layers`: M."""

    key: dict
    layouts: dict[int, LayoutProfile]
    migrate_bytes_per_s: float
    reshard_seconds: dict[str, float]
    layers: int
    kv_bytes_per_token_layer: int
    control_seconds: float = 0.0

    def to_json(self) -> dict:
        return {"version": PROFILE_VERSION, "key": self.key, "layers": self.layers,
                "kv_bytes_per_token_layer": self.kv_bytes_per_token_layer,
                "migrate_bytes_per_s": self.migrate_bytes_per_s, "reshard_seconds": self.reshard_seconds,
                "control_seconds": self.control_seconds,
                "layouts": {str(tp): {"tp": lp.tp, "decode": [list(r) for r in lp.decode],
                                      "prefill": [list(r) for r in lp.prefill], "compile_seconds": lp.compile_seconds,
                                      "shapes": lp.shapes, "contention": [list(c) for c in lp.contention]}
                            for tp, lp in sorted(self.layouts.items())}}

    @classmethod
    def from_json(cls, d: dict) -> "Profile":
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')!r}, this code reads {PROFILE_VERSION}: re-profile")
        layouts = {int(k): LayoutProfile(int(v["tp"]), [(int(b), int(n), float(s)) for b, n, s in v["decode"]],
                                         [(int(b), int(n), float(s)) for b, n, s in v["prefill"]],
                                         float(v.get("compile_seconds", 0.0)), v.get("shapes"),
                                         [(int(b), float(k)) for b, k in v.get("contention", [])])
                   for k, v in d["layouts"].items()}
        return cls(dict(d["key"]), layouts, float(d["migrate_bytes_per_s"]),
                   {str(k): float(v) for k, v in d["reshard_seconds"].items()}, int(d["layers"]),
                   int(d["kv_bytes_per_token_layer"]), float(d.get("control_seconds", 0.0)))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        return cls.from_json(json.loads(Path(path).read_text()))


# ---------------------------------------------------------------------------------------- predictor
def _piecewise(xs: np.ndarray, ys: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Piecewise-linear through (xs, ys) (sorted, unique), extended linearly past both ends."""
    if len(xs) == 1:
        return np.full_like(x, ys[0], dtype=np.float64)
    i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class _Surface:
    """f(B, X): piecewise linear in X per profiled B, linear in B between the two nearest profiled B
    (clamped to the profiled B range). Rows are (B, L, seconds); X = B·L when `tokens` (decode: T), else L."""

    def __init__(self, rows: Seq[tuple[int, int, float]], *, tokens: bool):
        if not rows:
            raise ValueError("no profiled points")
        by_b: dict[int, dict[float, list[float]]] = {}
        for b, n, s in rows:
            by_b.setdefault(int(b), {}).setdefault(float(b * n if tokens else n), []).append(float(s))
        self.batches = np.asarray(sorted(by_b), np.float64)
        self.curves = []
        for b in sorted(by_b):
            pts = sorted((x, float(np.mean(v))) for x, v in by_b[b].items())
            self.curves.append((np.asarray([p[0] for p in pts]), np.asarray([p[1] for p in pts])))

    def __call__(self, batch, x) -> np.ndarray:
        batch = np.clip(np.asarray(batch, np.float64), self.batches[0], self.batches[-1])
        x = np.asarray(x, np.float64)
        batch, x = np.broadcast_arrays(batch, x)
        j = np.clip(np.searchsorted(self.batches, batch, side="right") - 1, 0, max(len(self.batches) - 2, 0))
        out = np.empty(batch.shape, np.float64)
        for k in np.unique(j):
            sel = j == k
            lo = _piecewise(*self.curves[k], x[sel])
            if len(self.batches) == 1:
                out[sel] = lo
                continue
            hi = _piecewise(*self.curves[k + 1], x[sel])
            b0, b1 = self.batches[k], self.batches[k + 1]
            out[sel] = lo + (hi - lo) * (batch[sel] - b0) / (b1 - b0)
        return out


@dataclasses.dataclass(frozen=True)
class Live:
    """One live sequence as the controller sees it: its context length now (prompt + generated), the decode
    steps it may still take (max_new_tokens − generated: the conservative bound), its TP group, its request
    id (the order `relayout` deals sequences in), and `share`: the prompt group whose KV pages it shares on
    its instance (None: it holds no shared pages), which a migrating relayout moves as one."""

    context: int
    remaining: int
    group: int = 0
    rid: int = 0
    share: int | None = None


class Padded:
    """The decode shape an engine runs for a batch: rows rounded up to the `batch` ladder, and each row's
    context to the page-table width (`pages` ladder × `page_size`) of the longest sequence — what the XLA
    decode path computes over (`shapes.ShapeBuckets`), whatever the other rows' lengths."""

    def __init__(self, shapes: dict):
        self.batch = np.asarray(sorted(shapes["batch"]), np.int64)
        self.pages = np.asarray(sorted(shapes["pages"]), np.int64)
        self.page_size = int(shapes["page_size"])

    def rows(self, batch) -> np.ndarray:
        b = np.asarray(batch, np.int64)
        return self.batch[np.minimum(np.searchsorted(self.batch, b), len(self.batch) - 1)]

    def width(self, longest) -> np.ndarray:
        """Padded context tokens per row for a longest sequence of `longest` tokens (its next position's page)."""
        need = (np.asarray(longest, np.int64) + self.page_size) // self.page_size
        return self.pages[np.minimum(np.searchsorted(self.pages, need), len(self.pages) - 1)] * self.page_size


class Predictor:
    """ℓ(B, T; tp), T_prefill(B, L; tp), remaining time and switch cost from a `Profile`.

    **Context measure.** The paper's ℓ is piecewise linear in T = Σ context tokens (a paged-attention kernel
    reads each sequence's own pages: our Pallas path). The XLA decode path instead computes over the padded
    shape (`Padded`: rows bucket × the longest row's page-table width), so when the profile carries the
    engine's `shapes` (per layout) the surface is f(rows bucket, padded width) built from the same profiled points, and
    a prediction needs the longest live context too. Without `shapes` (or `longest`) it is the paper's."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.padded = {tp: Padded(lp.shapes) for tp, lp in profile.layouts.items() if lp.shapes}
        self._decode = {tp: self._decode_surface(tp, lp.decode) for tp, lp in profile.layouts.items()}
        self._prefill = {tp: _Surface(lp.prefill, tokens=False) for tp, lp in profile.layouts.items() if lp.prefill}

    def _decode_surface(self, tp: int, rows) -> _Surface:
        pad = self.padded.get(tp)
        if pad is None:
            return _Surface(rows, tokens=True)
        # a profiled point (B, L) ran B rows of context L: its shape is (rows bucket, width of L)
        return _Surface([(int(pad.rows(b)), int(pad.width(n)), s) for b, n, s in rows], tokens=False)

    @property
    def layouts(self) -> list[int]:
        return sorted(self._decode)

    def step_latency(self, tp: int, batch, tokens, longest=None) -> np.ndarray:
        """ℓ(B, T; tp): seconds of one decode step of a TP group holding `batch` sequences, T context tokens
        (`longest`: the longest sequence's context, for a padded profile; default T / B)."""
        pad = self.padded.get(tp)
        if pad is None:
            return self._decode[tp](batch, tokens)
        batch = np.asarray(batch, np.float64)
        if longest is None:
            longest = np.asarray(tokens, np.float64) / np.maximum(batch, 1)
        return self._decode[tp](pad.rows(np.maximum(batch, 1)), pad.width(np.ceil(longest)))

    def prefill_latency(self, tp: int, batch, length) -> np.ndarray:
        """T_prefill(B, L; tp): seconds to prefill `batch` sequences of `length` tokens in one TP group."""
        return self._prefill[tp](batch, length)

    def group_remaining(self, tp: int, contexts: Seq[int], remaining: Seq[int]) -> float:
        """Σ_s ℓ(B(s), T(s); tp) until the group's last sequence reaches its bound (see module docstring);
        a padded profile also follows the longest live context L_max(s)."""
        if not len(contexts):
            return 0.0
        ctx = np.asarray(contexts, np.float64)
        rem = np.sort(np.asarray(remaining, np.int64))
        horizon = int(rem[-1])
        if horizon <= 0:
            return 0.0
        s = np.arange(1, horizon + 1)                          # decode step s (1-based)
        # live at step s: sequences with remaining >= s; B(s) and T(s) = Σ_live (ctx_i + s - 1)
        order = np.argsort(np.asarray(remaining))
        ctx_sorted = ctx[order]
        dead = np.searchsorted(rem, s, side="left")            # sequences with remaining < s
        batch = len(rem) - dead
        suffix = np.concatenate([np.cumsum(ctx_sorted[::-1])[::-1], [0.0]])
        tokens = suffix[dead] + batch * (s - 1)
        longest = np.concatenate([np.maximum.accumulate(ctx_sorted[::-1])[::-1], [0.0]])[dead] + (s - 1)
        return float(self.step_latency(tp, batch, tokens, longest).sum())

    def remaining_time(self, tp: int, groups: Seq[Seq[Live]]) -> float:
        """A layout's remaining decode time: its groups decode concurrently, so the slowest group's."""
        return max((self.group_remaining(tp, [x.context for x in g], [x.remaining for x in g]) for g in groups),
                   default=0.0)

    # -------------------------------------------------------------------------------- switch cost
    def move_seconds(self, src_tp: int, groups: Seq[Seq[Live]]) -> tuple[float, int]:
        """Eq. 1–2: (T_move, S_kv^rank of the critical source group in bytes)."""
        p = self.profile
        per_rank = max((sum(p.layers * x.context * p.kv_bytes_per_token_layer for x in g) / src_tp for g in groups),
                       default=0.0)
        return per_rank / p.migrate_bytes_per_s, int(per_rank)

    def recompute_seconds(self, dst_tp: int, groups: Seq[Seq[Live]]) -> float:
        """Eq. 3–4: max over target groups of T_prefill(B, L_RMS; TP_target)."""
        out = 0.0
        for g in groups:
            if g:
                l_rms = math.sqrt(sum(x.context ** 2 for x in g) / len(g))
                out = max(out, float(self.prefill_latency(dst_tp, len(g), l_rms)))
        return out

    def reshard_seconds(self, src_tp: int, dst_tp: int) -> float:
        p = self.profile
        got = p.reshard_seconds.get(f"{src_tp}->{dst_tp}")
        if got is None:           # not profiled: the slowest profiled reshard (conservative)
            got = max(p.reshard_seconds.values(), default=0.0)
        return got


# ------------------------------------------------------------------------------------ redistribution
def merge_and_redistribute(live: Seq[Live], groups: int, *, keep_shared: bool = True,
                           classes: Classes | None = None) -> list[list[Live]]:
    """compute_merged_bs: the live sequences dealt to `groups` target groups exactly as `migration.deal`
    deals them in a relayout: units in request-id order (the samples of a prompt that share KV pages on one
    instance are one unit when `keep_shared`, as a migrating relayout moves them; a recomputing relayout
    moves every sequence alone), each unit to the group holding the fewest context tokens so far (ties: the
    lower index) — with StreamRL's `classes` (`skew.Classes`, tagged), among its class's groups on that
    layout (`Classes.to`). Both deal with `skew.deal_units`. Dealing shared samples one by one instead
    predicted a balance the migrating relayout does not produce, and the controller then switched back and
    forth at every check (found by the cluster simulator)."""
    out: list[list[Live]] = [[] for _ in range(groups)]
    units: dict = {}
    for x in sorted(live, key=lambda x: x.rid):
        key = (x.group, x.share) if keep_shared and x.share is not None else ("solo", x.rid)
        units.setdefault(key, []).append(x)
    cls = None if classes is None else classes.to(groups, [x.rid for x in live])
    dealt = deal_units([(sum(x.context for x in u), cls is not None and any(x.rid in cls.long for x in u))
                        for u in units.values()], groups, cls)
    for unit, g in zip(units.values(), dealt):
        out[g] += [dataclasses.replace(x, group=g) for x in unit]
    return out


def by_group(live: Seq[Live]) -> list[list[Live]]:
    n = max((x.group for x in live), default=-1) + 1
    out: list[list[Live]] = [[] for _ in range(n)]
    for x in live:
        out[x.group].append(x)
    return out


# ---------------------------------------------------------------------------------------- controller
@dataclasses.dataclass
class Candidate:
    tp: int
    remaining_s: float
    switch_s: float
    kv: str = ""
    move_s: float = 0.0
    recompute_s: float = 0.0
    reshard_s: float = 0.0
    compile_s: float = 0.0
    control_s: float = 0.0
    kv_bytes_per_rank: int = 0

    @property
    def total_s(self) -> float:
        return self.remaining_s + self.switch_s


@dataclasses.dataclass
class SwitchDecision:
    """One Algorithm 1 evaluation: inputs (current tp, live batch, context tokens), every candidate's
    predicted times, the choice. `switch` is True when `tp` differs from `current` (then `kv` says how the
    state moves). The caller fills `actual` with measured times (the switch's, the remaining decode's)."""

    step: int
    current: int
    batch: int
    tokens: int
    current_s: float
    candidates: list[Candidate]
    tp: int
    kv: str
    actual: dict = dataclasses.field(default_factory=dict)

    @property
    def switch(self) -> bool:
        return self.tp != self.current

    def record(self) -> dict:
        return {"step": self.step, "current": self.current, "batch": self.batch, "tokens": self.tokens,
                "current_s": self.current_s, "tp": self.tp, "kv": self.kv, "switch": self.switch,
                "candidates": [dataclasses.asdict(c) | {"total_s": c.total_s} for c in self.candidates],
                "actual": dict(self.actual)}


class SwitchController:
    """Algorithm 1 over a `Predictor`: `decide(current_tp, live, step=, warm=)` returns a `SwitchDecision`.

    `candidates`: TP sizes to consider (those the profile has; each must divide `devices`, the pool it is
    built for; on a pool StreamRL's scale-up grew, `devices` is reset and a TP that does not divide it runs
    devices // TP instances, the rest idle); `kv`: auto |
    migrate | recompute; `warm(tp) -> bool` says whether that layout's executables are compiled.

    `min_gain` (beyond the paper; 0 = Algorithm 1 exactly): switch only when the best candidate's total
    (remaining + switch) is below (1 − min_gain) x the current layout's remaining time. Where two layouts
    predict within a few percent of each other the paper's rule switches back and forth as sequences finish
    (the cluster simulator shows ~10 switches a step on 8 x A40 between TP4x2 and TP8); a margin keeps the
    layout unless the gain is worth having."""

    def __init__(self, predictor: Predictor, candidates: Seq[int], devices: int, *, kv: str = "auto",
                 min_gain: float = 0.0):
        if kv not in KV_CHOICES:
            raise ValueError(f"kv={kv!r}; valid choices: {', '.join(KV_CHOICES)}")
        if not 0.0 <= min_gain < 1.0:
            raise ValueError(f"min_gain={min_gain} must be in [0, 1)")
        self.min_gain = float(min_gain)
        missing = [t for t in candidates if t not in predictor.layouts]
        if missing:
            raise ValueError(f"candidate TP {missing} not in the profile (it has {predictor.layouts}): re-profile")
        bad = [t for t in candidates if devices % t]
        if bad:
            raise ValueError(f"candidate TP {bad} does not divide the {devices} rollout devices")
        self.predictor, self.candidates, self.devices, self.kv = predictor, sorted(candidates), devices, kv

    def switch_cost(self, src: int, dst: int, live: Seq[Live], *, warm: bool, classes: Classes | None = None
                    ) -> Candidate:
        pred, prof = self.predictor, self.predictor.profile
        n = self.devices // dst
        src_groups = by_group(live)
        moved = merge_and_redistribute(live, n, classes=classes)
        solo = merge_and_redistribute(live, n, keep_shared=False, classes=classes)
        move, nbytes = pred.move_seconds(src, src_groups)
        recomp = pred.recompute_seconds(dst, solo) if dst in pred._prefill else math.inf
        kv = self.kv if self.kv != "auto" else ("migrate" if move <= recomp else "recompute")
        state = move if kv == "migrate" else recomp
        reshard = pred.reshard_seconds(src, dst)
        compile_s = 0.0 if warm else prof.layouts[dst].compile_seconds
        dst_groups = moved if kv == "migrate" else solo
        return Candidate(dst, pred.remaining_time(dst, dst_groups), state + reshard + compile_s + prof.control_seconds,
                         kv, move, recomp, reshard, compile_s, prof.control_seconds, nbytes)

    def decide(self, current: int, live: Seq[Live], *, step: int = 0, warm=lambda tp: True,
               classes: Classes | None = None) -> SwitchDecision:
        """Algorithm 1; `classes`: StreamRL's tagged classes, which a switch keeps (each candidate dealt so)."""
        pred = self.predictor
        t_cur = pred.remaining_time(current, by_group(live))
        cands, best, best_t = [], current, math.inf
        for tp in self.candidates:
            if tp == current:
                c = Candidate(tp, t_cur, 0.0)
            else:
                c = self.switch_cost(current, tp, live, warm=warm(tp), classes=classes)
            cands.append(c)
            if c.total_s < best_t:
                best, best_t = tp, c.total_s
        if not (best != current and t_cur * (1.0 - self.min_gain) > best_t):
            best = current
        kv = next((c.kv for c in cands if c.tp == best), "") if best != current else ""
        return SwitchDecision(step, current, len(live), int(sum(x.context for x in live)), t_cur, cands, best, kv)
