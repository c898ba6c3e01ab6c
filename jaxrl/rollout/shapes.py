"""The bounded set of shapes a rollout instance compiles: decode, prefill and page-copy buckets.

Every compiled step is specialised to its input shapes, so every distinct (batch rows, page-table width,
prefill width) is one XLA compilation (about a second each on the 2-core CPU even for the tiny model).
`ShapeBuckets` fixes the set up front from the engine's limits: the scheduler rounds every step up to a
member, `Executor.warm_all` compiles each member once at start, and a long-tailed run compiles nothing
afterwards (tests/test_bounded_shapes.py).

  decode   (rows, pages)         rows from `batch` (powers of two below 8, then `per_octave` steps per
                                 octave up to max_batch); pages from `pages` (up to `page_buckets` widths
                                 max_pages/2^i, none below MIN_PAGES). The XLA decode path gathers every
                                 page slot of every row, so a narrower table is faster while sequences
                                 are short: a service left at max_seq_len 1024 (64 pages) that decodes
                                 12-page sequences ran 432 / 440 tok/s at batch 16 / 64 with widths
                                 {64, 32} and 590 / 696 with {64, 32, 16, 8} (scripts/bench_rollout.py).
  prefill  (rows, width, pages)  widths chunk/4^i (>= 16), rows powers of four up to what the token budget
                                 allows, pages from the same ladder (>= the chunk's own pages).
  copies   (n,)                  copy-on-write page copies padded to powers of two.

`coarse=True` (a cold start's first rollout, `trainer.background_compile`): every step rounds up to the cover
of its kind instead, decode to (max_batch, max_pages) and prefill to (the width's rows cap, width, max_pages),
so a run starts after compiling `cover_decode_shapes()` + `cover_prefill_shapes()` (1 + one per chunk width)
while the exact buckets compile in the background; `exact()` switches back. A row's float32 log-probs depend
on its bucket by rounding (~1e-6: another batch size or table width changes XLA:CPU's summation order), so a
sampled token could too (a near-tie; none seen in tests/test_bounded_shapes.py): a run rounds up to the
cover at a fixed step (its first rollout), never "while the exact one is not ready", so it stays reproducible.

Measured (decode step time vs rows, tiny-char and the 3.2M shape on the CPU; decoded rows per generated
token on a geometric-length tail, see README "Throughput"): powers of two pad a shrinking batch by
~1.3x in rows; 2 steps per octave ~1.1-1.2x; 4 steps ~1.04-1.09x at twice the executables.
Prefill is padded more coarsely (x4 ladders): it is one call per admission, a small share of the work.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left


def ladder(top: int, per_octave: int = 1, *, fine_from: int = 8) -> tuple[int, ...]:
    """1, 2, 4, ... below `fine_from`, then `per_octave` evenly spaced values per octave, up to and
    including `top` (which is always a member)."""
    if top < 1 or per_octave < 1:
        raise ValueError(f"ladder needs top >= 1 and per_octave >= 1, got {top}, {per_octave}")
    out, b = {top}, 1
    while b < top:
        steps = per_octave if b >= max(fine_from, per_octave) else 1
        out.update(v for k in range(steps) if (v := b + k * (b // steps)) < top)
        b *= 2
    return tuple(sorted(out))


def up(values: tuple[int, ...], n: int) -> int:
    """The smallest member >= n (ValueError when n is beyond the set: a bug in whoever asked)."""
    i = bisect_left(values, n)
    if i == len(values):
        raise ValueError(f"{n} exceeds the largest bucket {values[-1]}")
    return values[i]


def down(values: tuple[int, ...], n: int) -> int:
    """The largest member <= n (the smallest member when none is)."""
    i = bisect_left(values, n + 1)
    return values[max(i - 1, 0)]


@dataclasses.dataclass(frozen=True)
class ShapeBuckets:
    batch: tuple[int, ...]             # decode rows
    pages: tuple[int, ...]             # page-table widths (decode and prefill)
    widths: tuple[int, ...]            # prefill chunk widths
    prefill_rows: tuple[int, ...]      # prefill rows
    prefill_tokens: int                # rows * width of one prefill call at most
    page_size: int
    coarse: bool = False               # round every step up to the cover of its kind

    MIN_PAGES = 4                      # narrower tables save little and cost executables

    @classmethod
    def build(cls, *, max_batch: int, max_seq_len: int, page_size: int, prefill_chunk: int = 256,
              prefill_tokens: int = 8192, per_octave: int = 2, page_buckets: int = 4) -> "ShapeBuckets":
        max_pages = -(-max_seq_len // page_size)
        pages = {max_pages} if max_pages <= 8 else \
            {max_pages} | {w for i in range(1, page_buckets) if (w := -(-max_pages // 2 ** i)) >= cls.MIN_PAGES}
        top = min(prefill_chunk, 1 << max(0, (max_seq_len - 2).bit_length()))   # no chunk exceeds len - 1
        widths = {top} | {top >> (2 * i) for i in range(1, 8) if top >> (2 * i) >= 16}
        rows = {4 ** i for i in range(12) if 4 ** i < max_batch} | {max_batch}
        return cls(ladder(max_batch, per_octave), tuple(sorted(pages)), tuple(sorted(widths)), tuple(sorted(rows)),
                   max(prefill_tokens, top), page_size)

    @property
    def max_pages(self) -> int:
        return self.pages[-1]

    def decode(self, rows: int, pages: int) -> tuple[int, int]:
        rows, pages = up(self.batch, rows), up(self.pages, pages)        # (checks the limits in both modes)
        return (self.batch[-1], self.max_pages) if self.coarse else (rows, pages)

    def prefill_width(self, longest: int) -> int:
        """The chunk width for a call whose longest remaining prompt part is `longest` tokens."""
        return up(self.widths, min(longest, self.widths[-1]))

    def prefill_rows_cap(self, width: int) -> int:
        """Most rows one prefill call of `width` takes (a bucket member, within the token budget)."""
        return down(self.prefill_rows, max(1, self.prefill_tokens // width))

    def prefill(self, rows: int, width: int, pages: int) -> tuple[int, int, int]:
        rows, pages = up(self.prefill_rows, rows), up(self.pages, pages)
        return (self.prefill_rows_cap(width), width, self.max_pages) if self.coarse else (rows, width, pages)

    def decode_shapes(self) -> list[tuple[int, int]]:
        return [(r, p) for r in self.batch for p in self.pages]

    def prefill_shapes(self) -> list[tuple[int, int, int]]:
        """Every (rows, width, pages) a prefill call can have: rows up to the width's cap; pages from those
        of the shortest chunk the width is picked for (> the next smaller width) up to the largest (a
        chunk deep into a long sequence)."""
        out = []
        for i, w in enumerate(self.widths):
            least = up(self.pages, -(-(self.widths[i - 1] + 1) // self.page_size) if i else 1)
            out += [(r, w, p) for r in self.prefill_rows if r <= self.prefill_rows_cap(w)
                    for p in self.pages if p >= least]
        return out

    def cover_decode_shapes(self) -> list[tuple[int, int]]:
        """The one decode shape a coarse step runs: the largest of both ladders."""
        return [(self.batch[-1], self.max_pages)]

    def cover_prefill_shapes(self) -> list[tuple[int, int, int]]:
        """The prefill shapes a coarse step runs: per chunk width, its rows cap over the widest table."""
        return [(self.prefill_rows_cap(w), w, self.max_pages) for w in self.widths]

    def exact(self) -> "ShapeBuckets":
        return dataclasses.replace(self, coarse=False)

    def copy_shapes(self, max_copies: int) -> list[int]:
        return list(ladder(1 << max(0, (max_copies - 1).bit_length())))

    def count(self) -> dict:
        return {"decode": len(self.decode_shapes()), "prefill": len(self.prefill_shapes())}


def fine_bucket(n: int) -> int:
    """Round up to a multiple of 2^(bits(n)-3): at most 25% padding, 4 shapes per octave (KV moves)."""
    step = 1 << max(0, n.bit_length() - 3)
    return -(-max(n, 1) // step) * step


def copy_bucket(n: int) -> int:
    """Page-copy vectors: powers of two (a cheap executable each, log2(max_batch) of them)."""
    return 1 << max(0, (n - 1).bit_length())
