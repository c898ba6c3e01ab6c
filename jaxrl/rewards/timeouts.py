"""Adaptive per-test-case timeouts for code rewards (RollPacker §4.3).

    policy = AdaptiveTimeouts(lam=1.5, t_min=2.0, t_max=30.0)
    t = policy.timeout_for("a3f9…:0")              # 30.0: no correct run seen for this case yet
    policy.observe("a3f9…:0", seconds=0.4, correct=True)
    policy.timeout_for("a3f9…:0")                  # min(max(2.0, 1.5 * 0.4), 30.0) = 2.0
    ckpt["reward_timeouts"] = policy.state_dict()  # plain JSON; load_state_dict(...) on resume

T_timeout = min(max(T_min, λ · T_anchor), T_max) (RollPacker §4.3), where T_anchor is the longest run
time among the *correct* responses seen so far for that test case. A case with no correct response yet
has no anchor and gets T_max: a fixed-timeout run is this policy before its first correct answer, and
`enabled=False` keeps it there (every case T_max). Runs that fail (wrong, timed out, crashed) never
move an anchor, so one hung program cannot inflate the budget of later ones; λ > 1 leaves slack for
CPU contention. A case key is any string; `jaxrl.rewards.code.case_key` derives one per (test set,
case index), so anchors follow a test case across steps and epochs.

Simplified relative to the paper: anchors only grow (the paper does not say whether they decay); there
is no bound on how many cases are tracked (one float per distinct test case seen).
"""

from __future__ import annotations

import math
from typing import Mapping


class AdaptiveTimeouts:
    """Per-test-case timeout policy; see the module docstring."""

    def __init__(self, lam: float = 1.5, t_min: float = 2.0, t_max: float = 30.0, *, enabled: bool = True):
        if not lam > 0:
            raise ValueError(f"lam={lam} must be > 0")
        if not 0 < t_min <= t_max:
            raise ValueError(f"need 0 < t_min <= t_max, got t_min={t_min}, t_max={t_max}")
        self.lam, self.t_min, self.t_max, self.enabled = float(lam), float(t_min), float(t_max), bool(enabled)
        self.anchors: dict[str, float] = {}

    @classmethod
    def from_config(cls, section) -> AdaptiveTimeouts:
        """A fresh policy from a `jaxrl.config.rewards.AdaptiveTimeoutSection` (anchors come from the checkpoint)."""
        return cls(section.lam, section.t_min, section.t_max, enabled=section.enabled)

    def timeout_for(self, case: str) -> float:
        """min(max(t_min, lam * anchor), t_max); t_max without an anchor (or when disabled)."""
        anchor = self.anchors.get(case)
        if not self.enabled or anchor is None:
            return self.t_max
        return min(max(self.t_min, self.lam * anchor), self.t_max)

    def observe(self, case: str, seconds: float, correct: bool) -> None:
        """Record one run of `case`: a correct one lifts the anchor to `seconds` if it ran longer."""
        if correct and math.isfinite(seconds) and seconds >= 0:
            self.anchors[case] = max(self.anchors.get(case, 0.0), float(seconds))

    def __len__(self) -> int:
        return len(self.anchors)

    def state_dict(self) -> dict:
        """Plain JSON-able state: the anchors (the parameters come from the config, and are kept only to
        be reported)."""
        return {"anchors": dict(self.anchors), "lam": self.lam, "t_min": self.t_min, "t_max": self.t_max}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore the anchors of `state_dict()`; this policy's own lam/t_min/t_max stay (a resumed run
        may change them in its config)."""
        anchors = state.get("anchors")
        if not isinstance(anchors, Mapping):
            raise ValueError(f"timeout state without an 'anchors' mapping: {sorted(state)}")
        self.anchors = {str(k): float(v) for k, v in anchors.items()}

    def __repr__(self) -> str:
        return (f"AdaptiveTimeouts(lam={self.lam}, t_min={self.t_min}, t_max={self.t_max}, "
                f"enabled={self.enabled}, anchors={len(self.anchors)})")
