"""Multi-turn in the rollout engine: a sequence pauses at a turn stop holding its KV, `add_tokens` appends an
observation and generation continues with only the new tokens prefilled.

The unoptimised twin is a fresh request per turn whose prompt is the whole conversation so far (what a system
re-submitting the conversation to an external engine does): greedy tokens identical, log-probs within the
float32 tolerance (the continued sequence's earlier positions were computed by decode steps, the fresh one's by
one prefill), on TP1, TP2, across a relayout mid-conversation (KV migrated or recomputed) and with the paused
sequences' KV preempted by a pool too small to hold it."""

import jax
import numpy as np
import pytest

from jaxrl.rollout import RolloutService, SamplingParams, Scheduler
from jaxrl.rollout.scheduler import Sequence
from models import PRESETS, init

LOGPROB_ATOL_F32 = 1e-4
CFG = PRESETS["tiny-qwen3"]
PROMPT_LENS = (3, 9, 16, 5)
SERVICE = dict(page_size=8, num_pages=64, max_seq_len=80)   # tests/test_movable_state.py's: its executables
MAX_NEW = 40
MAX_TURNS = 4


@pytest.fixture(scope="module")
def weights():
    return init(jax.random.key(0), CFG)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def params(weights, prompts):
    """Greedy, with the two tokens the model emits most often as turn stops (so most turns end at one)."""
    svc = RolloutService(CFG, weights, tp=1, instances=1, overlap=False, **SERVICE)
    for p in prompts:
        svc.add(p, SamplingParams(max_new_tokens=16, temperature=0.0))
    counts = np.bincount([t for c in svc.run() for t in c.tokens[1:]], minlength=CFG.vocab_size)
    stops = tuple((int(t),) for t in np.argsort(-counts, kind="stable")[:2])
    return SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, turn_stops=stops)


def observation(prompt: int, turn: int) -> list[int]:
    """A deterministic 2-6 token observation after turn `turn` of prompt `prompt` (what a tool would return;
    the same for every sample of the prompt, so greedy siblings stay one trajectory)."""
    rng = np.random.default_rng(1000 * prompt + turn)
    return rng.integers(0, CFG.vocab_size, int(rng.integers(2, 7))).tolist()


def converse(svc, prompts, params, move=None):
    """Every prompt's trajectory: at each turn stop a tool answers `rid % 3` steps later (the sequence waits
    paused meanwhile) with an observation that is appended (`add_tokens`), until MAX_TURNS turns or no room is
    left (`finish`). `move(k, svc)` runs after step k. Returns the final completions in add order."""
    of = {rid: i for i, p in enumerate(prompts) for rid in svc.add(p, params)}
    order = list(of)
    done, turns, tools, k = {}, dict.fromkeys(order, 0), {}, 0
    while svc.has_work() or tools:
        for c in svc.step():
            if c.finish_reason == "turn":
                tools[c.request_id] = (k + c.request_id % 3, c)
            else:
                done[c.request_id] = c
        if move is not None:
            move(k, svc)
        for rid, (ready, c) in sorted(tools.items()):
            if ready > k:
                continue
            del tools[rid]
            turns[rid] += 1
            obs = observation(of[rid], turns[rid])
            if turns[rid] < MAX_TURNS and len(c.tokens) + len(obs) < params.max_new_tokens:
                svc.add_tokens(rid, obs)
            else:
                svc.finish(rid)
                done[rid] = c
        k += 1
    assert not svc.live()
    assert sum(i.pool.used for i in svc.instances) == 0          # every page back, shared ones included
    return [done[r] for r in order]


def turns_of(c):
    """(start, end) in `c.tokens` of each run of sampled tokens (a turn)."""
    out, start = [], 0
    for a, b in c.appended:
        out.append((start, a))
        start = b
    return out + [(start, len(c.tokens))]


def reprefill(weights, prompts, params, finals):
    """The unoptimised twin: each turn of each trajectory as a fresh request whose prompt is the conversation
    up to that turn, its budget what the trajectory had left. Returns (per trajectory, per turn: completion)
    and the positions it prefilled."""
    svc = RolloutService(CFG, weights, tp=1, instances=1, overlap=False, **SERVICE)
    ids = []
    for p, c in zip(prompts, finals):
        ids.append([(svc.add(p + c.tokens[:a], SamplingParams(max_new_tokens=params.max_new_tokens - a,
                                                               temperature=0.0, turn_stops=params.turn_stops))[0], a, b)
                    for a, b in turns_of(c)])
    got = {}
    while svc.has_work():
        for c in svc.step():
            got[c.request_id] = c
            if c.finish_reason == "turn":
                svc.finish(c.request_id)
    return [[(got[r], a, b) for r, a, b in turns] for turns in ids], svc.stats()[0]["prefilled_tokens"]


def assert_equals_reprefill(weights, prompts, params, finals):
    ref, _ = reprefill(weights, prompts, params, finals)
    for c, turns in zip(finals, ref):
        for r, a, b in turns:
            assert r.tokens == c.tokens[a:b], (c.request_id, a, b)
            np.testing.assert_allclose(c.logprobs[a:b], r.logprobs, atol=LOGPROB_ATOL_F32)


@pytest.fixture(scope="module")
def tp1(weights, prompts, params):
    svc = RolloutService(CFG, weights, tp=1, instances=1, **SERVICE)
    return converse(svc, prompts, params), svc.stats()[0]["prefilled_tokens"]


def test_continuation_equals_reprefill_tp1(weights, prompts, params, tp1):
    finals, prefilled = tp1
    assert sum(len(c.appended) for c in finals) >= 4            # the conversations had turns
    assert_equals_reprefill(weights, prompts, params, finals)
    _, again = reprefill(weights, prompts, params, finals)
    observed = sum(b - a for c in finals for a, b in c.appended)
    # continuation prefills each prompt once (minus its last position, fed to decode) plus each observation
    # (its turn's stop token at its head, its last token fed to decode): exactly the appended tokens
    assert prefilled == sum(len(p) - 1 for p in prompts) + observed
    assert again > prefilled


def test_sampled_mask_marks_only_model_tokens(tp1):
    for c in tp1[0]:
        mask = c.sampled_mask()
        assert len(mask) == len(c.tokens) == len(c.logprobs)
        assert sum(mask) == len(c.tokens) - sum(b - a for a, b in c.appended)
        for a, b in c.appended:
            assert mask[a:b] == [0] * (b - a) and c.logprobs[a:b] == [0.0] * (b - a)


def test_continuation_equals_reprefill_tp2_and_groups(weights, prompts, params):
    """TP2 instances, and n=2 samples per prompt sharing the prompt's pages while they pause."""
    grouped = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, turn_stops=params.turn_stops, n=2)
    svc = RolloutService(CFG, weights, tp=2, instances=2, **SERVICE)
    finals = converse(svc, prompts, grouped)
    for a, b in zip(finals[::2], finals[1::2]):              # greedy siblings: one trajectory twice
        assert a.tokens == b.tokens
    assert_equals_reprefill(weights, prompts, params, finals[::2])


@pytest.mark.parametrize("kv", ["migrate", "recompute"])
def test_relayout_mid_conversation(weights, prompts, params, tp1, kv):
    """TP1x4 -> TP2x2 -> TP4x1 while some sequences run and others wait, paused, for their tool."""
    svc = RolloutService(CFG, weights, tp=1, instances=4, **SERVICE)
    layouts, moved = [(2, 2), (4, 1)], []

    def move(k, s):                       # at the first steps (3 apart) that find a sequence paused
        paused = sum(r["state"] == "paused" for r in s.sequence_stats())
        running = len(s.live()) - paused
        if layouts and paused and running and (not moved or k >= moved[-1] + 3):
            s.relayout(*layouts.pop(0), kv=kv)
            moved.append(k)

    finals = converse(svc, prompts, params, move)
    assert len(moved) == 2 and svc.layout == [4]
    assert [c.tokens for c in finals] == [c.tokens for c in tp1[0]]
    for c, r in zip(finals, tp1[0]):
        np.testing.assert_allclose(c.logprobs, r.logprobs, atol=LOGPROB_ATOL_F32)


def test_paused_kv_is_preempted_and_recomputed(weights, prompts, params, tp1):
    """A pool of 14 pages (8 positions each) cannot hold every paused trajectory's KV: paused sequences lose
    theirs first (recomputed on resume) and the tokens do not change."""
    svc = RolloutService(CFG, weights, tp=1, instances=1, **{**SERVICE, "num_pages": 14})
    finals = converse(svc, prompts, params)
    assert svc.stats()[0]["preemptions"] > 0
    assert [c.tokens for c in finals] == [c.tokens for c in tp1[0]]


def test_bad_continuations_are_refused(weights, prompts, params):
    svc = RolloutService(CFG, weights, tp=1, instances=1, **SERVICE)
    rids = [r for p in prompts for r in svc.add(p, params)]
    with pytest.raises(KeyError, match="not paused"):
        svc.add_tokens(rids[0], [1])                             # queued, not paused
    with pytest.raises(KeyError, match="not live"):
        svc.add_tokens(rids[-1] + 1, [1])
    turns = []
    while not turns:
        turns = [c for c in svc.step() if c.finish_reason == "turn"]
    turn = turns.pop()
    for c in turns + list(svc.stream()):                     # the others run to their ends
        if c.finish_reason == "turn":
            svc.finish(c.request_id)
    with pytest.raises(ValueError, match="token ids"):
        svc.add_tokens(turn.request_id, [CFG.vocab_size])
    with pytest.raises(ValueError, match="no room"):
        svc.add_tokens(turn.request_id, [1] * (MAX_NEW - len(turn.tokens)))
    svc.finish(turn.request_id)
    with pytest.raises(KeyError, match="not live"):
        svc.finish(turn.request_id)
    assert svc.instances[0].pool.used == 0
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(turn_stops=((),))


def test_turn_stops_match_only_sampled_tokens():
    p = SamplingParams(turn_stops=((5, 6), (9,)))
    assert p.ends_turn([1, 5, 6], 0) and p.ends_turn([1, 9], 1)
    assert not p.ends_turn([5, 6], 1)                  # the 5 was appended (an observation), not sampled
    assert not p.ends_turn([9], 1) and not p.ends_turn([6, 5], 0)
    capped = SamplingParams(turn_stops=((9,),), turn_max_tokens=3)
    assert capped.ends_turn([4, 4, 1, 2, 3], 2) and not capped.ends_turn([4, 4, 1, 2], 2)
    with pytest.raises(ValueError, match="turn_max_tokens"):
        SamplingParams(turn_max_tokens=-1)


def test_scheduler_snapshot_keeps_paused_sequences():
    """Pure host state: a paused sequence survives snapshot/restore and detach/attach as paused, pages held."""
    p = SamplingParams(max_new_tokens=8, turn_stops=((7,),))
    sched = Scheduler(16, 4, max_batch=4)
    sched.add([Sequence(0, [1, 2, 3, 4, 5], p, seed=0)])
    (g,) = sched.admit()
    list(sched.prefill_batches(g))
    sched.start([g])
    sched.ensure_pages()
    b = sched.decode_batch()
    ((s, reason),) = sched.take_tokens(b.seqs, np.array([7]), np.array([-0.5]))
    assert reason == "turn" and sched.paused == [s] and not sched.running and s.pages
    other = Scheduler(16, 4, max_batch=4)
    other.restore(sched.snapshot())
    assert [x.rid for x in other.paused] == [0] and other.paused[0].paused and other.paused[0].pages == s.pages
    (st,) = sched.detach([0])
    assert st.paused and st.pages
    (back,) = sched.attach([st], {q: q for q in st.pages})
    assert back in sched.paused and not sched.running and not sched.waiting
    sched.resume(back, [3, 3])
    assert list(sched.waiting) == [back] and back.appended == [(1, 3)] and back.computed == 5
