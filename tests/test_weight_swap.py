"""A weight update in the middle of generation (`RolloutService.swap_weights`, partial rollouts across weight
versions): every live sequence continues with the new weights from its next token on and each token records the
version that sampled it.

The unoptimised twin is the dense model run by hand (`models.forward_block`): the K/V of the positions before
the swap from the weights that computed them (kv="keep": the old weights; kv="recompute": the new ones), then
the new weights over the continuation, teacher-forced. Greedy tokens equal its argmax at every position (so the
whole continuation is the greedy one) and the log-probs agree within the float32 tolerance (the engine computed
the earlier positions in decode steps, the twin in one block). Before the swap every token equals the run that
never swapped. On one TP1 instance and on two TP2 instances (4 devices), with the in-flight step drained."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rollout import RolloutService, SamplingParams
from models import PRESETS, forward_block, init

LOGPROB_ATOL_F32 = 1e-4
CFG = PRESETS["tiny-qwen3"]
SERVICE = dict(page_size=8, num_pages=64, max_seq_len=80)   # tests/test_movable_state.py's: its executables
PROMPT_LEN, MAX_NEW, SWAP_AFTER = 8, 20, 7
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, n=2)


@pytest.fixture(scope="module")
def weights():
    return init(jax.random.key(0), CFG), init(jax.random.key(5), CFG)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, CFG.vocab_size, PROMPT_LEN).tolist() for _ in range(4)]


def run(weights, prompts, *, tp=1, instances=1, swap=None):
    """Completions in request order; with `swap` ("keep" / "recompute") the new weights come in after
    SWAP_AFTER engine steps. Returns (completions, swap report or None, positions prefilled)."""
    old, new = weights
    svc = RolloutService(CFG, old, tp=tp, instances=instances, devices=jax.devices()[:tp * instances], **SERVICE)
    for p in prompts:
        svc.add(p, PARAMS)
    done, report = [], None
    for k in range(1000):
        if not svc.has_work():
            break
        done += svc.step()
        if swap and k + 1 == SWAP_AFTER:
            report = svc.swap_weights(new, version=1, kv=swap)
    prefilled = sum(i.sched.prefilled for i in svc.instances)
    return sorted(done, key=lambda c: c.request_id), report, prefilled


def twin(weights, prompts, comps, kv: str):
    """(log-softmax [B, T, V] of the continuation, teacher-forced, boundary b) from the dense model: the K/V of
    prompt + the first b − 1 tokens from the old (keep) or the new (recompute) weights, then the new weights."""
    old, new = weights
    (b,) = {c.versions[-1][0] for c in comps}                  # every sequence was running at the swap
    prompt = np.asarray([prompts[c.request_id // PARAMS.n] for c in comps], np.int32)
    toks = np.asarray([c.tokens for c in comps], np.int32)
    hist = jnp.asarray(np.concatenate([prompt, toks[:, :b - 1]], axis=1))
    empty = jnp.zeros((CFG.num_layers, len(comps), 0, CFG.num_kv_heads, CFG.head_dim), jnp.float32)
    _, (hk, hv) = forward_block(old if kv == "keep" else new, CFG, hist, empty, empty)
    logits, _ = forward_block(new, CFG, jnp.asarray(toks[:, b - 1:-1]), hk, hv)
    return np.asarray(jax.nn.log_softmax(logits, axis=-1)), b


@pytest.mark.parametrize("kv", ["keep", "recompute"])
@pytest.mark.parametrize("tp,instances", [(1, 1), (2, 2)])
def test_swap_mid_generation_equals_the_dense_twin(weights, prompts, kv, tp, instances):
    plain, _, plain_prefilled = run(weights, prompts, tp=tp, instances=instances)
    comps, report, prefilled = run(weights, prompts, tp=tp, instances=instances, swap=kv)
    logp, b = twin(weights, prompts, comps, kv)
    assert 1 < b < MAX_NEW, b
    assert report["sequences"] == len(comps) == 8
    for i, (c, p) in enumerate(zip(comps, plain)):
        assert c.versions == [(0, 0), (b, 1)] and c.token_versions() == [0] * b + [1] * (MAX_NEW - b)
        assert c.tokens[:b] == p.tokens[:b] and c.logprobs[:b] == p.logprobs[:b]    # before: the old weights
        cont = np.asarray(c.tokens[b:])
        np.testing.assert_array_equal(logp[i].argmax(-1), cont)                   # greedy on the new weights
        np.testing.assert_allclose(c.logprobs[b:], logp[i, np.arange(len(cont)), cont], atol=LOGPROB_ATOL_F32)
    assert any(c.tokens[b:] != p.tokens[b:] for c, p in zip(comps, plain))      # the new weights did change them
    # recompute re-prefills prompt + the first b - 1 tokens of every sequence (no prefix sharing after a drop)
    assert report["recomputed"] == (8 * (PROMPT_LEN + b - 1) if kv == "recompute" else 0)
    assert prefilled - plain_prefilled == report["recomputed"]


def test_keep_and_recompute_twins_differ(weights, prompts):
    """The two modes' twins are not the same computation (old vs new K/V): the test above can tell them apart."""
    comps, _, _ = run(weights, prompts, swap="keep")
    keep, _ = twin(weights, prompts, comps, "keep")
    rec, _ = twin(weights, prompts, comps, "recompute")
    assert np.abs(keep - rec).max() > 1e-2


def test_bad_kv_mode_and_versions_between_rollouts(weights, prompts):
    old, new = weights
    svc = RolloutService(CFG, old, tp=1, instances=1, devices=jax.devices()[:1], **SERVICE)
    with pytest.raises(ValueError, match="kv='migrate'; valid choices: keep, recompute"):
        svc.swap_weights(new, version=1, kv="migrate")
    svc.update_weights(new, version=4)          # between rollouts: every token of the next one is version 4
    svc.add(prompts[0], SamplingParams(max_new_tokens=5, temperature=0.0))
    (c,) = svc.run()
    assert svc.version == 4 and c.versions == [(0, 4)] and c.token_versions() == [4] * 5
    rid = svc.add(prompts[1], SamplingParams(max_new_tokens=6, temperature=0.0))[0]
    svc.step()
    aborted = svc.abort(rid)
    assert aborted.versions == [(0, 4)] and aborted.finish_reason == "abort"


def test_recompute_swap_while_paused_at_a_turn_equals_the_new_weights_on_the_conversation(weights, prompts):
    """Multi-turn: a trajectory paused at a turn stop (holding its K/V) when the weights are swapped with
    kv=recompute loses its K/V; resumed with an observation it continues exactly as the new weights do on the whole
    conversation so far (a fresh request), greedy tokens identical and log-probs within 1e-4."""
    old, new = weights
    plain = RolloutService(CFG, old, tp=1, instances=1, devices=jax.devices()[:1], **SERVICE)
    plain.add(prompts[0], SamplingParams(max_new_tokens=12, temperature=0.0))
    stop = plain.run()[0].tokens[3]                     # the greedy path's 4th token ends a turn
    params = SamplingParams(max_new_tokens=24, temperature=0.0, turn_stops=((stop,),))
    svc = RolloutService(CFG, old, tp=1, instances=1, devices=jax.devices()[:1], **SERVICE)
    (rid,) = svc.add(prompts[0], params)
    first = next(c for c in svc.stream() if c.finish_reason == "turn")
    report = svc.swap_weights(new, version=1, kv="recompute")
    assert report == {"sequences": 1, "recomputed": PROMPT_LEN + len(first.tokens) - 1}
    obs = [5, 6, 7]
    svc.add_tokens(rid, obs)
    second = next(c for c in svc.stream())
    fresh = RolloutService(CFG, new, tp=1, instances=1, devices=jax.devices()[:1], **SERVICE)
    conversation = list(prompts[0]) + first.tokens + obs
    fresh.add(conversation, SamplingParams(max_new_tokens=24 - len(first.tokens) - len(obs), temperature=0.0,
                                           turn_stops=((stop,),)))
    want = next(c for c in fresh.stream())
    n = len(first.tokens) + len(obs)
    assert second.tokens[:n] == first.tokens + obs and second.tokens[n:] == want.tokens
    np.testing.assert_allclose(second.logprobs[n:], want.logprobs, atol=LOGPROB_ATOL_F32)
    assert second.token_versions() == [0] * len(first.tokens) + [1] * (len(second.tokens) - len(first.tokens))


def _abort_after(svc, rids, steps):
    """Run `steps` engine steps, then abort every request still live; returns {rid: completion}."""
    done = {}
    for _ in range(steps):
        done.update({c.request_id: c for c in svc.step()})
    for rid in rids:
        if rid not in done:
            done[rid] = svc.abort(rid)
    return done


@pytest.mark.parametrize("new_weights", [False, True])
def test_a_carried_partial_response_resumes_as_if_never_aborted(weights, prompts, new_weights):
    """Carried partial responses (`jaxrl.rollout.partial_carry`, `RolloutService.resume`): a response aborted
    after SWAP_AFTER steps and resumed in another service continues exactly as the uninterrupted one: sampled
    (temperature 1, per-sample seeds) on the same weights, the same tokens; on new weights, what a kv=recompute
    swap at that point gives: the dense twin's greedy tokens over K/V the new weights recomputed. Log-probs
    within 1e-4 (the resumed prefix is prefilled, not decoded), and each token keeps the version that sampled
    it."""
    from jaxrl.rollout.partial_carry import Partial, resume_group

    old, new = weights
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0 if new_weights else 1.0, n=2, seed=11)
    svc = RolloutService(CFG, old, tp=1, instances=1, devices=jax.devices()[:1], **SERVICE)
    rids = [svc.add(p, params) for p in prompts[:2]]
    parts = _abort_after(svc, [r for g in rids for r in g], SWAP_AFTER)
    ref = RolloutService(CFG, old, tp=1, instances=1, devices=jax.devices()[:1], **SERVICE)
    for p in prompts[:2]:
        ref.add(p, params)
    want = {c.request_id: c for c in ref.run()}            # never aborted, on the old weights
    later = RolloutService(CFG, new if new_weights else old, tp=1, instances=1, devices=jax.devices()[:1], **SERVICE)
    later.version = 1 if new_weights else 0
    slots = {}
    for i, group in enumerate(rids):
        carried = [Partial.of(j, parts[rid], 0) for j, rid in enumerate(group)]
        assert all(0 < len(c.tokens) < MAX_NEW and not c.finished for c in carried)
        got, done = resume_group(later, prompts[i], params, carried, params.seed)
        assert not done and None not in got
        slots.update({rid: group[j] for j, rid in enumerate(got)})
    out = {slots[c.request_id]: dataclasses.replace(c, request_id=slots[c.request_id]) for c in later.run()}
    assert sorted(out) == sorted(want) == [0, 1, 2, 3]
    for rid, c in out.items():
        b = len(parts[rid].tokens)
        assert c.tokens[:b] == want[rid].tokens[:b] and c.logprobs[:b] == list(parts[rid].logprobs)
        assert c.token_versions() == [0] * b + [later.version] * (MAX_NEW - b)
        if not new_weights:
            assert c.tokens == want[rid].tokens
            np.testing.assert_allclose(c.logprobs, want[rid].logprobs, atol=LOGPROB_ATOL_F32)
    if new_weights:              # the new weights from token b on, over K/V they recomputed: the dense twin's
        comps = [out[r] for r in sorted(out)]
        logp, b = twin(weights, prompts, comps, "recompute")
        for i, c in enumerate(comps):
            cont = np.asarray(c.tokens[b:])
            np.testing.assert_array_equal(logp[i].argmax(-1), cont)
            np.testing.assert_allclose(c.logprobs[b:], logp[i, np.arange(len(cont)), cont], atol=LOGPROB_ATOL_F32)
        assert any(c.tokens[b:] != want[r].tokens[b:] for r, c in out.items())    # the new weights changed them
    else:                        # the sampled continuations differ between samples: the seeds were kept apart
        assert len({tuple(c.tokens) for c in out.values()}) == len(out)
