"""RollPacker's stream trainer, its decision (arXiv 2509.21009 §4.4, Algorithm 1, lines 14-20): when to
check, which devices to free, whether the live requests fit the rest, and the move. Pure functions of the
service's state, shared by the stream trainer (`jaxrl.train.stream`) and the cluster simulator
(`jaxrl.sim.run`).

**When (Algorithm 1, line 14).** `milestone_due`: once start <= finished/total <= stop (20%..50%) and
another `step` (5%) of the requests finished since the last check. At most one shrink per step.

**Which devices (the paper's "half of the rollout GPUs, TP groups intact").** `freed_instances`: the
trailing instances that hold exactly half the rollout devices (instance 0 always stays); none such ->
the attempt is aborted. The set is fixed by the layout, so `warm()` compiles one sub-mesh's executables
(the paper does not say which half; picking the least-loaded instances would need one compiled set per
choice).

**Whether (line 17: the projected peak KV).** `projected_lengths` gives each live request's final
length: "history" (the paper's "historical response length distributions"): a request that has
generated g tokens ends at the `quantile` of the recorded response lengths longer than g, capped at its
max_new_tokens (none longer -> the cap); "max": every request runs to its cap (a bound). `peak_pages`
turns final lengths into the peak of live pages over the remaining decode steps (usage grows by one
token per live request per step and drops when a request ends, so it peaks just before some request
ends). `plan_shrink` accepts when the peak of all live requests fits in `kv_fraction` of the whole pool's
pages and, after assigning the freed instances' requests to the remaining ones (largest first, to the
one least filled), each remaining instance's own peak fits its pages. Recomputed requests do not share
prompt pages, and none are counted as shared.

**How (line 20).** pause, detach the freed instances' live requests, attach them to their assigned
instances with kv="recompute" (tokens kept, KV re-prefilled; sampling continues on each request's own
RNG stream, so the tokens are those of a run without the shrink).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl.config.stream import StreamSection

def milestone_due(finished: int, total: int, last: int, *, start: float, stop: float, step: float) -> bool:
    """Algorithm 1, line 14: start <= |R_comp|/|R| <= stop and ΔR/|R| >= step, where ΔR counts the requests
    finished since the last check (`last` = finished then; 0 before the first)."""
    if total <= 0:
        return False
    eps = 1e-9 * total
    return start * total - eps <= finished <= stop * total + eps and finished - last >= step * total - eps


def freed_instances(tps: Sequence[int]) -> tuple[int, ...] | None:
    """The trailing instances holding exactly half of the rollout devices (each instance whole; instance 0
    always stays), or None when no such set exists."""
    half, acc = sum(tps) / 2, 0
    for k in range(len(tps) - 1, 0, -1):
        acc += tps[k]
        if acc == half:
            return tuple(range(k, len(tps)))
        if acc > half:
            break
    return None


def projected_lengths(rows: Sequence[dict], history: Sequence[int] = (), *, projection: str = "history",
                      quantile: float = 0.9) -> np.ndarray:
    """Final context length (prompt + response) of each live request, `svc.sequence_stats()` rows.

    "max": prompt + max_new_tokens. "history": prompt + the `quantile` of the recorded response lengths
    longer than the request's generated count (rounded up), at least one more token and at most
    max_new_tokens; with no longer recorded length, max_new_tokens."""
    prompt = np.asarray([r["prompt_len"] for r in rows], np.int64)
    gen = np.asarray([r["generated"] for r in rows], np.int64)
    cap = np.asarray([r["max_new_tokens"] for r in rows], np.int64)
    if projection == "max" or not len(history):
        return prompt + cap
    h = np.sort(np.asarray(history, np.int64))
    resp = cap.copy()
    for i, g in enumerate(gen):
        longer = h[np.searchsorted(h, g, side="right"):]
        if longer.size:
            resp[i] = int(np.ceil(np.quantile(longer, quantile)))
    return prompt + np.clip(resp, np.minimum(gen + 1, cap), cap)


def peak_pages(context, final, page_size: int) -> int:
    """Peak KV pages of requests now at `context` tokens that each grow by one token per decode step until
    `final`, freeing their pages then: max over steps t of Σ_{live at t} ceil((context + t) / page_size).
    Usage only grows between two ends, so the candidates are the steps at which some request ends."""
    c = np.asarray(context, np.int64)
    if c.size == 0:
        return 0
    left = np.maximum(np.asarray(final, np.int64), c) - c          # steps each request has left
    ends = np.unique(left)
    pages = -(-(c[:, None] + ends[None, :]) // page_size)
    return int(np.max(np.sum(pages * (ends[None, :] <= left[:, None]), axis=0)))


@dataclasses.dataclass
class ShrinkPlan:
    """One milestone's decision. `ok`: shrink now; else `reason` says why not."""

    ok: bool
    reason: str = ""
    freed: tuple[int, ...] = ()                          # instances that stop generating
    moves: dict[int, list[int]] = dataclasses.field(default_factory=dict)   # remaining instance -> request ids
    peak_pages: int = 0                                  # projected peak of every live request
    budget_pages: int = 0                                # kv_fraction x the whole pool's pages


def plan_shrink(rows: Sequence[dict], final: np.ndarray, instances: Sequence[tuple[int, int, int]], *,
                page_size: int, kv_fraction: float, classes: dict[int, str] | None = None) -> ShrinkPlan:
    """Algorithm 1, lines 16-17. `rows`: live requests (`svc.sequence_stats()`), `final` their projected
    final lengths, `instances`: (index, tp, pages) of every instance in order. `classes` (StreamRL's skew
    placement: instance -> "long" / "regular"): a moved request goes to a kept instance of its own
    instance's class when one is kept. See the module docstring."""
    tps = [tp for _, tp, _ in instances]
    freed = freed_instances(tps)
    if freed is None:
        return ShrinkPlan(False, f"no trailing instances hold half of the rollout devices (instance tp {tps})")
    idx = [i for i, _, _ in instances]
    freed = tuple(idx[k] for k in freed)
    ctx = np.asarray([r["context_len"] for r in rows], np.int64)
    final = np.asarray(final, np.int64)
    peak = peak_pages(ctx, final, page_size)
    budget = int(kv_fraction * sum(p for _, _, p in instances))
    plan = ShrinkPlan(False, freed=freed, peak_pages=peak, budget_pages=budget)
    if peak > budget:
        plan.reason = f"projected peak {peak} pages > {budget} (kv_fraction {kv_fraction} of the pool)"
        return plan
    cap = {i: p for i, _, p in instances if i not in freed}
    members = {i: [k for k, r in enumerate(rows) if r["instance"] == i] for i in cap}
    load = {i: sum(-(-final[k] // page_size) for k in members[i]) for i in cap}
    moved = sorted((k for k, r in enumerate(rows) if r["instance"] in freed), key=lambda k: -final[k])
    for k in moved:
        own = [i for i in cap if classes and classes.get(i) == classes.get(rows[k]["instance"])]
        target = min(own or cap, key=lambda i: (load[i] / cap[i], i))
        members[target].append(k)
        load[target] += -(-final[k] // page_size)
        plan.moves.setdefault(target, []).append(rows[k]["request_id"])
    for i in cap:
        own = peak_pages(ctx[members[i]], final[members[i]], page_size)
        if own > cap[i]:
            plan.moves, plan.reason = {}, f"instance {i}: projected peak {own} pages > its {cap[i]}"
            return plan
    plan.ok = True
    return plan


def shrink_plan(svc, s: StreamSection, history: Sequence[int], classes: dict[int, str] | None = None) -> ShrinkPlan:
    """Lines 16-17 on a rollout service: its live requests' projected final lengths (`s.projection`) and
    `plan_shrink` over its instances' pools (moves within `classes`, when given)."""
    rows = svc.sequence_stats()
    final = projected_lengths(rows, history, projection=s.projection, quantile=s.quantile)
    return plan_shrink(rows, final, [(i.index, i.tp, i.pool.capacity) for i in svc.instances],
                       page_size=svc.instances[0].pool.page_size, kv_fraction=s.kv_fraction, classes=classes)


def kept_instances(svc) -> int:
    """How many leading instances a shrink never frees (all of them when no half can be freed)."""
    freed = freed_instances(list(svc.layout))
    return len(svc.layout) if freed is None else min(freed)


def take_shrink(svc, plan: ShrinkPlan) -> int:
    """Line 20: pause (tokens in flight land; requests they finished come out of the next step), then move
    the freed instances' live requests to their assigned instances with kv="recompute". Returns how many
    moved."""
    svc.pause()
    live = {rid for k in plan.freed for rid in svc.instances[k].live_rids()}
    moved = 0
    for target, rids in plan.moves.items():
        rids = [r for r in rids if r in live]
        if rids:
            svc.attach(svc.detach(rids), instance=target, kv="recompute")
        moved += len(rids)
    return moved
