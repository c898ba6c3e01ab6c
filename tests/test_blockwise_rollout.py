"""`trainer.kv_source=rollout`: the engine's K/V (exported on the devices), staged on the train mesh and packed
like a micro-batch, against the K/V recomputed by the train forward; and the blockwise gradients from either
source. The differences are reported (-s prints them) and bounded in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import train as train_cfg
from jaxrl.config.base import ConfigError
from jaxrl.config.loading import load_config
from jaxrl.rollout import SamplingParams, SequenceKV, generate
from jaxrl.train.batch import Sample, pack, pack_rows
from jaxrl.train.blockwise import BlockwiseUpdater, recompute_kv
from jaxrl.train.optim import make_optimizer
from jaxrl.config.train import OptimSection
from jaxrl.train.rollout_kv import KVStager
from jaxrl.train.step import LossSpec
from models import PRESETS, init
from sharding import Layout

KV_ATOL_F32 = 1e-5         # engine vs train forward K/V (float32): different kernels, the same math
GRAD_REL_F32 = 1e-5        # blockwise gradients, rollout vs recomputed cache, per tensor vs its max
SPEC = LossSpec(clip_high=0.28, kl_coef=0.0, entropy_coef=0.01)
CFG = PRESETS["tiny-qwen3"]
ROWS, PACK = 6, 32


@pytest.fixture(scope="module")
def setup():
    params = init(jax.random.key(5), CFG)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, CFG.vocab_size, n).tolist() for n in (5, 9, 4, 7, 6, 3)]
    outs = generate(CFG, params, prompts, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, n=2,
                                                         return_kv=True), page_size=4, num_pages=64)
    samples = [Sample(o.prompt, o.tokens, float(rng.normal())) for o in outs]
    lengths = [len(s.prompt) + len(s.response) for s in samples]
    rows = pack_rows(lengths, PACK)
    assert len(rows) <= ROWS and max(len(r) for r in rows) >= 3            # several sequences per row
    w = np.full(len(samples), 1.0 / sum(len(s.response) for s in samples))
    batch = {k: jnp.asarray(v) for k, v in pack(samples, w, PACK, n_rows=ROWS, rows=rows).items()}
    mesh = Layout(fsdp=2).make_mesh(jax.devices()[:2])
    stager = KVStager(CFG, mesh, capacity_tokens=sum(o.kv.k.shape[1] for o in outs), dtype=jnp.float32)
    offsets = stager.stage([o.kv for o in outs])
    idx = stager.index(rows, offsets, [o.kv.length for o in outs], lengths, 0, ROWS, PACK)
    return params, outs, batch, rows, lengths, stager.packed(idx), idx, stager.zero


def test_exports_stay_on_the_devices(setup):
    _, outs, *_ = setup
    for o in outs:
        assert isinstance(o.kv, SequenceKV) and isinstance(o.kv.k, jax.Array)
        assert o.kv.length == len(o.prompt) + len(o.tokens) - 1


def test_packed_rollout_kv_equals_recomputed(setup):
    params, outs, batch, rows, lengths, (k, v), idx, zero = setup
    rk, rv = jax.jit(lambda p, b: recompute_kv(p, b, cfg=CFG, spec=SPEC))(params, batch)
    assert k.shape == rk.shape == (CFG.num_layers, ROWS, PACK, CFG.num_kv_heads, CFG.head_dim)
    cached = idx != zero
    assert cached.sum() == sum(o.kv.length for o in outs)
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b))[:, cached].max()) for a, b in ((k, rk), (v, rv)))
    print(f"ROLLOUT_KV max |engine - train forward| over {int(cached.sum())} cached positions: {diff:.2e}")
    assert diff <= KV_ATOL_F32
    assert np.all(np.asarray(k)[:, ~cached] == 0)          # padding and each sequence's last token: the zero slot


def test_blockwise_gradients_rollout_vs_recompute(setup):
    params, outs, batch, rows, lengths, kv, *_ = setup
    tx = make_optimizer(OptimSection(lr=1e-2), 10)[0]
    from_rollout = BlockwiseUpdater(CFG, SPEC, tx, block_size=5, kv_source="rollout")
    g_r, s_r = from_rollout.gradients(params, [batch], kv=[jax.tree.map(lambda x: jnp.pad(
        x, ((0, 0), (0, 0), (0, 3), (0, 0), (0, 0))), kv)])            # rows padded 32 -> 35 (blocks of 5)
    g_c, s_c = BlockwiseUpdater(CFG, SPEC, tx, block_size=5).gradients(params, [batch])
    err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
              for a, b in zip(jax.tree.leaves(g_r), jax.tree.leaves(g_c)))
    print(f"ROLLOUT_KV blockwise gradient, rollout vs recomputed cache: max relative {err:.2e}")
    assert err <= GRAD_REL_F32
    assert float(s_r["loss"]) == pytest.approx(float(s_c["loss"]), rel=1e-5)
    with pytest.raises(ValueError, match="needs the rollout's K/V"):
        from_rollout.gradients(params, [batch])


@pytest.mark.parametrize("args,key,reason", [
    (["trainer.kv_source=rollout"], "trainer.kv_source", "backward=blockwise only"),
    (["trainer.backward=blockwise", "trainer.kv_source=rollout", "algo.mini_batches=2"], "trainer.kv_source",
     "off-policy"),
    (["trainer.backward=blockwise", "trainer.kv_source=rollout", "distributed.num_processes=2",
      "trainer.repartition=tokens"], "trainer.repartition", "K/V stay on the process"),
    (["trainer.backward=blockwise", "trainer.micro_batch_tokens=null"], "trainer.backward", "micro_batch_tokens"),
    (["trainer.backward=sideways"], "trainer.backward", "full, blockwise"),
    (["trainer.block_size=0"], "block_size", ">= 1"),
])
def test_config_refusals_name_the_key_and_reason(args, key, reason):
    with pytest.raises(ConfigError) as info:
        load_config(train_cfg.TrainConfig, args)
    assert key in str(info.value) and reason in str(info.value)
