"""MetroRLHF's blockwise backward (`jaxrl.train.blockwise`) against its unoptimised twin, `grad_step` on the
whole rows: the same gradient sums and stats (max relative error <= 1e-5 per tensor, float32), over tiny
Qwen3 (q/k-norm), Qwen2 (bias), Llama-3 (rope scaling), packed rows with several sequences each, block
sizes that do and do not divide the row, a sliding window, and the zero-reward shortcut's skip counts."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl.config.train import AlgoSection, OptimSection, TrainConfig
from jaxrl.train import blockwise
from jaxrl.train.batch import Sample, pack
from jaxrl.train.blockwise import BlockwiseUpdater, plan_blocks
from jaxrl.train.history_attention import stored_history
from jaxrl.train.optim import init_state, make_optimizer
from jaxrl.train.rl import batch_weights
from jaxrl.train.step import STATS, LossSpec, make_grad_step, token_logp
from models import PRESETS, abstract, init, logical_axes
from sharding import Layout, ShardingRules, shardings_for

REL_F32 = 1e-5            # max |blockwise - full| / max |full| per tensor (float32)
SPEC = LossSpec(clip_high=0.28, dual_clip=3.0, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
MODELS = {"qwen3": PRESETS["tiny-qwen3"], "qwen2": PRESETS["tiny-qwen2"], "llama": PRESETS["tiny-llama"],
          "qwen3-window": dataclasses.replace(PRESETS["tiny-qwen3"], sliding_window=5)}
ROWS, PACK = 4, 24


def _tx():
    return make_optimizer(OptimSection(lr=1e-2), 10)[0]


def rl_batch(cfg, params, lengths, *, rows=ROWS, pack_len=PACK, seed=0):
    """Packed rows of GRPO samples ((prompt, response) lengths), off-policy old and reference log-probs."""
    rng = np.random.default_rng(seed)
    samples = [Sample(rng.integers(3, cfg.vocab_size, p).tolist(), rng.integers(3, cfg.vocab_size, r).tolist(),
                      float(rng.normal())) for p, r in lengths]
    w, _ = batch_weights(samples, TrainConfig(algo=AlgoSection(agg="seq-mean-token-mean")), max_new_tokens=16,
                         fold=True)
    batch = {k: jnp.asarray(v) for k, v in pack(samples, w, pack_len=pack_len, n_rows=rows).items()}
    logp = np.asarray(token_logp(params, cfg, batch)[0])
    batch["old_logp"] = jnp.asarray(logp + rng.normal(0, 0.3, logp.shape).astype(np.float32))
    batch["ref_logp"] = jnp.asarray(logp + rng.normal(0, 0.3, logp.shape).astype(np.float32))
    return batch


# several sequences per row (segments), ragged lengths, every row filled to within a few tokens of PACK
PACKED = [(5, 6), (4, 8), (3, 5), (6, 4), (7, 9), (3, 4), (5, 7), (2, 5), (4, 3)]


def assert_grads_close(got, want, rel=REL_F32, zero_ok=False):
    """Per tensor max |got - want| <= rel * max |want|. A tensor whose full gradient is exactly zero (only
    allowed with `zero_ok`) must be zero blockwise to within rel * the largest gradient of any tensor: the
    block attention's flash backward forms dS = P (dP - rowsum(dO O)), whose analytic zeros (W = 1: one
    visible key, softmax 1) cancel to rounding (~1e-10 here), not bitwise as autodiff of the softmax does."""
    (g, s), (wg, ws) = got, want
    top = max(np.abs(np.asarray(b)).max() for b in jax.tree.leaves(wg))
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(wg)):
        a, b = np.asarray(a), np.asarray(b)
        scale = np.abs(b).max()
        if scale == 0:
            assert zero_ok and np.abs(a).max() <= rel * top, np.abs(a).max() / top
            continue
        assert np.abs(a - b).max() <= rel * scale, (np.abs(a - b).max() / scale)
    for k in ws:
        assert float(s[k]) == pytest.approx(float(ws[k]), rel=1e-5, abs=1e-6), k


@pytest.fixture(scope="module")
def cases():
    out = {}
    for name, cfg in MODELS.items():
        params = init(jax.random.key(1), cfg)
        batch = rl_batch(cfg, params, PACKED)
        assert int(batch["segment_ids"].max()) >= 3          # really packed
        out[name] = (cfg, params, batch, make_grad_step(cfg, SPEC)(params, batch))
    return out


@pytest.mark.parametrize("block", [3, 8, 16, PACK])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_blockwise_gradients_equal_full(cases, name, block):
    cfg, params, batch, full = cases[name]
    up = BlockwiseUpdater(cfg, SPEC, _tx(), block_size=block)
    got = up.gradients(params, [batch])
    assert_grads_close(got, full)
    n = -(-PACK // block)
    assert up.last["blocks"] + up.last["skipped"] == n


@pytest.mark.parametrize("name", ["qwen3", "qwen3-window"])
def test_attention_pairs_skip_inside_the_block_step(cases, monkeypatch, name):
    """Chunk pairs of 4 (so each 8-token block's queries skip the key chunks after it, and the windowed
    model those before its window, at run time): the same gradients."""
    monkeypatch.setattr(blockwise, "PAIR_BLOCK", 4)
    cfg, params, batch, full = cases[name]
    assert_grads_close(BlockwiseUpdater(cfg, SPEC, _tx(), block_size=8).gradients(params, [batch]), full)


def test_unfused_loss_path_and_two_micro_batches(cases):
    """The chunked log-prob loss path, and sums over two micro-batches (rows split), match too."""
    cfg, params, batch, _ = cases["qwen3"]
    spec = dataclasses.replace(SPEC, fused_loss=False)
    parts = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    grad = make_grad_step(cfg, spec)
    want = grad(params, parts[1], grad(params, parts[0]))
    got = BlockwiseUpdater(cfg, spec, _tx(), block_size=5).gradients(params, parts)
    assert_grads_close(got, want)


def test_plan_hand_counts():
    # no window: every block up to the last with loss runs; trailing loss-free blocks are skipped
    assert plan_blocks([False, True, False, True, False, False], 4, None, 2) == [3, 2, 1, 0]
    # W = 3, 2 layers: reach 2·(3 - 1) = 4 before block 2's start (8): keys 4.. -> blocks 1 and 0 (end 4: no)
    assert plan_blocks([False, False, True, False], 4, 3, 2) == [2, 1]
    # W = 1: queries see only themselves, so only blocks with loss tokens run
    assert plan_blocks([False, True, False, True, False], 4, 1, 2) == [3, 1]
    # the reach grows with the layer count: 3 layers of W = 3 reach 6 back from 8 -> keys 2..: block 0 too
    assert plan_blocks([False, False, True, False], 4, 3, 3) == [2, 1, 0]
    assert plan_blocks([False, False, False], 4, None, 2) == []


def test_shortcut_skips_trailing_blocks_exactly():
    """Rows of 40 tokens holding one 21-token sequence each (no two fit a row), loss targets at 8..19: with
    T = 4, blocks 5..9 hold no loss token and no later processed block, so 5 of the 10 blocks are skipped
    (hand count), and the gradient is still the full one; the windowed model (W = 5) chains back through
    every earlier block."""
    cfg = MODELS["qwen3-window"]
    params = init(jax.random.key(2), cfg)
    batch = rl_batch(cfg, params, [(9, 12), (10, 11), (8, 13)], rows=3, pack_len=40)
    last = int(np.nonzero(np.asarray(batch["loss_mask"]).any(0))[0].max())
    assert last == 19 and int(batch["segment_ids"].max()) == 1      # the hand count below depends on it
    up = BlockwiseUpdater(cfg, SPEC, _tx(), block_size=4)
    got = up.gradients(params, [batch])
    assert up.last == {"blocks": 5, "skipped": 5}
    assert_grads_close(got, make_grad_step(cfg, SPEC)(params, batch))


def test_window_one_skips_every_loss_free_block_exactly():
    """W = 1 (each query sees only itself): the prompt blocks have no loss and nothing attends to them, so
    only blocks with response tokens run (hand count) and the gradient is still exact."""
    cfg = dataclasses.replace(PRESETS["tiny-qwen3"], sliding_window=1)
    params = init(jax.random.key(3), cfg)
    batch = rl_batch(cfg, params, [(12, 4), (12, 4)], rows=2, pack_len=16)   # response targets at 11..14
    up = BlockwiseUpdater(cfg, SPEC, _tx(), block_size=4)
    got = up.gradients(params, [batch])
    assert up.last == {"blocks": 2, "skipped": 2}            # blocks 3 (12..15) and 2 (8..11) run
    # one visible key per query: softmax = 1, so the key projection's gradient is exactly zero (both ways)
    assert_grads_close(got, make_grad_step(cfg, SPEC)(params, batch), zero_ok=True)


def _long_prompt_batch(cfg, params):
    """Two rows of a 20-token prompt and a 4-token response: loss targets at positions 19..22."""
    return rl_batch(cfg, params, [(20, 4), (20, 4)], rows=2, pack_len=24)


def test_shortcut_skips_prompt_blocks_beyond_the_receptive_field_exactly():
    """W = 5, 2 layers, T = 2: the answer (loss from position 19, block 9) depends on positions from
    18 - 2·4 = 10 on, so blocks 8..5 run and 4..0 are skipped (hand count): 7 of 12 run, exactly."""
    cfg = dataclasses.replace(PRESETS["tiny-qwen3"], sliding_window=5)
    params = init(jax.random.key(4), cfg)
    batch = _long_prompt_batch(cfg, params)
    up = BlockwiseUpdater(cfg, SPEC, _tx(), block_size=2)
    got = up.gradients(params, [batch])
    assert up.last == {"blocks": 7, "skipped": 5}
    assert_grads_close(got, make_grad_step(cfg, SPEC)(params, batch))


def test_single_window_reach_is_not_exact(monkeypatch):
    """Negative control for the docstring's claim: the paper's reach of one window (L_ctx = shift - W from
    the blocks with loss tokens: what its quoted saving needs) skips block 5 (positions 10, 11), which the
    2-layer model's answer depends on through the second layer, and the gradient changes."""
    cfg = dataclasses.replace(PRESETS["tiny-qwen3"], sliding_window=5)
    params = init(jax.random.key(4), cfg)
    batch = _long_prompt_batch(cfg, params)

    def one_window(has_loss, block, window, layers):
        return plan_blocks(has_loss, block, window + 1, 1)      # reach W instead of layers · (W - 1)

    monkeypatch.setattr(blockwise, "plan_blocks", one_window)
    up = BlockwiseUpdater(cfg, SPEC, _tx(), block_size=2)
    got, _ = up.gradients(params, [batch])
    assert up.last == {"blocks": 6, "skipped": 6}
    want, _ = make_grad_step(cfg, SPEC)(params, batch)
    err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
              for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    assert err > 100 * REL_F32


def test_update_is_apply_of_the_blockwise_gradients_and_compiles_nothing_after_warm(cases):
    """update() = the shared apply_update of gradients() (bitwise: the same executables); its loss is the full
    step's. warm() compiles every executable ahead, so update() compiles nothing. (Weights after Adam's
    first step are not compared with the full step's: lr·g/(|g| + eps) magnifies float rounding in the
    gradient entries near zero; the gradients themselves are compared above.)"""
    cfg, params, batch, (_, full_stats) = cases["llama"]
    tx = _tx()
    up = BlockwiseUpdater(cfg, SPEC, tx, block_size=7)
    up.warm(params, tx.init(params), batch)
    before = up.cache.compiles
    new_p, _, m = up.update(jax.tree.map(jnp.copy, params), tx.init(params), [batch])
    assert up.cache.compiles == before
    g, s = up.gradients(params, [batch])
    want_p, _, _ = up.apply(jax.tree.map(jnp.copy, params), tx.init(params), g, 1.0, s)
    for a, b in zip(jax.tree.leaves(new_p), jax.tree.leaves(want_p)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(m["loss"]) == pytest.approx(float(full_stats["loss"]), rel=1e-5)
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(new_p),
                                                                                jax.tree.leaves(params)))


def test_bfloat16_history_stored_as_bits_gives_the_same_gradients(cases, monkeypatch):
    """On XLA:CPU a bfloat16 cache goes to the block step as its raw bits (`stored_history`, to stop XLA
    hoisting a float32 copy of all of C out of the layer loop): the gradients are bitwise those of the
    plain bfloat16 cache (a reinterpretation, no arithmetic)."""
    cfg, params, batch, _ = cases["qwen3"]
    pb = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    got = BlockwiseUpdater(cfg, SPEC, _tx(), block_size=8).gradients(pb, [batch])
    monkeypatch.setattr(blockwise, "stored_history", lambda kv: kv)
    want = BlockwiseUpdater(cfg, SPEC, _tx(), block_size=8).gradients(pb, [batch])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_block_step_temporaries_do_not_copy_the_cache():
    """The block step keeps no per-layer copy of C or of its gradient (`history_attention`): doubling the
    history grows the compiled temporaries by less than one bfloat16 copy of the added C over all layers
    (autodiff through the merged [history; block] K/V grew them by ~16x that). Compile only, 8 layers."""
    cfg = dataclasses.replace(MODELS["qwen3"], num_layers=8)
    fields = {"tokens": jnp.int32, "positions": jnp.int32, "segment_ids": jnp.int32, "targets": jnp.int32,
              "loss_mask": jnp.int32, "advantages": jnp.float32, "weights": jnp.float32, "ref_logp": jnp.float32,
              "old_logp": jnp.float32}
    p = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16), abstract(cfg))
    acc = (p, {k: jax.ShapeDtypeStruct((), jnp.float32) for k in STATS})
    step = jax.jit(functools.partial(blockwise.block_step, cfg=cfg, spec=SPEC, block=128), donate_argnums=(4, 5, 6))

    def temp_and_cache(P):
        mb = {k: jax.ShapeDtypeStruct((1, P), dt) for k, dt in fields.items()}
        c = jax.ShapeDtypeStruct((cfg.num_layers, 1, P, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
        hk = jax.eval_shape(stored_history, c)
        gk = jax.ShapeDtypeStruct(hk.shape, jnp.float32)
        exe = step.lower(p, mb, hk, hk, gk, gk, acc, jax.ShapeDtypeStruct((), jnp.int32)).compile()
        return exe.memory_analysis().temp_size_in_bytes, 2 * c.size * 2

    (t1, c1), (t2, c2) = temp_and_cache(2048), temp_and_cache(4096)
    assert t2 - t1 < c2 - c1, (t2 - t1) / (c2 - c1)


@pytest.mark.parametrize("layout", [Layout(fsdp=4), Layout(fsdp=2, tp=2)], ids=lambda l: l.name)
def test_sharded_train_layout_equals_one_device(cases, layout):
    """On a sharded train mesh (weights by the train rules, rows over the data axes) the blockwise gradients
    equal the single-device full step's, every buffer lives on the mesh (∇C's rows on the data axes, the
    gradient sums in the weights' own shardings), and warm() compiles every executable update() runs."""
    cfg, params, batch, full = cases["qwen3"]
    mesh = layout.make_mesh(jax.devices()[:layout.size])
    shardings = shardings_for(logical_axes(cfg), mesh, ShardingRules.train(cfg, layout))
    sp = jax.device_put(params, shardings)
    rows = NamedSharding(mesh, P(("dp", "fsdp"), None))
    sb = {k: jax.device_put(v, rows) for k, v in batch.items()}
    tx = _tx()
    opt = lambda: init_state(tx, sp, shardings, mesh)          # noqa: E731  (the trainer's optimizer state)
    up = BlockwiseUpdater(cfg, SPEC, tx, block_size=5)          # 24 -> 25: the rows are padded too
    up.warm(sp, opt(), sb)
    before = up.cache.compiles
    got = up.gradients(sp, [sb])
    assert up.cache.compiles == before
    assert_grads_close(got, full)
    for g, p in zip(jax.tree.leaves(got[0]), jax.tree.leaves(sp)):
        assert g.sharding.is_equivalent_to(p.sharding, g.ndim)
    hk, _ = up.cache("kv", up.kv_fn, sp, up._prepare(sb), sharding=blockwise.history_sharding(rows))
    assert hk.sharding.is_equivalent_to(NamedSharding(mesh, P(None, ("dp", "fsdp"))), hk.ndim)
    _, _, m = up.update(jax.tree.map(jnp.copy, sp), opt(), [sb])
    assert up.cache.compiles == before and int(m["skipped"]) == 0
