"""Vocabulary padding for tensor parallelism: a vocabulary that does not divide tp (311 here) is padded with
zero rows to a multiple of tp in the rollout and train layouts; padded logits are never sampled and never
enter log-probs or their gradients, and outputs equal the unpadded single-device computation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rollout import RolloutService, SamplingParams, generate
from jaxrl.rollout.model_step import _logits
from jaxrl.rollout.sampling import SamplingBatch, sample
from jaxrl.train.batch import Sample, pack
from jaxrl.train.step import token_logp
from kernels.logprobs import token_logprobs, token_logprobs_reference
from models import (PRESETS, fit_vocab, forward, init, load_hf, logical_axes, lm_head, padded_vocab, save_hf,
                    vocab_rows)
from sharding import Layout, ShardingRules, padded_vocab_for, shardings_for, specs_for
from tests.test_logprobs import TOL, assert_close, cotangents, make_case

V = 311
TIED = dataclasses.replace(PRESETS["tiny-qwen3"], vocab_size=V)      # lm_head = embed.T
UNTIED = dataclasses.replace(PRESETS["tiny-llama"], vocab_size=V)    # a separate lm_head [E, V]
CFGS = pytest.mark.parametrize("cfg", [TIED, UNTIED], ids=["tied", "untied"])


def _arrays_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_padded_vocab_arithmetic():
    assert padded_vocab(311, 2) == 312 and padded_vocab(312, 2) == 312 and padded_vocab(50257, 8) == 50264
    assert padded_vocab_for(TIED, Layout(tp=1)) == 311
    assert padded_vocab_for(TIED, Layout(fsdp=4, tp=2)) == 312
    assert padded_vocab_for(dataclasses.replace(TIED, vocab_size=309), Layout(tp=4)) == 312
    with pytest.raises(ValueError, match="vocab_size=310 must be an int >= the model's vocabulary 311"):
        logical_axes(TIED, vocab_size=310)


# ------------------------------------------------------------------------------------ weights, fit, HF I/O

@CFGS
def test_init_pads_with_zeros_and_keeps_real_rows(cfg):
    w = init(jax.random.key(0), cfg)
    wp = init(jax.random.key(0), cfg, vocab_size=312)
    assert wp.embed.shape == (312, cfg.hidden_size) and vocab_rows(wp) == 312
    assert not np.any(np.asarray(wp.embed[V:]))
    np.testing.assert_array_equal(np.asarray(wp.embed[:V]), np.asarray(w.embed))
    if cfg.tie_embeddings:
        assert wp.lm_head is None
    else:
        assert wp.lm_head.shape == (cfg.hidden_size, 312) and not np.any(np.asarray(wp.lm_head[:, V:]))
        np.testing.assert_array_equal(np.asarray(wp.lm_head[:, :V]), np.asarray(w.lm_head))
    _arrays_equal(fit_vocab(w, 312), wp)


@CFGS
def test_sharded_init_and_forward_return_the_real_vocabulary(cfg):
    layout = Layout(fsdp=4, tp=2)
    padded = padded_vocab_for(cfg, layout)
    shardings = shardings_for(logical_axes(cfg, vocab_size=padded), layout.make_mesh(jax.devices()),
                              ShardingRules.train(cfg, layout))
    w = init(jax.random.key(0), cfg)
    wp = init(jax.random.key(0), cfg, shardings=shardings, vocab_size=padded)
    assert wp.embed.sharding == shardings.embed
    _arrays_equal(wp, fit_vocab(w, padded))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 9)), jnp.int32)
    want = forward(w, cfg, tokens)
    got = forward(wp, cfg, tokens)
    assert got.shape == want.shape == (2, 9, V)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


@CFGS
def test_fit_vocab_round_trip_including_sharded_inputs(cfg):
    w = init(jax.random.key(1), cfg)
    up = fit_vocab(w, 320)
    assert vocab_rows(up) == 320 and up.layers is w.layers and fit_vocab(up, 320) is up
    _arrays_equal(fit_vocab(up, V), w)
    layout = Layout(tp=2)
    mesh = layout.make_mesh(jax.devices()[:2])
    sh = shardings_for(logical_axes(cfg, vocab_size=312), mesh, ShardingRules.rollout(cfg, layout))
    placed = jax.device_put(fit_vocab(w, 312), sh)
    _arrays_equal(fit_vocab(placed, V), w)                 # slicing a tp-sharded padded array
    _arrays_equal(fit_vocab(placed, 316), fit_vocab(w, 316))
    with pytest.raises(ValueError, match="size=0"):
        fit_vocab(w, 0)


@CFGS
def test_save_and_load_hf_with_a_padded_vocabulary(cfg, tmp_path):
    w = init(jax.random.key(2), cfg)
    save_hf(tmp_path, cfg, fit_vocab(w, 312))                      # writes only the real 311 rows
    cfg2, back = load_hf(tmp_path)
    assert cfg2.vocab_size == V and back.embed.shape[0] == V
    _arrays_equal(back, w)
    _, padded = load_hf(tmp_path, vocab_size=312)
    _arrays_equal(padded, fit_vocab(w, 312))
    for role, layout in (("train", Layout(fsdp=4, tp=2)), ("rollout", Layout(tp=2)), ("rollout", Layout(tp=4))):
        vp = padded_vocab_for(cfg, layout)
        sh = shardings_for(logical_axes(cfg, vocab_size=vp), layout.make_mesh(jax.devices()[:layout.size]),
                           ShardingRules.for_role(role, cfg, layout))
        _, sharded = load_hf(tmp_path, shardings=sh, vocab_size=vp)
        for x, s in zip(jax.tree.leaves(sharded), jax.tree.leaves(sh)):
            assert x.sharding == s
        _arrays_equal(sharded, fit_vocab(w, vp))


# ---------------------------------------------------------------------------------------------- sharding

def test_unpadded_vocabulary_and_non_dividing_heads_are_errors_naming_the_leaf():
    layout = Layout(tp=2)
    with pytest.raises(ValueError, match=r"embed: shape \(311, 64\) dim 0 \(vocab=311\).*padded_vocab_for"):
        specs_for(logical_axes(TIED), ShardingRules.rollout(TIED, layout), layout.mesh_shape)
    specs_for(logical_axes(TIED, vocab_size=padded_vocab_for(TIED, layout)), ShardingRules.rollout(TIED, layout),
              layout.mesh_shape)                                       # padded: fine
    cfg = dataclasses.replace(TIED, num_heads=6)
    for role, layout in (("rollout", Layout(tp=4)), ("train", Layout(fsdp=2, tp=4))):
        axes = logical_axes(cfg, vocab_size=padded_vocab_for(cfg, layout))
        with pytest.raises(ValueError, match=r"layers\.wq: shape .* \(heads=6\) is not divisible") as e:
            specs_for(axes, ShardingRules.for_role(role, cfg, layout), layout.mesh_shape)
        assert "layers.wo" in str(e.value) and "vocab" not in str(e.value)


# --------------------------------------------------------------------------------------- log-prob kernel

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n,v,pad,chunk,temperature", [(37, 100, 28, 128, 1.0), (53, 301, 11, 64, 0.7),
                                                       (40, 256, 256, 128, 1.0)])
def test_token_logprobs_ignore_padded_columns(n, v, pad, chunk, temperature, dtype):
    """Padded w (junk in the padded columns, to show they are never read into the result) vs the reference
    on the unpadded w: values and gradients within the file's tolerances, d_w of padded columns exactly 0."""
    hidden, w, targets = make_case(n, v, dtype)
    junk = jnp.full((w.shape[0], pad), 50.0, dtype)
    wp = jnp.concatenate([w, junk], axis=1)
    g_logp, g_ent = cotangents(n)

    def loss(run, h, w_):
        logp, ent = run(h, w_)
        return jnp.sum(logp * g_logp) + jnp.sum(ent * g_ent), (logp, ent)

    chunked = lambda h, w_: token_logprobs(h, w_, targets, temperature=temperature, chunk_size=chunk,
                                           valid_vocab=v)
    ref = lambda h, w_: token_logprobs_reference(h, w_, targets, temperature=temperature)
    (_, (logp, ent)), (dh, dw) = jax.jit(jax.value_and_grad(lambda h, w_: loss(chunked, h, w_), (0, 1),
                                                            has_aux=True))(hidden, wp)
    (_, (rlogp, rent)), (rdh, rdw) = jax.jit(jax.value_and_grad(lambda h, w_: loss(ref, h, w_), (0, 1),
                                                                has_aux=True))(hidden.astype(jnp.float32),
                                                                               w.astype(jnp.float32))
    assert dw.shape == wp.shape and dw.dtype == wp.dtype
    assert_close(logp, rlogp, dtype)
    assert_close(ent, rent, dtype)
    assert_close(dh, rdh, dtype)
    assert_close(dw[:, :v], rdw, dtype)
    assert np.all(np.asarray(dw[:, v:]) == 0)
    pr = token_logprobs_reference(hidden.astype(jnp.float32), wp.astype(jnp.float32), targets,
                                  temperature=temperature, valid_vocab=v)
    assert_close(pr[0], rlogp, jnp.float32)
    with pytest.raises(ValueError, match="valid_vocab"):
        token_logprobs(hidden, wp, targets, valid_vocab=v + pad + 1)
    assert TOL  # the tolerances used are test_logprobs.py's, set once per dtype


# ------------------------------------------------------------------------------------------------ train

def _batch(cfg):
    rng = np.random.default_rng(3)
    samples = [Sample(rng.integers(0, V, rng.integers(3, 9)).tolist(), rng.integers(0, V, rng.integers(2, 12)).tolist(),
                      float(rng.normal())) for _ in range(6)]
    samples[0] = Sample([V - 1, 0, V - 1], [V - 1, V - 2], 1.0)            # the last real token as input/target
    return {k: jnp.asarray(v) for k, v in pack(samples, np.ones(len(samples)), pack_len=32).items()}


@CFGS
def test_train_logprobs_and_grads_at_tp2_equal_unpadded_single_device(cfg):
    layout = Layout(fsdp=4, tp=2)
    padded = padded_vocab_for(cfg, layout)
    assert padded == 312
    mesh = layout.make_mesh(jax.devices())
    shardings = shardings_for(logical_axes(cfg, vocab_size=padded), mesh, ShardingRules.train(cfg, layout))
    w = jax.device_put(init(jax.random.key(4), cfg), jax.devices()[0])
    wp = jax.device_put(fit_vocab(w, padded), shardings)
    batch = _batch(cfg)
    mask = batch["loss_mask"].astype(jnp.float32)

    def loss(params):
        logp, ent = token_logp(params, cfg, batch, 0.9)
        return jnp.sum((logp * batch["advantages"] + 0.1 * ent) * mask), (logp, ent)

    (_, (logp, ent)), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(w)
    (_, (logp_p, ent_p)), g_p = jax.jit(jax.value_and_grad(loss, has_aux=True))(wp)
    np.testing.assert_allclose(np.asarray(logp_p), np.asarray(logp), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent_p), np.asarray(ent), atol=1e-5)
    # Gradients: 1e-5 relative to each leaf's largest entry (test_logprobs' convention): entries ~7 differ by
    # ~1e-5 between the 8-way sharded and the single-device sums (float32 reduction order; padded but
    # unsharded agrees to 5e-7).
    for a, b in zip(jax.tree.leaves(fit_vocab(g_p, V)), jax.tree.leaves(g), strict=True):
        assert_close(a, b, jnp.float32)
    assert not np.any(np.asarray(g_p.embed[V:]))
    if not cfg.tie_embeddings:
        assert not np.any(np.asarray(g_p.lm_head[:, V:]))
    assert np.any(np.asarray(lm_head(g_p)[:, V - 1]))                   # the last real column does get a gradient


# ---------------------------------------------------------------------------------------------- rollout

@pytest.fixture(scope="module")
def weights():
    return init(jax.random.key(5), TIED)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(6)
    return [rng.integers(0, V, int(n)).tolist() for n in (5, 11, 3, 17)] + [[V - 1, V - 1, 7]]


PARAMS = [SamplingParams(max_new_tokens=12, temperature=0.0),
          SamplingParams(max_new_tokens=12, temperature=1.0, seed=3),
          SamplingParams(max_new_tokens=12, temperature=0.5, top_k=40, top_p=0.9, n=2, seed=4)]


def _same(outs, ref):
    assert [o.tokens for o in outs] == [r.tokens for r in ref]
    for o, r in zip(outs, ref):
        np.testing.assert_allclose(o.logprobs, r.logprobs, atol=1e-5)


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled", "truncated"])
def test_generation_at_tp2_equals_tp1_and_never_samples_padding(weights, prompts, params):
    """tp=1 keeps 311 rows; tp=2 pads to 312. The padded weights given directly have a huge padded row
    (tied: it is also the padded logit column): masking must still keep it out of every draw."""
    ref = generate(TIED, weights, prompts, params, tp=1, max_seq_len=64)
    assert all(t < V for r in ref for t in r.tokens)
    _same(generate(TIED, weights, prompts, params, tp=2, max_seq_len=64), ref)
    hot = fit_vocab(weights, 312)
    hot = dataclasses.replace(hot, embed=hot.embed.at[V:].set(100.0))
    outs = generate(TIED, hot, prompts, params, tp=2, max_seq_len=64)
    assert all(t < V for o in outs for t in o.tokens)
    _same(outs, ref)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.5, 0, 1.0), (0.3, 5, 0.8),
                                                     (2.0, 400, 1.0)])
def test_decode_logits_mask_padded_columns(weights, temperature, top_k, top_p):
    """A padded lm-head column that would win every row unmasked gets exactly zero weight in the draw, and
    the returned log-probs equal those of the unpadded logits."""
    B = 6
    h = jax.random.normal(jax.random.key(8), (B, TIED.hidden_size))
    hot = fit_vocab(weights, 312)
    hot = dataclasses.replace(hot, embed=hot.embed.at[V].set(100.0 * jnp.sum(h, 0)))
    raw = h @ hot.embed.T
    assert np.all(np.asarray(jnp.argmax(raw, -1)) == V)                 # unmasked, padding would be drawn
    masked = _logits(hot, h, V)
    np.testing.assert_array_equal(np.asarray(masked[:, :V]), np.asarray(raw[:, :V]))
    rows = [(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), 11, t) for t in range(B)]
    batch = SamplingBatch.build(rows, B)
    tok, logp = sample(masked, batch)
    tok_ref, logp_ref = sample(raw[:, :V], batch)
    assert np.all(np.asarray(tok) < V)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(tok_ref))
    np.testing.assert_allclose(np.asarray(logp), np.asarray(logp_ref), atol=1e-6)


def test_relayout_between_paddings_keeps_outputs(prompts):
    """Vocabulary 309: tp=2 pads to 310, tp=4 to 312; a mid-generation switch re-fits the vocabulary."""
    cfg = dataclasses.replace(TIED, vocab_size=309)
    w = init(jax.random.key(7), cfg)
    ps = [[t % 309 for t in p] for p in prompts]
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=9)
    ref = generate(cfg, w, ps, params, tp=1, max_seq_len=64)
    svc = RolloutService(cfg, w, tp=2, instances=2, max_seq_len=64)
    assert [vocab_rows(i.weights) for i in svc.instances] == [310, 310]
    order = [rid for p in ps for rid in svc.add(p, params)]
    done = {c.request_id: c for _ in range(4) for c in svc.step()}
    svc.relayout(tp=4, instances=1)
    assert vocab_rows(svc.instances[0].weights) == 312
    done.update({c.request_id: c for c in svc.stream()})
    _same([done[r] for r in order], ref)
    reports = svc.update_weights(w)                                    # unpadded weights from outside
    assert len(reports) == 1 and vocab_rows(svc.instances[0].weights) == 312
    assert not w.embed.is_deleted()
