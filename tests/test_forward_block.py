"""`models.decoder_stack` and its callers: block forward over history K/V equals the full forward (values
and gradients, weights and history), rollout KV cache equals block K/V, remat policies, Pallas attention."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import PRESETS, REMAT_POLICIES, decoder_stack, forward, forward_block, init

ATOL_F32 = 1e-5
# remat recomputes the same ops, but XLA fuses and reduces them in another order: float32 rounding
# (observed up to ~2e-6 relative on O(1) gradient entries).
GRAD_ATOL_F32, GRAD_RTOL_F32 = 1e-6, 1e-5
NAMES = ("tiny-qwen3", "tiny-qwen2", "tiny-llama")   # qk-norm; q/k/v bias; Llama-3 rope scaling
SPLITS = (7, 11, 5)           # unequal blocks of a T=23 row


def _setup(name, B=2, T=sum(SPLITS), seed=0):
    cfg = PRESETS[name]
    w = init(jax.random.key(seed), cfg, jnp.float32)
    tokens = jax.random.randint(jax.random.key(seed + 1), (B, T), 0, cfg.vocab_size)
    return cfg, w, tokens


def _empty_history(cfg, B):
    z = jnp.zeros((cfg.num_layers, B, 0, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    return z, z


def _blockwise(w, cfg, tokens, splits=SPLITS, **kw):
    """Logits of the row computed block by block, each block fed the K/V of all earlier blocks."""
    hk, hv = _empty_history(cfg, tokens.shape[0])
    outs, start = [], 0
    for n in splits:
        logits, (k, v) = forward_block(w, cfg, tokens[:, start:start + n], hk, hv, **kw)
        hk, hv = jnp.concatenate([hk, k], axis=2), jnp.concatenate([hv, v], axis=2)
        outs.append(logits)
        start += n
    return jnp.concatenate(outs, axis=1), (hk, hv)


@pytest.mark.parametrize("name", NAMES)
def test_blocks_equal_full_forward(name):
    cfg, w, tokens = _setup(name)
    full = forward(w, cfg, tokens)
    blocks, (hk, hv) = _blockwise(w, cfg, tokens)
    assert blocks.shape == full.shape and blocks.dtype == jnp.float32
    np.testing.assert_allclose(blocks, full, atol=ATOL_F32, rtol=0)
    assert hk.shape == (cfg.num_layers, tokens.shape[0], tokens.shape[1], cfg.num_kv_heads, cfg.head_dim)
    # One block with empty history is the full forward; hidden states too.
    hid, _ = forward_block(w, cfg, tokens, *_empty_history(cfg, tokens.shape[0]), return_hidden=True)
    np.testing.assert_allclose(hid, forward(w, cfg, tokens, return_hidden=True), atol=ATOL_F32, rtol=0)


def test_block_kv_equals_rollout_cache():
    from jaxrl.rollout import SamplingParams, generate

    cfg, w, _ = _setup("tiny-qwen3")
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, 13).tolist()
    out = generate(cfg, w, [prompt], SamplingParams(max_new_tokens=6, temperature=0.0, return_kv=True),
                   page_size=8, num_pages=16)[0]
    ck, cv = out.kv.numpy()                                      # [L, n, K, D], n = len(seq) - 1
    seq = jnp.asarray([prompt + out.tokens[:-1]], jnp.int32)
    # Two blocks, so the second block's K/V sit at a nonzero RoPE offset.
    _, (k, v) = _blockwise(w, cfg, seq, splits=(9, seq.shape[1] - 9))
    np.testing.assert_allclose(k[:, 0], ck, atol=ATOL_F32, rtol=0)
    np.testing.assert_allclose(v[:, 0], cv, atol=ATOL_F32, rtol=0)


def _token_nll(logits, targets, n_total):
    """Summed next-token NLL of `targets` divided by the row set's total token count (a training loss)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1)) / n_total


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen2"])
def test_block_gradients_chain_to_full_gradient(name):
    """MetroRLHF's backward: vjp of block 2 w.r.t. (weights, history), then vjp of block 1 with the
    history cotangent added to its own K/V cotangent; summed weight grads equal the full gradient."""
    cfg, w, tokens = _setup(name)
    S, n = 9, tokens.size
    targets = jnp.roll(tokens, -1, axis=1)

    g_full = jax.grad(lambda w: _token_nll(forward(w, cfg, tokens), targets, n))(w)
    h0k, h0v = _empty_history(cfg, tokens.shape[0])

    def loss_chain(w):
        l1, (k1, v1) = forward_block(w, cfg, tokens[:, :S], h0k, h0v)
        l2, _ = forward_block(w, cfg, tokens[:, S:], k1, v1)
        return _token_nll(l1, targets[:, :S], n) + _token_nll(l2, targets[:, S:], n)

    g_chain = jax.grad(loss_chain)(w)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=ATOL_F32, rtol=0), g_chain, g_full)

    # The same by hand, last block first, as the blockwise trainer does it.
    (_, (k1, v1)), vjp1 = jax.vjp(lambda w: forward_block(w, cfg, tokens[:, :S], h0k, h0v), w)
    (l2, kv2), vjp2 = jax.vjp(lambda w, hk, hv: forward_block(w, cfg, tokens[:, S:], hk, hv), w, k1, v1)
    ct2 = jax.grad(_token_nll)(l2, targets[:, S:], n)
    gw2, gk1, gv1 = vjp2((ct2, jax.tree.map(jnp.zeros_like, kv2)))
    assert float(jnp.abs(gk1).max()) > 0 and float(jnp.abs(gv1).max()) > 0
    l1 = forward_block(w, cfg, tokens[:, :S], h0k, h0v)[0]
    (gw1,) = vjp1((jax.grad(_token_nll)(l1, targets[:, :S], n), (gk1, gv1)))
    g_manual = jax.tree.map(jnp.add, gw1, gw2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=ATOL_F32, rtol=0), g_manual, g_full)


def test_history_gradient_matches_injected_full_forward():
    """d(block-2 loss)/d(history K) equals the gradient w.r.t. a perturbation added to those keys inside
    one full-length `decoder_stack` run whose later layers see the block-1 K/V frozen (stop_gradient)."""
    cfg, w, tokens = _setup("tiny-qwen3", B=1)
    S, T = 9, tokens.shape[1]
    ct = jax.random.normal(jax.random.key(8), (1, T - S, cfg.vocab_size), jnp.float32) / ((T - S) * cfg.vocab_size)
    h0 = _empty_history(cfg, 1)
    _, (k1, v1) = forward_block(w, cfg, tokens[:, :S], *h0)

    def loss_block(hk):
        l2, _ = forward_block(w, cfg, tokens[:, S:], hk, v1)
        return jnp.sum(l2 * ct)

    def loss_injected(dk):
        # Full-row forward where the first S keys of each layer are replaced by (frozen history + dk).
        from kernels import attention

        def attend(l, q, k, v, carry, xs_l):
            hist_k, hist_v, d = xs_l
            k = jnp.concatenate([jax.lax.stop_gradient(hist_k) + d, k[:, S:]], axis=1)
            v = jnp.concatenate([jax.lax.stop_gradient(hist_v), v[:, S:]], axis=1)
            return attention(q, k, v, causal=True), carry, None

        pos = jnp.arange(T, dtype=jnp.int32)[None]
        x, _, _ = decoder_stack(w, cfg, w.embed[tokens], pos, attend, xs=(k1, v1, dk))
        return jnp.sum(jnp.einsum("bte,ev->btv", x[:, S:], w.embed.T) * ct)

    g_block = jax.grad(loss_block)(k1)
    g_inj = jax.grad(loss_injected)(jnp.zeros_like(k1))
    assert float(jnp.abs(g_block).max()) > 0
    np.testing.assert_allclose(g_block, g_inj, atol=ATOL_F32, rtol=0)


@pytest.mark.parametrize("remat", ["layer", "dots"])
def test_remat_same_values_and_grads(remat):
    cfg, w, tokens = _setup("tiny-qwen2")

    def loss(w, remat):
        return _token_nll(forward(w, cfg, tokens, remat=remat), jnp.roll(tokens, -1, axis=1), tokens.size)

    np.testing.assert_array_equal(forward(w, cfg, tokens, remat=remat), forward(w, cfg, tokens))
    g0, g1 = jax.grad(loss)(w, "none"), jax.grad(loss)(w, remat)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=GRAD_ATOL_F32, rtol=GRAD_RTOL_F32), g1, g0)
    # forward_block takes the same policies.
    h0 = _empty_history(cfg, tokens.shape[0])
    np.testing.assert_array_equal(forward_block(w, cfg, tokens, *h0, remat=remat)[0],
                                  forward_block(w, cfg, tokens, *h0)[0])


def test_remat_layer_saves_memory():
    cfg = dataclasses.replace(PRESETS["tiny-qwen3"], num_layers=4)
    w = init(jax.random.key(0), cfg)
    tokens = jnp.zeros((2, 256), jnp.int32)

    def temp_bytes(remat):
        def loss(w):
            return jnp.mean(forward(w, cfg, tokens, return_hidden=True, remat=remat).astype(jnp.float32) ** 2)

        return jax.jit(jax.grad(loss)).lower(w).compile().memory_analysis().temp_size_in_bytes

    none, layer, dots = (temp_bytes(r) for r in REMAT_POLICIES)
    print(f"REMAT temp bytes: none={none} layer={layer} dots={dots}")
    assert layer < none
    assert dots < none


def test_bad_choices_name_valid_ones():
    cfg, w, tokens = _setup("tiny-qwen3")
    with pytest.raises(ValueError, match="remat='full'.*none, layer, dots"):
        forward(w, cfg, tokens, remat="full")
    with pytest.raises(ValueError, match="attention_impl='cudnn'.*xla, pallas"):
        forward(w, cfg, tokens, attention_impl="cudnn")
    with pytest.raises(ValueError, match="attention_impl"):
        forward_block(w, cfg, tokens, *_empty_history(cfg, 2), attention_impl="flash")
    with pytest.raises(ValueError, match="history_k/history_v"):
        forward_block(w, cfg, tokens, jnp.zeros((1, 2, 0, 2, 32)), jnp.zeros((1, 2, 0, 2, 32)))


def test_pallas_attention_matches_xla():
    """Interpret mode on the CPU: tiny shapes. Full forward with packed segments, and a block over history."""
    cfg = dataclasses.replace(PRESETS["tiny-qwen3"], num_layers=1)
    w = init(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 0, cfg.vocab_size)
    seg = jnp.asarray([[0] * 7 + [1] * 5])
    pos = jnp.asarray([list(range(7)) + list(range(5))])
    for kw in ({}, dict(positions=pos, segment_ids=seg)):
        np.testing.assert_allclose(forward(w, cfg, tokens, attention_impl="pallas", **kw),
                                   forward(w, cfg, tokens, **kw), atol=ATOL_F32, rtol=0)
    np.testing.assert_allclose(_blockwise(w, cfg, tokens, splits=(5, 7), attention_impl="pallas")[0],
                               forward(w, cfg, tokens), atol=ATOL_F32, rtol=0)
