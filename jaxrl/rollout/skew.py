"""StreamRL's skew-aware scheduling (paper §5.3, Algorithm 2, LPT): decisions only, no devices.

    long, regular = split_long(predicted, alpha=0.2)              # top α of a step's prompts by predicted length
    plan = plan_placement(predicted, instances=4, group_size=8, cap=16, ptl=ptl, lengths=recent)
    svc.set_batch_caps(plan.caps)
    for p in range(len(prompts)):
        svc.add(prompts[p], params, instance=plan.instance[p], priority=plan.priority[p])   # LPT inside
    svc.adaptive.classes = Classes.from_placement(plan)         # PAT's switches keep the classes (`Classes`)

**Classification.** The prompts are sorted by predicted length (descending; ties by index) and the top
α (⌈α·P⌉, the paper's α = 20%) are the long-tail prompts; the rest are regular.

**Cost model (Algorithm 2).** One instance that holds M sequences and decodes BS at a time needs
Latency = PTL(BS) · L_avg · ⌈M / BS⌉ (PTL(BS): seconds per decode step at batch BS, from the latency
profile; L_avg: P50 of recent response lengths for regular prompts, P90 for long ones). With N instances,
every split N_l + N_r = N is enumerated: the long prompts' sequences go evenly to N_l dedicated
instances, the regular ones to N_r, and the predicted generation time is the slower class. N_l = 0 (no
dedicated instance: every instance gets its share of both classes) is the baseline the split must
beat; such a mixed instance decodes its long sequences first (LPT) so its time is
PTL(BS) · (L_long · ⌈m_l / BS⌉ + L_reg · (⌈M / BS⌉ − ⌈m_l / BS⌉)), which is the paper's formula for a
pure class. The paper bounds BS by the KV memory; here BS ranges over 1..cap (the engine's batch cap)
per class and the cheapest is taken, so long instances may run a smaller batch than regular ones
("instances may run different batch caps"). Ties go to the smaller N_l, then the larger BS.

**Assignment.** Inside each class the prompts are dealt longest-predicted first to the instance with the
least predicted work (greedy LPT over instances: "evenly", as the paper says, but by predicted length
rather than by count), and each sequence carries its predicted length as its priority, so an instance
holding more than its cap admits longest-predicted first (`Scheduler(order="lpt")`).

**LPT (P||C_max).** `lpt_makespan` is the makespan of the list schedule the scheduler runs: BS decode
slots, sequences taken in descending length, each to the slot that frees first — Graham's 4/3 − 1/(3·BS)
approximation. `optimal_makespan` is the brute-force optimum for tests.

Simplified versus the paper: the paper's Algorithm 2 text is not in our copy; this is the algorithm its
§5.3 prose specifies (enumerate (N_l, N_r), P50/P90, the latency formula). PTL comes from the PAT latency
profile at a typical context (`ptl_from_profile`) or, without one, a linear a + b·BS model whose two
numbers are config values.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence as Seq

import numpy as np


def split_long(predicted: Seq[float], alpha: float) -> tuple[list[int], list[int]]:
    """Indices of the top ⌈α·P⌉ prompts by predicted length (descending, ties by index) and of the rest
    (in index order)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must be in [0, 1]")
    order = sorted(range(len(predicted)), key=lambda i: (-float(predicted[i]), i))
    k = math.ceil(alpha * len(predicted) - 1e-9)
    return order[:k], sorted(order[k:])


def length_estimates(lengths: Seq[int], default: float) -> tuple[float, float]:
    """(L_reg, L_long) = (P50, P90) of recent response lengths; `default` for both when there are none."""
    if len(lengths) == 0:
        return float(default), float(default)
    a = np.asarray(lengths, np.float64)
    return float(np.percentile(a, 50)), float(np.percentile(a, 90))


def instance_latency(ptl: Callable[[int], float], m_long: int, m_reg: int, bs: int, l_long: float,
                     l_reg: float) -> float:
    """Predicted time of one instance holding m_long long and m_reg regular sequences at batch BS (long ones
    first): PTL(BS)·(L_long·⌈m_l/BS⌉ + L_reg·(⌈M/BS⌉ − ⌈m_l/BS⌉)); a pure class is the paper's formula."""
    m = m_long + m_reg
    if m == 0:
        return 0.0
    bs = min(bs, m)
    rounds, long_rounds = -(-m // bs), -(-m_long // bs)
    return float(ptl(bs)) * (l_long * long_rounds + l_reg * (rounds - long_rounds))


def best_batch(ptl: Callable[[int], float], m_long: int, m_reg: int, cap: int, l_long: float,
               l_reg: float) -> tuple[int, float]:
    """(BS, latency) minimising `instance_latency` over BS in 1..min(cap, M); ties to the larger BS."""
    m = m_long + m_reg
    if m == 0:
        return cap, 0.0
    best = None
    for bs in range(1, min(cap, m) + 1):
        t = instance_latency(ptl, m_long, m_reg, bs, l_long, l_reg)
        if best is None or t <= best[1] + 1e-12 * max(1.0, t):
            best = (bs, t)
    return best


@dataclasses.dataclass(frozen=True)
class SplitCost:
    """One enumerated split: N_l dedicated long instances, the batch each class runs, predicted seconds."""

    n_long: int
    bs_long: int
    bs_reg: int
    t_long: float
    t_reg: float

    @property
    def seconds(self) -> float:
        return max(self.t_long, self.t_reg)


def choose_split(long_seqs: int, reg_seqs: int, instances: int, cap: int, ptl: Callable[[int], float],
                 l_long: float, l_reg: float, max_long: int | None = None) -> tuple[SplitCost, list[SplitCost]]:
    """Algorithm 2: enumerate N_l = 0..N−1 (N_l <= the long sequences; N_r >= 1; N_l <= `max_long` when
    given) and return the cheapest split with every split's cost. Sequences are spread evenly: ⌈S / N⌉ per
    instance of a class."""
    if instances < 1 or cap < 1:
        raise ValueError(f"instances={instances} and cap={cap} must be >= 1")
    costs = []
    for n_l in range(0, instances):
        if n_l > long_seqs or (max_long is not None and n_l > max_long):
            continue
        n_r = instances - n_l
        if n_l == 0:     # mixed: every instance its share of both classes, long ones first
            ml, mr = -(-long_seqs // n_r), -(-reg_seqs // n_r)
            bs, t = best_batch(ptl, ml, mr, cap, l_long, l_reg)
            costs.append(SplitCost(0, bs, bs, t if ml else 0.0, t))
            continue
        bl, tl = best_batch(ptl, -(-long_seqs // n_l), 0, cap, l_long, l_reg)
        br, tr = best_batch(ptl, 0, -(-reg_seqs // n_r), cap, l_long, l_reg)
        costs.append(SplitCost(n_l, bl, br, tl, tr))
    best = min(costs, key=lambda c: (round(c.seconds, 12), c.n_long))
    return best, costs


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each prompt goes: `instance[p]`, its LPT priority (predicted length), each instance's batch
    cap, which prompts are long, and the split that was chosen among `costs`."""

    instance: list[int]
    priority: list[float]
    caps: list[int]
    long: list[int]
    split: SplitCost
    costs: list[SplitCost]

    @property
    def long_instances(self) -> list[int]:
        return list(range(self.split.n_long))


def _deal(prompts: Seq[int], predicted: Seq[float], targets: Seq[int], weight: int) -> dict[int, int]:
    """Greedy LPT over instances: longest predicted first, each to the least predicted work (ties: lowest)."""
    load = {t: 0.0 for t in targets}
    out = {}
    for p in sorted(prompts, key=lambda i: (-float(predicted[i]), i)):
        t = min(targets, key=lambda k: (load[k], k))
        out[p] = t
        load[t] += weight * max(float(predicted[p]), 1.0)
    return out


def plan_placement(predicted: Seq[float], *, instances: int, group_size: int, cap: int,
                   ptl: Callable[[int], float], lengths: Seq[int], alpha: float = 0.2,
                   default_length: float = 1.0, max_long: int | None = None) -> Placement:
    """The skew-aware placement of one step's prompts (each with `group_size` sequences) over `instances`
    instances of batch cap `cap`: classify (top α), choose N_l (at most `max_long`) by the cost model with
    L = P50/P90 of `lengths` (recent response lengths), deal each class over its instances, set the caps.
    Long instances are 0..N_l−1."""
    if len(predicted) == 0:
        raise ValueError("no prompts to place")
    long, regular = split_long(predicted, alpha)
    l_reg, l_long = length_estimates(lengths, default_length)
    split, costs = choose_split(len(long) * group_size, len(regular) * group_size, instances, cap, ptl,
                                l_long, l_reg, max_long)
    if split.n_long == 0:
        where = _deal(range(len(predicted)), predicted, range(instances), group_size)
        caps = [split.bs_reg] * instances
    else:
        where = _deal(long, predicted, range(split.n_long), group_size)
        where.update(_deal(regular, predicted, range(split.n_long, instances), group_size))
        caps = [split.bs_long] * split.n_long + [split.bs_reg] * (instances - split.n_long)
    return Placement([where[p] for p in range(len(predicted))], [float(x) for x in predicted], caps, long,
                     split, costs)


# ------------------------------------------------------------------------ the classes through PAT's switches
@dataclasses.dataclass
class Classes:
    """A step's long/regular classes as PAT's switches keep them (`tp_switch.AdaptiveTP.classes`).

    `placed_long` of `placed` instances were the placement's long ones (Algorithm 2's N_l of N); the layout
    now running has `instances`, of which the first `n_long` are the long class's, each class with its batch
    cap. A live sequence is tagged once, the first time the switch driver sees it (`tag`): long when it sits
    on a long instance of the layout then running; the tag stays with its request id through every switch.

    After a switch to n' instances (`to`) the long class gets the first n'_long = max(1, round(N_l·n'/N))
    (half up) when n' > 1 and long sequences are live, at most n' − 1 while regular ones are live, and all n'
    when none are (an idle regular instance would only slow the tail); n' = 1 merges everything (no classes:
    PAT's tail phase; the tags are kept, so a later split restores the classes). Each class is then dealt
    over its own instances by the relayout's least-loaded rule (`deal_units`).

    Simplified: the caps are Algorithm 2's per-instance caps for the placement's layout, kept (clamped to
    the new instances' max_batch) rather than re-chosen for the new TP; and N'_l follows N_l in proportion
    instead of re-running the (N_l, N_r) enumeration at the new layout (the paper's skew placement runs once
    per step, before generation, and PAT's paper has no classes)."""

    placed_long: int
    placed: int
    cap_long: int | None = None
    cap_reg: int | None = None
    n_long: int | None = None            # the running layout's long instances (default: the placement's)
    instances: int | None = None
    long: set[int] = dataclasses.field(default_factory=set)     # request ids tagged long
    seen: set[int] = dataclasses.field(default_factory=set)     # request ids tagged

    def __post_init__(self):
        if not 0 <= self.placed_long < max(self.placed, 1):
            raise ValueError(f"{self.placed_long} long instances of {self.placed}: need 0 <= N_l < N")
        self.n_long = self.placed_long if self.n_long is None else self.n_long
        self.instances = self.placed if self.instances is None else self.instances

    @classmethod
    def from_placement(cls, plan: Placement) -> Classes:
        n = len(plan.caps)
        return cls(plan.split.n_long, n, plan.split.bs_long if plan.split.n_long else None, plan.split.bs_reg)

    def tag(self, rid: int, instance: int) -> bool:
        """Tag a live sequence on first sight (long: on one of the running layout's long instances)."""
        if rid not in self.seen:
            self.seen.add(rid)
            if instance < self.n_long:
                self.long.add(rid)
        return rid in self.long

    def long_instances(self, n: int, has_long: bool, has_regular: bool) -> int:
        """n'_long on `n` instances when long / regular sequences are live (class docstring)."""
        if n <= 1 or not has_long:
            return 0
        if not has_regular:
            return n
        return min(max(1, math.floor(self.placed_long * n / self.placed + 0.5)), n - 1)

    def to(self, n: int, rids: Seq[int]) -> Classes:
        """The classes on `n` instances dealing the live sequences `rids` (tags shared, not copied)."""
        has_long = any(r in self.long for r in rids)
        has_reg = any(r not in self.long for r in rids)
        return dataclasses.replace(self, n_long=self.long_instances(n, has_long, has_reg), instances=n,
                                   long=self.long, seen=self.seen)

    def targets(self, is_long: bool) -> range:
        """The instances a sequence of the class may be dealt to (every instance where its class has none)."""
        rng = range(0, self.n_long) if is_long else range(self.n_long, self.instances)
        return rng if len(rng) else range(self.instances)

    def caps(self) -> list[int | None]:
        """Each running instance's batch cap: its class's; lifted (None) on a single instance."""
        if self.instances <= 1:
            return [None] * self.instances
        return [self.cap_long] * self.n_long + [self.cap_reg] * (self.instances - self.n_long)


def deal_units(units: Seq[tuple[int, bool]], n: int, classes: Classes | None = None) -> list[int]:
    """A relayout's placement (`migration.deal`, and PAT's prediction of it, `adaptive_tp.merge_and_redistribute`):
    units (context tokens, long?) in order, each to the instance of `n` holding the fewest context tokens so
    far (ties: the lower index) — among its class's instances when `classes` (on `n` instances) are kept.
    Returns each unit's instance."""
    if classes is not None and classes.instances != n:
        raise ValueError(f"classes on {classes.instances} instances, dealing over {n}")
    load = [0] * n
    out = []
    for tokens, is_long in units:
        rng = range(n) if classes is None else classes.targets(is_long)
        j = min(rng, key=lambda i: (load[i], i))
        out.append(j)
        load[j] += tokens
    return out


def random_placement(prompts: int, instances: int, seed: int) -> list[int]:
    """The baseline the paper compares with: each prompt to a uniformly random instance."""
    return [int(i) for i in np.random.default_rng(seed).integers(0, instances, size=prompts)]


def linear_ptl(base_s: float, per_seq_s: float) -> Callable[[int], float]:
    """PTL(BS) = base + per_seq · BS seconds per decode step (no profile)."""
    return lambda bs: base_s + per_seq_s * bs


def ptl_from_profile(predictor, tp: int, context: float) -> Callable[[int], float]:
    """PTL(BS) from the PAT latency profile (`adaptive_tp.Predictor`): one decode step of BS sequences of
    `context` tokens each on a TP-`tp` instance."""
    return lambda bs: float(predictor.step_latency(tp, bs, bs * context))


def lpt_makespan(lengths: Seq[int], slots: int) -> int:
    """Decode steps of LPT list scheduling on `slots` batch slots: descending length, each sequence to the
    slot that frees first (what `Scheduler(order="lpt")` runs when every prediction is exact)."""
    free = [0] * max(1, slots)
    for n in sorted(lengths, reverse=True):
        i = min(range(len(free)), key=lambda k: (free[k], k))
        free[i] += int(n)
    return max(free)


def fcfs_makespan(lengths: Seq[int], slots: int) -> int:
    """The same list schedule in arrival order (the engine's default FCFS admission)."""
    free = [0] * max(1, slots)
    for n in lengths:
        i = min(range(len(free)), key=lambda k: (free[k], k))
        free[i] += int(n)
    return max(free)


def optimal_makespan(lengths: Seq[int], slots: int) -> int:
    """Brute-force P||C_max optimum (every assignment; small instances only)."""
    lengths = list(lengths)
    if len(lengths) > 10:
        raise ValueError(f"brute force over {len(lengths)} jobs is too large (<= 10)")
    best = sum(lengths)
    for assign in itertools.product(range(slots), repeat=len(lengths)):
        load = [0] * slots
        for n, s in zip(lengths, assign):
            load[s] += n
        best = min(best, max(load))
    return best
