"""Workloads of the simulator: per prompt, its length, its responses' lengths, rewards and reward run times.

    wl = Workload.parametric(prompts=4096, median=2931, p_above=((8192, 0.11), (16384, 0.02)), seed=0)
    wl = Workload.from_jsonl("trace.jsonl")            # {"prompt_len": 120, "lengths": [...], "rewards": [...]}
    wl = Workload.from_run("runs/quickstart")          # a run's length_pairs.jsonl (its prompts' lengths)
    wl.lengths(index, n)   # response lengths of samples 0..n-1 of prompt `index` (tokens, stop token included)

Every value is a deterministic function of (seed, prompt index, sample index), so two simulations of the
same workload see the same responses whatever mechanisms they run and in whatever order they draw them
(tail batching re-draws a deferred prompt in a later long round: its samples are the same ones).

**Parametric long tail.** log(length) = μ + σ·(√ρ·z_prompt + √(1−ρ)·z_sample), capped at `max_new_tokens`:
lognormal, with a per-prompt factor z_prompt (a hard prompt's responses are all long; ρ = `prompt_share` of
the variance, default 0.5) and per-sample noise. (μ, σ) are solved from the median and one exceedance
fraction P(length > x): σ = ln(x / median) / Φ⁻¹(1 − p). The DeepScaleR-like preset of the simulator issue
(median ~3K tokens, ~11% above 8K, ~2% above 16K) is `median=2931, p_above=((8192, 0.11),)`, whose σ = 0.838
also gives P(> 16K) = 2.0%. Rewards: each prompt has a pass rate drawn from Beta(a, b) (default (1, 1)), each
sample passes with it (1.0) or not (0.0).

`cap_fraction` of responses run to max_new_tokens whatever their draw (the truncated repetition loops of
RL rollouts, which a lognormal's tail does not produce).

**Reward run time.** `reward_s` per response (rule-based math: milliseconds); with `code=True` a share
`code_fraction` of the prompts are code tasks: a response's program runs lognormal(`code_median_s`,
`code_sigma`) seconds, and a fraction `hang` of responses never terminate (they run until their timeout;
RollPacker §4.3 reports ~5% of prompts hitting a 30 s timeout).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from math import lgamma
from pathlib import Path
from statistics import NormalDist

import numpy as np

from jaxrl.config.base import ConfigError


def _unit(*key) -> float:
    """A uniform number in (0, 1), a deterministic hash of `key`."""
    h = hashlib.blake2b(":".join(map(str, key)).encode(), digest_size=8).digest()
    return (int.from_bytes(h, "little") + 0.5) / 2.0 ** 64


def _normal(*key) -> float:
    return NormalDist().inv_cdf(_unit(*key))


@dataclasses.dataclass
class Trace:
    """One prompt of a recorded workload: its length and its samples' lengths (and rewards)."""

    prompt_len: int
    lengths: list[int]
    rewards: list[float] | None = None


@dataclasses.dataclass
class Workload:
    """See the module docstring. `prompts`: the dataset size (indices wrap around)."""

    prompts: int
    max_new_tokens: int
    prompt_len: int = 256
    median: float = 0.0
    sigma: float = 0.0
    prompt_share: float = 0.5
    pass_beta: tuple[float, float] = (1.0, 1.0)
    reward_s: float = 0.05
    code: bool = False
    code_fraction: float = 1.0            # with `code`: the share of prompts that are code tasks (the rest: reward_s)
    cap_fraction: float = 0.0             # responses that run to max_new_tokens whatever their draw (repetition loops)
    code_median_s: float = 0.3
    code_sigma: float = 1.0
    hang: float = 0.0
    seed: int = 0
    traces: list[Trace] | None = None
    name: str = "parametric"

    # ------------------------------------------------------------------ constructors
    @classmethod
    def parametric(cls, *, prompts: int, max_new_tokens: int, median: float, p_above=((8192, 0.11),),
                   sigma: float | None = None, **kw) -> "Workload":
        if median <= 0:
            raise ConfigError("workload.median", f"must be > 0, got {median}")
        if sigma is None:
            x, p = p_above[0]
            if not 0 < p < 0.5 or x <= median:
                raise ConfigError("workload.p_above", f"need a fraction in (0, 0.5) above a length over the median; "
                                                      f"got {p} above {x} (median {median})")
            sigma = math.log(x / median) / NormalDist().inv_cdf(1 - p)
        return cls(prompts=prompts, max_new_tokens=max_new_tokens, median=float(median), sigma=float(sigma),
                   name=f"lognormal(median {median:g}, sigma {sigma:.3f})", **kw)

    @classmethod
    def from_jsonl(cls, path: str | Path, *, max_new_tokens: int, **kw) -> "Workload":
        """Rows {"prompt_len": int, "lengths": [int, ...], "rewards": [float, ...] (optional)}."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError("workload.path", f"{path.absolute()}: no such file")
        traces = []
        for k, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                t = Trace(int(row["prompt_len"]), [int(n) for n in row["lengths"]],
                          None if row.get("rewards") is None else [float(r) for r in row["rewards"]])
                if not t.lengths or min(t.lengths) < 1 or t.prompt_len < 1:
                    raise ValueError("lengths and prompt_len must be >= 1")
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError("workload.path", f"{path.absolute()}:{k}: expected {{\"prompt_len\": n, "
                                  f"\"lengths\": [n, ...]}} ({type(e).__name__}: {e})") from None
            traces.append(t)
        if not traces:
            raise ConfigError("workload.path", f"{path.absolute()}: no rows")
        return cls(prompts=len(traces), max_new_tokens=max_new_tokens, traces=traces, name=f"trace {path.name}", **kw)

    @classmethod
    def from_run(cls, run_dir: str | Path, *, max_new_tokens: int, **kw) -> "Workload":
        """A training run's `length_pairs.jsonl` ({"tokens": [prompt ids], "length": mean response length} per
        trained prompt, written by StreamRL's skew step): each prompt's samples all take its mean length."""
        path = Path(run_dir) / "length_pairs.jsonl"
        if not path.is_file():
            raise ConfigError("workload.run", f"{path.absolute()}: no such file (runs write it with rollout.skew on)")
        traces = []
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                traces.append(Trace(len(row["tokens"]), [max(1, int(row["length"]))]))
        return cls(prompts=len(traces), max_new_tokens=max_new_tokens, traces=traces, name=f"run {path.parent.name}",
                   **kw)

    # ------------------------------------------------------------------ per prompt / sample
    def prompt_tokens(self, index: int) -> int:
        if self.traces is not None:
            return self.traces[index % len(self.traces)].prompt_len
        return self.prompt_len

    def length(self, index: int, sample: int) -> int:
        if self.traces is not None:
            t = self.traces[index % len(self.traces)]
            n = t.lengths[sample % len(t.lengths)]
        else:
            rho = self.prompt_share
            z = math.sqrt(rho) * _normal(self.seed, "p", index) + math.sqrt(1 - rho) * _normal(self.seed, "s", index, sample)
            n = int(round(self.median * math.exp(self.sigma * z)))
            if self.cap_fraction and _unit(self.seed, "cap", index, sample) < self.cap_fraction:
                n = self.max_new_tokens
        return int(min(max(n, 1), self.max_new_tokens))

    def lengths(self, index: int, n: int) -> list[int]:
        return [self.length(index, j) for j in range(n)]

    def reward(self, index: int, sample: int) -> float:
        if self.traces is not None and self.traces[index % len(self.traces)].rewards is not None:
            r = self.traces[index % len(self.traces)].rewards
            return r[sample % len(r)]
        a, b = self.pass_beta
        rate = _beta(_unit(self.seed, "rate", index), a, b)
        return float(_unit(self.seed, "pass", index, sample) < rate)

    def is_code(self, index: int) -> bool:
        return self.code and _unit(self.seed, "code", index) < self.code_fraction

    def reward_seconds(self, index: int, sample: int) -> float:
        """Run time of the response's reward; `math.inf` for a program that never terminates."""
        if not self.is_code(index):
            return self.reward_s
        if _unit(self.seed, "hang", index, sample) < self.hang:
            return math.inf
        return self.code_median_s * math.exp(self.code_sigma * _normal(self.seed, "run", index, sample))

    def summary(self, samples: int = 4096) -> dict:
        """Length statistics of the first `samples` responses (prompt-major, 8 per prompt)."""
        n = np.asarray([self.length(i // 8, i % 8) for i in range(samples)])
        return {"workload": self.name, "median": float(np.median(n)), "p90": float(np.percentile(n, 90)),
                "p99": float(np.percentile(n, 99)), "max": int(n.max()),
                "above_8k": float(np.mean(n > 8192)), "above_16k": float(np.mean(n > 16384))}


def _beta(u: float, a: float, b: float) -> float:
    """The u-quantile of Beta(a, b) by bisection (a, b > 0)."""
    if a == 1 and b == 1:
        return u

    def cdf(x, steps=200):
        # midpoint rule on the density; accurate enough for a pass rate
        xs = (np.arange(steps) + 0.5) / steps * x
        logc = lgamma(a + b) - lgamma(a) - lgamma(b)
        return float(np.sum(np.exp(logc + (a - 1) * np.log(xs) + (b - 1) * np.log1p(-xs))) * x / steps)

    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < u else (lo, mid)
    return (lo + hi) / 2
