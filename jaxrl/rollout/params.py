"""Per-request sampling parameters: a plain value with no JAX in it, so the host scheduler (pure Python)
and the on-device sampler share one definition."""

from __future__ import annotations

import dataclasses
import hashlib


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    n: int = 1                        # samples per prompt (share the prompt's KV pages)
    return_kv: bool = False           # attach the sequence's KV cache to the completion
    # multi-turn: token sequences that end a turn, not the trajectory. The sequence pauses holding its KV
    # (finish_reason "turn") until `RolloutService.add_tokens` appends an observation and resumes it.
    turn_stops: tuple[tuple[int, ...], ...] = ()
    turn_max_tokens: int = 0          # a turn also ends after this many sampled tokens (0: no per-turn limit)

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an int >= 1")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stops = tuple(tuple(int(t) for t in stop) for stop in self.turn_stops)
        if any(not stop for stop in stops):
            raise ValueError(f"turn_stops={self.turn_stops!r}: each turn stop is a non-empty token sequence")
        object.__setattr__(self, "turn_stops", stops)
        if not isinstance(self.turn_max_tokens, int) or self.turn_max_tokens < 0:
            raise ValueError(f"turn_max_tokens={self.turn_max_tokens!r} must be an int >= 0 (0: no limit)")

    @property
    def multi_turn(self) -> bool:
        return bool(self.turn_stops or self.turn_max_tokens)

    def ends_turn(self, out, since: int) -> bool:
        """Whether the turn whose samples start at index `since` of `out` (after the last observation) is over:
        `out` ends with a turn stop sampled in it, or it has `turn_max_tokens` samples."""
        n = len(out) - since
        return (0 < self.turn_max_tokens <= n
                or any(n >= len(stop) and tuple(out[len(out) - len(stop):]) == stop for stop in self.turn_stops))

    @classmethod
    def from_config(cls, section, *, stop_token_ids=(), seed: int | None = None, n: int | None = None,
                    return_kv: bool = False) -> SamplingParams:
        """One request's parameters from a `jaxrl.config.generate.SamplingSection` (`seed`/`n` override the
        section's; `return_kv` exports each completion's K/V on the devices)."""
        return cls(max_new_tokens=section.max_new_tokens, temperature=section.temperature,
                   top_k=section.top_k or 0, top_p=section.top_p, n=section.n if n is None else n,
                   seed=section.seed if seed is None else seed, stop_token_ids=tuple(stop_token_ids),
                   return_kv=return_kv)


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt `index` in a run seeded `seed`: a hash of both (32 bits), so every prompt
    has its own stream, and a prompt's samples do not depend on the other prompts of the run."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(index)}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")
