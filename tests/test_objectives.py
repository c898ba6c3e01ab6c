"""The trainer's off-policy objectives (`algo.objective`: decoupled PPO with truncated importance weights, GSPO)
equal their pure definitions in `jaxrl.algos.offpolicy`: the packed micro-batch's loss and gradient (the fused
loss kernel and the chunked log-prob path) against the algos function on the same sequences unpacked."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import algos
from jaxrl.config.base import ConfigError
from jaxrl.config.loading import load_config
from jaxrl.config.train import AlgoSection, TrainConfig
from jaxrl.train.batch import Sample, pack
from jaxrl.train.rl import batch_weights
from jaxrl.train.step import LossSpec, loss_fn, token_logp
from models import PRESETS, init

CFG = dataclasses.replace(PRESETS["tiny-char"], num_layers=2, hidden_size=64, intermediate_size=128)
RTOL_F32 = 1e-5
PACK_LEN, T = 48, 20


@pytest.fixture(scope="module")
def params():
    return init(jax.random.key(0), CFG)


def batch(objective: str, agg: str):
    """Six sequences packed into rows, folded aggregation weights, and (row, col) of each response token [B, T]."""
    rng = np.random.default_rng(4)
    samples = [Sample(rng.integers(3, 100, rng.integers(3, 10)).tolist(), rng.integers(3, 100, rng.integers(2, T)).tolist(),
                      float(rng.normal())) for _ in range(6)]
    cfg = TrainConfig(algo=AlgoSection(objective=objective, agg=agg))
    w, _ = batch_weights(samples, cfg, max_new_tokens=T, fold=True)
    packed = pack(samples, w, PACK_LEN)
    rows, cols, mask = np.zeros((6, T), np.int32), np.zeros((6, T), np.int32), np.zeros((6, T), np.float32)
    for r in range(packed["tokens"].shape[0]):          # sample order in the rows: recover each from its segment
        for seg in sorted(set(packed["segment_ids"][r]) - {0}):
            at = np.nonzero((packed["segment_ids"][r] == seg) & (packed["loss_mask"][r] == 1))[0]
            i = next(k for k, s in enumerate(samples) if len(s.response) == len(at) and mask[k].sum() == 0
                     and np.array_equal(packed["targets"][r, at], s.response))
            rows[i, :len(at)], cols[i, :len(at)], mask[i, :len(at)] = r, at, 1
    adv = np.asarray([s.advantage for s in samples], np.float32)[:, None] * mask
    return {k: jnp.asarray(v) for k, v in packed.items()}, (rows, cols), jnp.asarray(mask), jnp.asarray(adv), rng


def unpack(x, where):
    rows, cols = where
    return x[rows, cols]


@pytest.mark.parametrize("fused_loss", [True, False])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_decoupled_ppo_in_the_trainer_equals_algos(params, fused_loss, mode):
    mb, where, mask, adv, rng = batch("decoupled", "token-mean")
    prox = token_logp(params, CFG, mb)[0]
    behav = prox + jnp.asarray(rng.normal(0, 0.5, prox.shape), jnp.float32) * mb["loss_mask"]    # older weights
    w, m = algos.importance_weights(prox, behav, mb["loss_mask"], cap=1.5, mode=mode)
    assert 0 < float(m["is_truncated_frac"]) < 0.5
    spec = LossSpec(clip_low=0.2, clip_high=0.28, fused_loss=fused_loss)
    ours = lambda p: loss_fn(p, CFG, spec, {**mb, "old_logp": prox, "is_weight": w})[0]  # noqa: E731

    def ref(p):
        logp = unpack(token_logp(p, CFG, mb)[0], where)
        return algos.decoupled_policy_loss(logp, unpack(prox, where), unpack(behav, where), adv, mask, clip_low=0.2,
                                           clip_high=0.28, is_cap=1.5, is_mode=mode)[0]

    np.testing.assert_allclose(ours(params), ref(params), rtol=RTOL_F32)
    for a, b in zip(jax.tree.leaves(jax.grad(ours)(params)), jax.tree.leaves(jax.grad(ref)(params))):
        np.testing.assert_allclose(a, b, rtol=RTOL_F32, atol=1e-7)


@pytest.mark.parametrize("fused_loss", [True, False])
def test_gspo_in_the_trainer_equals_algos(params, fused_loss):
    mb, where, mask, adv, rng = batch("gspo", "seq-mean-token-mean")
    cur = token_logp(params, CFG, mb)[0]
    old = cur + jnp.asarray(rng.normal(0, 1e-2, cur.shape), jnp.float32) * mb["loss_mask"]
    spec = LossSpec(clip_low=3e-4, clip_high=4e-4, fused_loss=fused_loss)
    seq_ratio = algos.packed_sequence_ratio(cur, old, mb["segment_ids"], mb["loss_mask"])
    ours = lambda p: loss_fn(p, CFG, spec, {**mb, "old_logp": old, "seq_ratio": seq_ratio})[0]  # noqa: E731

    def ref(p):
        logp = unpack(token_logp(p, CFG, mb)[0], where)
        return algos.gspo_policy_loss(logp, unpack(old, where), adv, mask, clip_low=3e-4, clip_high=4e-4)

    got, (want, metrics) = ours(params), ref(params)
    assert 0 < float(metrics["clip_frac"]) < 1          # some sequences clipped, some not
    np.testing.assert_allclose(got, want, rtol=RTOL_F32)
    for a, b in zip(jax.tree.leaves(jax.grad(ours)(params)), jax.tree.leaves(jax.grad(lambda p: ref(p)[0])(params))):
        np.testing.assert_allclose(a, b, rtol=RTOL_F32, atol=1e-7)


@pytest.mark.parametrize("args, key, match", [
    (["algo.objective=gspo"], "algo.agg", "seq-mean-token-mean"),
    (["algo.objective=sppo"], "algo.objective", "valid choices"),
    (["algo.objective=decoupled", "algo.is_correction=clip"], "algo.is_correction", "valid choices"),
    (["algo.objective=decoupled", "algo.is_cap=0"], "algo.is_cap", "must be > 0"),
    (["algo.objective=decoupled", "trainer.micro_batch_tokens=null"], "trainer.micro_batch_tokens", "proximal"),
    (["algo.objective=decoupled", "trainer.stream.enabled=true", "engine.instances=2"], "trainer.stream.enabled",
     "proximal"),
    (["trainer.async_steps=1"], "trainer.async_steps", r"renamed trainer.max_staleness"),
    (["trainer.swap_step=4", "placement=disaggregated"], "trainer.swap_step", "needs trainer.max_staleness >= 1"),
    (["trainer.swap_kv=migrate"], "trainer.swap_kv", "valid choices"),
])
def test_objective_config_refusals(args, key, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(TrainConfig, args)
    assert e.value.key == key
