"""Partial responses carried from a short round into the long round that resumes their prompt (slime's
partial rollouts on RollPacker's long-prompt queue; `rollout.tail_batching.carry_partial`).

A short round (`tail_batching`) aborts every response of the prompts it does not keep, and RollPacker
restarts those prompts from their first token in a long round: the tokens decoded so far are thrown away
(`tail/wasted_tokens`). slime keeps them instead (`--partial-rollout`: the unfinished samples go back to
the data buffer and continue in a later rollout). With `carry_partial`, each deferred prompt keeps R0 of
its responses as they stood when the round ended (`select`): the finished ones first (shortest first, the
race's order), then the unfinished ones with the most tokens (then the lower sample index). Each keeps its
tokens, their sampling log-probs and the weights version that sampled each token (`Partial`). The long round
continues the unfinished ones on the weights it runs with: prompt + tokens are prefilled again (the round's
instances hold no pages for them) and sampling goes on at position len(tokens) with the response's own seed
(`RolloutService.resume`); a finished one is trained as it is. So one race serves two configurations:
RollPacker's (`carry_partial=false`, η_r = 1.25) and slime's (`carry_partial=true`, η_r = 1: n responses per
prompt, prompts over-sampled by η_p, the slowest aborted and carried).

Staleness: a carried token is as old as the round that sampled it, so it may be older than k =
`trainer.max_staleness` versions (with k = 0, every carried token is). `apply_staleness` applies the rule at
the round that resumes it (the rollout of step m): a response whose oldest token's version v has m − v > k is
  * dropped (`trainer.stale_samples=drop`): its tokens are discarded and the slot is generated afresh, as
    RollPacker would (counted as `async/dropped_samples`);
  * or kept (`correct`): its tokens train with their own sampling log-probs as the behaviour policy
    (decoupled PPO's importance weight π_prox/π_behav; `jaxrl.algos.offpolicy`), counted as
    `async/corrected_samples`.

Simplified relative to slime: the carried prompts resume in RollPacker's long round (once the queue holds P0
prompts), not in the very next rollout; and their K/V are always recomputed (a swap mid-rollout may keep
K/V, `RolloutService.swap_weights`; a carried response has none left to keep).

Several processes: the queue is global (`TailBatcher.settle` gathers it), so each deferred prompt's partials
are packed into fixed-shape arrays (`pack`), gathered with the queue and unpacked on every process
(`unpack`): the process that deals the prompt in the long round need not be the one that sampled it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl.config.train import STALE_RULES       # trainer.stale_samples

from .instance import Completion


@dataclasses.dataclass(frozen=True)
class Partial:
    """One carried response: its sample index in the round that launched it (its seed's), its tokens, their
    sampling log-probs and the weights version that sampled each; `finished` is the finish reason of a
    finished response ("stop" or "length"), "" for one the round aborted."""

    sample: int
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finished: str = ""

    def __post_init__(self):
        if not len(self.tokens) == len(self.logprobs) == len(self.versions):
            raise ValueError(f"a partial response has {len(self.tokens)} tokens, {len(self.logprobs)} log-probs "
                             f"and {len(self.versions)} versions")

    @classmethod
    def of(cls, sample: int, completion, default_version: int) -> Partial:
        """From an engine `Completion` (finished, or the partial one `abort` returns)."""
        fin = completion.finish_reason if completion.finish_reason in ("stop", "length") else ""
        return cls(int(sample), tuple(int(t) for t in completion.tokens),
                   tuple(float(x) for x in completion.logprobs),
                   tuple(int(v) for v in completion.token_versions(default_version)), fin)

    def spans(self) -> list[tuple[int, int]]:
        """`versions` as run-length spans (first token index, version): `Completion.versions`' form."""
        return [(i, v) for i, v in enumerate(self.versions) if i == 0 or self.versions[i - 1] != v]


def select(responses: dict[int, Partial], keep: int) -> list[Partial]:
    """The `keep` responses of a deferred prompt to carry (sample index -> Partial): finished ones first,
    shortest first, then unfinished ones with the most tokens; ties by the lower sample index."""
    done = sorted((len(p.tokens), j) for j, p in responses.items() if p.finished)
    live = sorted((-len(p.tokens), j) for j, p in responses.items() if not p.finished)
    return [responses[j] for _, j in (done + live)[:keep]]


def apply_staleness(carried: Sequence[Partial], step: int, max_staleness: int, rule: str
                    ) -> tuple[list[Partial], dict]:
    """The carried responses the rollout of `step` resumes, after the staleness rule (module docstring):
    with "drop" those whose oldest token is more than `max_staleness` versions behind `step` are left out
    (their slots generate afresh); with "correct" all are kept. Returns (kept, {"dropped", "corrected"})."""
    if rule not in STALE_RULES:
        raise ValueError(f"stale_samples={rule!r}; valid choices: {', '.join(STALE_RULES)}")
    stale = [p for p in carried if p.versions and step - min(p.versions) > max_staleness]
    if rule == "drop":
        return [p for p in carried if p not in stale], {"dropped": len(stale), "corrected": 0}
    return list(carried), {"dropped": 0, "corrected": len(stale)}


# packed layout of one prompt's partials: rows = `keep` responses; int columns [sample, length, finished code,
# tokens..., versions...] (-1 sample: an empty row), float columns [log-probs...]
_FINISHED = {"": 0, "stop": 1, "length": 2}
_REASON = {v: k for k, v in _FINISHED.items()}


def pack(partials: Sequence[Partial], keep: int, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """One prompt's partials as (int64 [keep, 3 + 2·max_tokens], float64 [keep, max_tokens]) arrays."""
    ints = np.zeros((keep, 3 + 2 * max_tokens), np.int64)
    ints[:, 0] = -1
    floats = np.zeros((keep, max_tokens), np.float64)
    for r, p in enumerate(partials):
        n = len(p.tokens)
        if n > max_tokens:
            raise ValueError(f"a partial response of {n} tokens > max_tokens={max_tokens}")
        ints[r, :3] = p.sample, n, _FINISHED[p.finished]
        ints[r, 3:3 + n] = p.tokens
        ints[r, 3 + max_tokens:3 + max_tokens + n] = p.versions
        floats[r, :n] = p.logprobs
    return ints, floats


def unpack(ints: np.ndarray, floats: np.ndarray) -> list[Partial]:
    """`pack`'s inverse (empty rows left out)."""
    max_tokens = floats.shape[1]
    out = []
    for row, lp in zip(np.asarray(ints), np.asarray(floats)):
        if row[0] < 0:
            continue
        n = int(row[1])
        out.append(Partial(int(row[0]), tuple(int(t) for t in row[3:3 + n]), tuple(float(x) for x in lp[:n]),
                           tuple(int(v) for v in row[3 + max_tokens:3 + max_tokens + n]), _REASON[int(row[2])]))
    return out


def to_state(partials: Sequence[Partial]) -> list[dict]:
    """JSON-able (the checkpoint's tail state)."""
    return [dataclasses.asdict(p) for p in partials]


def from_state(rows: Sequence[dict]) -> list[Partial]:
    return [Partial(int(r["sample"]), tuple(int(t) for t in r["tokens"]), tuple(float(x) for x in r["logprobs"]),
                    tuple(int(v) for v in r["versions"]), str(r["finished"])) for r in rows]


def sample_seed(request_seed: int, sample: int) -> int:
    """Sample j's seed within a request of `n` samples (`RolloutService.add`'s rule)."""
    return (request_seed * 1_000_003 + sample) % 2**32


def resume_group(svc, prompt, params, partials: Sequence[Partial], old_seed: int, *, instance=None,
                 priority: float = 0.0) -> tuple[list[int | None], dict]:
    """Submit one prompt's `params.n` responses of a long round with its carried `partials`: the first slots
    continue them (an unfinished one resumes in the engine with its seed from `old_seed`, the request seed of
    the round that sampled it; a finished one needs no engine), the rest are new samples (`svc.add` with the
    round's own seed). Returns (request id per slot, None for a finished one; {slot: Completion} of the
    finished ones, stamped with their versions)."""
    if len(partials) > params.n:
        raise ValueError(f"{len(partials)} carried responses for a group of {params.n}")
    rids: list[int | None] = []
    done = {}
    for slot, p in enumerate(partials):
        if p.finished:
            rids.append(None)
            done[slot] = Completion(-1, list(prompt), list(p.tokens), list(p.logprobs), p.finished, -1,
                                    versions=p.spans())
        else:
            rids.append(svc.resume(prompt, params, seed=sample_seed(old_seed, p.sample), tokens=p.tokens,
                                   logprobs=p.logprobs, versions=p.spans(), instance=instance, priority=priority))
    fresh = params.n - len(partials)
    if fresh:
        rids += svc.add(prompt, dataclasses.replace(params, n=fresh), instance=instance, priority=priority)
    return rids, done


def carry_from_round(comps, aborted: dict, prompts: Sequence[int], keep: int, default_version: int) -> dict:
    """The partials each of `prompts` (local indices, deferred) carries: from its finished completions
    (`comps[p][j]`) and the partial ones its aborts returned (`aborted[p, j]`), `select`ed (a response with no
    token yet carries nothing)."""
    out = {}
    for p in prompts:
        got = {j: c for j, c in enumerate(comps[p]) if c is not None}
        got.update({j: c for (q, j), c in aborted.items() if q == p and j not in got})
        parts = {j: Partial.of(j, c, default_version) for j, c in got.items() if c.tokens}
        out[p] = select(parts, keep)
    return out
