"""Partial rollouts across weight versions (trainer.swap_step): the update of step n, running on the train pool
while generation runs ahead, enters the generation instances in the middle of the next rollout; the sequences
in flight continue on the new weights (`RolloutService.swap_weights`: their K/V kept, or recomputed with
trainer.swap_kv=recompute) and each token records the version that sampled it (`Completion.versions`), so the
trainer's off-policy objective weighs every token by its own behaviour policy.

    swap = MidRolloutSwap(svc, staged_future, version=n + 1, at_step=cfg.trainer.swap_step, kv="keep")
    svc.observers.append(swap.observe)      # counts the rollout's engine steps; swaps at the at_step-th
    ... the rollout ...
    swap.finish()                           # a rollout shorter than at_step steps: the swap at its end

The swap point is an engine-step count, not the moment the update finishes, so a run is reproducible (the
same tokens on a resume, and with any number of processes when every sequence starts together): the
generation waits at that step for the update if it is not done yet, and the wait is measured
(`async/gen_wait_s`). On real devices one picks at_step so the update is usually done by then (its time over
a decode step's). The weights are staged on the train pool's thread right after the update
(`RolloutService.stage`: with several processes, the one collective of the sync, in the same order on every
process), so the swap itself moves them within the process: no process waits on another mid-rollout, and
none samples with a half-updated model (the swap drains the step in flight first and replaces every
instance's weights before the next step).
"""

from __future__ import annotations

import concurrent.futures
import time


class MidRolloutSwap:
    def __init__(self, svc, staged: concurrent.futures.Future, *, version: int, at_step: int, kv: str):
        self.svc, self.staged, self.version, self.at_step, self.kv = svc, staged, version, at_step, kv
        self.steps = 0
        self.done = False
        self.wait_s = 0.0             # generation idle at the swap point, waiting for the update
        self.report: dict = {}
        self.swapped_at = -1          # the rollout's engine steps before the swap

    def observe(self, t0: float, t1: float) -> None:
        """A service observer: called after each engine step of the rollout."""
        self.steps += 1
        if self.steps == self.at_step and not self.done:
            self._swap()

    def finish(self) -> None:
        """After the rollout: the swap happens now if the rollout ended before its swap step."""
        if not self.done:
            self._swap()

    def _swap(self) -> None:
        t = time.perf_counter()
        staged = self.staged.result()
        self.wait_s = time.perf_counter() - t
        self.report = self.svc.swap_weights(staged.weights, self.version, kv=self.kv, staged=staged)
        self.done, self.swapped_at = True, self.steps

    def metrics(self) -> dict:
        return {"async/gen_wait_s": self.wait_s, "async/swap_step": self.swapped_at,
                "async/swapped_sequences": self.report.get("sequences", 0),
                "async/recomputed_positions": self.report.get("recomputed", 0)}
