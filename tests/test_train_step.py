"""Trainer building blocks: packing == unpacked twin, aggregation weights == algos.aggregate, NaN skip."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl import algos
from jaxrl.train.batch import Sample, pack, token_weights
from jaxrl.train.step import LossSpec, make_train_step, token_logp
from models import PRESETS, init

CFG = dataclasses.replace(PRESETS["tiny-char"], num_layers=2, hidden_size=64, intermediate_size=128)
ATOL_F32 = 1e-5


@pytest.fixture(scope="module")
def params():
    return init(jax.random.key(0), CFG)


def _samples(rng, n=6):
    return [Sample(rng.integers(3, 100, rng.integers(3, 12)).tolist(), rng.integers(3, 100, rng.integers(1, 20)).tolist(),
                   float(rng.normal())) for _ in range(n)]


def test_packed_logprobs_equal_unpacked(params):
    rng = np.random.default_rng(0)
    samples = _samples(rng)
    packed = pack(samples, np.ones(len(samples)), pack_len=48)
    assert packed["tokens"].shape[0] < len(samples)                 # several sequences share a row
    logp_packed = np.asarray(token_logp(params, CFG, {k: jnp.asarray(v) for k, v in packed.items()})[0])
    got = logp_packed[packed["loss_mask"] == 1]
    want = []
    for r in range(packed["tokens"].shape[0]):                      # same order as the mask walks rows
        for seg in sorted(set(packed["segment_ids"][r]) - {0}):
            cols = np.nonzero(packed["segment_ids"][r] == seg)[0]
            seq = packed["tokens"][r, cols]
            alone = pack([Sample(seq.tolist(), [], 0.0)], np.ones(1), pack_len=48)
            lp = np.asarray(token_logp(params, CFG, {k: jnp.asarray(v) for k, v in alone.items()})[0])[0]
            m = packed["loss_mask"][r, cols] == 1
            want.extend(lp[: len(cols)][m])
    np.testing.assert_allclose(got, np.asarray(want), atol=ATOL_F32)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_weights_reproduce_algos_aggregation(agg):
    rng = np.random.default_rng(1)
    lens = rng.integers(1, 9, 5)
    x = rng.normal(size=(5, 8)).astype(np.float32)
    mask = (np.arange(8)[None] < lens[:, None]).astype(np.float32)
    w = token_weights(agg, lens, global_tokens=int(lens.sum()), global_seqs=5, max_new_tokens=8)
    ours = float(np.sum(w[:, None] * x * mask))
    ref = float(algos.aggregate(jnp.asarray(x), jnp.asarray(mask), agg, norm_len=8))
    assert ours == pytest.approx(ref, rel=1e-5)


def test_nan_loss_skips_update(params):
    rng = np.random.default_rng(2)
    samples = _samples(rng, 4)
    samples[0].advantage = float("nan")
    batch = {k: jnp.asarray(v) for k, v in pack(samples, np.ones(4), pack_len=64).items()}
    tx = optax.adamw(1e-2)
    step = make_train_step(CFG, LossSpec(), tx, micro_batches=1)
    before = jax.tree.map(np.asarray, params)
    new, opt, m = step(jax.tree.map(jnp.copy, params), tx.init(params), batch)
    assert int(m["skipped"]) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(new)):
        np.testing.assert_array_equal(a, np.asarray(b))
    samples[0].advantage = 1.0
    batch = {k: jnp.asarray(v) for k, v in pack(samples, np.ones(4), pack_len=64).items()}
    new, _, m = step(jax.tree.map(jnp.copy, params), tx.init(params), batch)
    assert int(m["skipped"]) == 0
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(new)))


def test_micro_batches_equal_one_batch(params):
    rng = np.random.default_rng(3)
    samples = _samples(rng, 8)
    lens = np.asarray([len(s.response) for s in samples])
    w = token_weights("token-mean", lens, global_tokens=int(lens.sum()), global_seqs=8, max_new_tokens=20)
    batch = {k: jnp.asarray(v) for k, v in pack(samples, w, pack_len=32, n_rows=8).items()}
    tx = optax.sgd(1.0)
    outs = []
    for mb in (1, 4):
        step = make_train_step(CFG, LossSpec(), tx, micro_batches=mb)
        new, _, m = step(jax.tree.map(jnp.copy, params), tx.init(params), batch)
        outs.append((jax.tree.map(np.asarray, new), float(m["loss"])))
    assert outs[0][1] == pytest.approx(outs[1][1], rel=1e-5, abs=1e-7)
    for a, b in zip(jax.tree.leaves(outs[0][0]), jax.tree.leaves(outs[1][0])):
        np.testing.assert_allclose(a, b, atol=ATOL_F32)


def test_config_error_stops_before_any_work(tmp_path):
    import subprocess
    import sys

    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "jaxrl.train", f"run_dir={run}", "algo.agg=mean"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "algo.agg" in p.stderr and "token-mean" in p.stderr
    assert not run.exists()


def test_row_bucket():
    from jaxrl.train.batch import row_bucket

    for n in range(1, 300):
        b = row_bucket(n)
        assert n <= b <= max(n * 1.25, n + 1) and row_bucket(b) == b
    assert len({row_bucket(n) for n in range(33, 65)}) == 4
