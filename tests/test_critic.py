"""PPO with a critic: the packed value loss against its unpacked twin (loss and gradients), pack/unpack of
per-token fields, GAE against a hand-written loop, local rows of global arrays, the Critic's update and
warm-up, and the config and graph checks of algo.advantage=gae / algo.kl_in_reward.

End-to-end PPO runs (learning on the quickstart task, resume, 2 processes == 1, separate pools) are in
test_train_e2e.py, test_train_processes.py and test_train_pools.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl import algos
from jaxrl.config.base import ConfigError, decode
from jaxrl.config.train import TrainConfig
from jaxrl.flow import GraphError
from jaxrl.flow.runner import Flow
from jaxrl.train.batch import Sample, pack, pack_rows, unpack
from jaxrl.train.critic import Critic, gae, token_values, value_loss_sum
from jaxrl.train.distributed import local_rows
from jaxrl.train.rl import batch_weights
from jaxrl.train.step import LossSpec
from models import PRESETS, init, logical_axes
from sharding import Layout, ShardingRules, shardings_for

CFG = dataclasses.replace(PRESETS["tiny-char"], num_layers=2, hidden_size=64, intermediate_size=128)
ATOL_F32 = 1e-5
MAX_NEW = 20


def _cfg(**algo):
    c = TrainConfig()
    return dataclasses.replace(c, algo=dataclasses.replace(c.algo, **algo),
                               rollout=dataclasses.replace(c.rollout, max_new_tokens=MAX_NEW))


@pytest.fixture(scope="module")
def params():
    return init(jax.random.key(0), CFG)


def _critic_params(params):
    return {"trunk": params, "head": {"w": jax.random.normal(jax.random.key(1), (CFG.hidden_size,)) * 0.3,
                                      "b": jnp.asarray(0.1, jnp.float32)}}


def _samples(rng, n=7):
    return [Sample(rng.integers(3, 100, rng.integers(3, 12)).tolist(), rng.integers(3, 100, rng.integers(1, MAX_NEW)).tolist())
            for _ in range(n)]


def _per_token(rng, samples, scale=1.0):
    return [(rng.normal(size=len(s.response)) * scale).astype(np.float32) for s in samples]


def _padded(per_sample):
    out = np.zeros((len(per_sample), MAX_NEW), np.float32)
    for i, x in enumerate(per_sample):
        out[i, :len(x)] = x
    return out


def test_unpack_inverts_pack_for_token_fields():
    rng = np.random.default_rng(0)
    samples = _samples(rng, 9)
    fields = {"returns": _per_token(rng, samples), "old_values": _per_token(rng, samples)}
    rows = pack_rows([len(s.prompt) + len(s.response) for s in samples], 48)
    packed = pack(samples, np.ones(len(samples)), 48, n_rows=len(rows) + 2, rows=rows, token_fields=fields)
    assert len(rows) < len(samples)               # several sequences share a row
    for name, want in fields.items():
        got = unpack(packed[name], rows, samples)
        assert [len(g) for g in got] == [len(s.response) for s in samples]
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        assert packed[name][packed["loss_mask"] == 0].tolist() == [0.0] * int((packed["loss_mask"] == 0).sum())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_packed_value_loss_and_gradients_equal_the_unpacked_twin(params, agg):
    """The critic's loss over packed rows with the policy's folded token weights == `algos.value_loss` with
    that aggregation over each sequence run alone (values read back per response token); the gradients
    (trunk and head) agree within float32 rounding; value clipping is live (some tokens clipped)."""
    rng = np.random.default_rng(1)
    samples = _samples(rng)
    returns, old = _per_token(rng, samples), _per_token(rng, samples, 0.5)
    weights, _ = batch_weights(samples, _cfg(agg=agg), MAX_NEW, fold=True)
    packed = pack(samples, weights, 48, token_fields={"returns": returns, "old_values": old})
    mb = {k: jnp.asarray(v) for k, v in packed.items()}
    cp = _critic_params(params)

    def packed_loss(p):
        return value_loss_sum(p, mb, cfg=CFG, clip=0.2)

    def unpacked_loss(p):
        vals = []
        for s in samples:
            alone = {k: jnp.asarray(v) for k, v in pack([s], np.ones(1), 48).items()}
            v = token_values(p, alone, cfg=CFG)[0]
            n, q = len(s.prompt) + len(s.response), len(s.prompt)
            vals.append(jnp.pad(v[q - 1:n - 1], (0, MAX_NEW - len(s.response))))
        mask = _padded([np.ones(len(s.response)) for s in samples])
        return algos.value_loss(jnp.stack(vals), _padded(old), _padded(returns), mask, clip=0.2, agg=agg,
                                norm_len=MAX_NEW)

    (got, sums), got_g = jax.value_and_grad(packed_loss, has_aux=True)(cp)
    (want, metrics), want_g = jax.value_and_grad(unpacked_loss, has_aux=True)(cp)
    assert float(got) == pytest.approx(float(want), rel=ATOL_F32)
    assert 0 < float(sums["clipped"]) < float(sums["tokens"])
    assert float(sums["clipped"]) / float(sums["tokens"]) == pytest.approx(float(metrics["vf_clip_frac"]), rel=1e-6)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        scale = max(float(np.max(np.abs(np.asarray(b)))), 1.0)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=ATOL_F32, atol=ATOL_F32 * scale)


def _gae_loop(r, v, gamma, lam):
    """GAE by its definition over one sequence: δ_t = r_t + γ·V_{t+1} − V_t (V after the end = 0),
    A_t = Σ_l (γλ)^l δ_{t+l}."""
    n = len(r)
    nxt = np.append(v[1:], 0.0)
    delta = r + gamma * nxt - v
    adv = np.array([sum((gamma * lam) ** (l - t) * delta[l] for l in range(t, n)) for t in range(n)])
    return adv, adv + v


def test_gae_matches_its_definition_and_whitens_over_the_batch():
    rng = np.random.default_rng(2)
    lens = [3, 1, 7, 12, 5]
    rewards = rng.normal(size=len(lens)).astype(np.float32)
    values = [rng.normal(size=n).astype(np.float32) for n in lens]
    kl = [np.abs(rng.normal(size=n)).astype(np.float32) * 0.1 for n in lens]
    cfg = _cfg(advantage="gae", gamma=0.9, lam=0.8, kl_coef=0.5, kl_in_reward=True)
    adv, ret = gae(cfg, rewards, lens, values, kl)
    raw = []
    for i, n in enumerate(lens):
        r = -0.5 * kl[i].astype(np.float64)
        r[-1] += rewards[i]
        a, want_ret = _gae_loop(r, values[i].astype(np.float64), 0.9, 0.8)
        np.testing.assert_allclose(ret[i], want_ret, rtol=1e-5, atol=1e-6)
        raw.append(a)
    flat = np.concatenate(raw)
    np.testing.assert_allclose(np.concatenate(adv), (flat - flat.mean()) / np.sqrt(flat.var() + 1e-8), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("layout", [Layout(fsdp=8), Layout(fsdp=4, tp=2), Layout(dp=2, fsdp=2, tp=2)])
def test_local_rows_inverts_process_local_assembly(layout):
    """Also for a computed array laid out otherwise (replicated, or split by columns): it is read on the
    rows' sharding. (Reading a replicated array's addressable rows as this process's is the bug this
    guards: with 2 processes the second one read the first one's rows; test_train_processes.py's PPO runs.)"""
    mesh = layout.make_mesh(jax.devices())
    x = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    rows = NamedSharding(mesh, P(("dp", "fsdp"), None))
    g = jax.make_array_from_process_local_data(rows, x, x.shape)
    np.testing.assert_array_equal(local_rows(g, rows), x)
    for other in (P(), P(None, ("dp", "fsdp"))):
        moved = jax.jit(lambda a: a * 1, out_shardings=NamedSharding(mesh, other))(g)
        np.testing.assert_array_equal(local_rows(moved, rows), x)


def test_critic_update_fits_returns_and_warm_up_compiles_everything(params):
    """After `warm` the value pass and the updates run without compiling; repeated updates on one batch fit
    the returns (the value loss falls, explained variance rises) on an fsdp x tp mesh."""
    layout = Layout(fsdp=4, tp=2)
    mesh = layout.make_mesh(jax.devices())
    shardings = shardings_for(logical_axes(CFG), mesh, ShardingRules.train(CFG, layout))
    cfg = _cfg(advantage="gae")
    # value_clip off: with old values fixed at 0, the clip would hold V within 0 ± 0.2 of where it started
    critic = Critic(CFG, dataclasses.replace(cfg.critic, value_clip=None,
                                             optim=dataclasses.replace(cfg.critic.optim, lr=3e-3)),
                    cfg.trainer, mesh, shardings, total_updates=30)
    critic.init(jax.device_put(params, shardings))
    assert float(jnp.abs(critic.params["head"]["w"]).max()) == 0.0
    rng = np.random.default_rng(3)
    samples = _samples(rng, 8)
    returns = [np.full(len(s.response), float(i % 3), np.float32) for i, s in enumerate(samples)]
    weights, _ = batch_weights(samples, cfg, MAX_NEW, fold=True)
    rows = pack_rows([len(s.prompt) + len(s.response) for s in samples], 48)
    sharding = NamedSharding(mesh, P(("dp", "fsdp"), None))
    old = [np.zeros(len(s.response), np.float32) for s in samples]
    packed = pack(samples, weights, 48, n_rows=16, rows=rows, token_fields={"returns": returns, "old_values": old})
    mbs = [{k: jax.device_put(v[i:i + 8], sharding) for k, v in packed.items()} for i in (0, 8)]   # 2 micro-batches
    n = critic.warm({k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in mbs[0].items()})
    assert n >= 4
    compiles = critic.cache.compiles
    first = critic.update(mbs)
    for _ in range(25):
        last = critic.update(mbs)
    v = unpack(np.concatenate([local_rows(critic.values(mb), sharding) for mb in mbs]), rows, samples)
    assert critic.cache.compiles == compiles            # nothing compiled after the warm-up
    assert last["critic/vf_loss"] < 0.2 * first["critic/vf_loss"]
    assert last["critic/explained_var"] > 0.8 > first["critic/explained_var"]
    assert first["critic/value_mean"] == 0.0 and first["critic/skipped"] == 0
    assert np.mean([abs(a.mean() - r[0]) for a, r in zip(v, returns)]) < 0.3


@pytest.mark.parametrize("changes, key", [
    (dict(trainer={"stream": {"enabled": True}}), "trainer.stream.enabled"),
    (dict(trainer={"micro_batch_tokens": None}), "trainer.micro_batch_tokens"),
])
def test_ppo_refuses_modes_without_a_critic_step(changes, key):
    raw = {"algo": {"advantage": "gae", "group_size": 1}, **changes}
    with pytest.raises(ConfigError) as e:
        decode(TrainConfig, raw)
    assert e.value.key == key and "algo.advantage=gae" in e.value.message


def test_ppo_runs_disaggregated_and_async_but_kl_in_reward_not_async():
    """The critic runs on the train pool (disaggregated: after the rollout, not streamed, since GAE needs the
    whole batch; one-step-async: its update before the policy's goes to the pool); the KL in the reward is the
    sampling policy's, which one-step-async no longer holds: refused there, naming the key."""
    ppo = {"algo": {"advantage": "gae", "group_size": 1}, "placement": "disaggregated"}
    decode(TrainConfig, ppo)
    decode(TrainConfig, {**ppo, "trainer": {"max_staleness": 1}})
    decode(TrainConfig, {**ppo, "algo": {**ppo["algo"], "kl_in_reward": True, "kl_coef": 0.1}})
    with pytest.raises(ConfigError) as e:
        decode(TrainConfig, {**ppo, "algo": {**ppo["algo"], "kl_in_reward": True, "kl_coef": 0.1},
                             "trainer": {"max_staleness": 1}})
    assert e.value.key == "trainer.max_staleness" and "kl_in_reward" in e.value.message


def test_reinforce_pp_kl_in_reward_enters_the_token_rewards():
    """rl.advantages' per-sample KL (algo.kl_in_reward) == algos.reinforce_pp_advantages with the padded KL."""
    from jaxrl.train import rl

    rng = np.random.default_rng(4)
    lens = [4, 9, 1, 12]
    rewards = rng.normal(size=4).astype(np.float32)
    kl = [np.abs(rng.normal(size=n)).astype(np.float32) for n in lens]
    cfg = _cfg(advantage="reinforce_pp", kl_coef=0.3, kl_in_reward=True, gamma=0.9)
    got = rl.advantages(cfg, rewards, lens, kl=kl)
    mask = _padded([np.ones(n) for n in lens])
    want = np.asarray(algos.reinforce_pp_advantages(rewards, mask, kl=_padded(kl), kl_coef=0.3, gamma=0.9))
    for g, w, n in zip(got, want, lens):
        np.testing.assert_allclose(g, w[:n], rtol=1e-6, atol=1e-6)
    plain = rl.advantages(cfg, rewards, lens)
    assert not np.allclose(np.concatenate(plain), np.concatenate(got))


def test_kl_in_reward_checks():
    with pytest.raises(ConfigError, match="needs algo.advantage in"):
        decode(TrainConfig, {"algo": {"kl_in_reward": True, "kl_coef": 0.1}})
    with pytest.raises(ConfigError, match="set algo.kl_coef > 0"):
        decode(TrainConfig, {"algo": {"advantage": "gae", "kl_in_reward": True}})
    cfg = decode(TrainConfig, {"algo": {"advantage": "gae", "kl_in_reward": True, "kl_coef": 0.1}})
    assert LossSpec.from_config(cfg.algo, temperature=1.0, trainer=cfg.trainer).kl_coef == 0.0  # not a loss term too
    with pytest.raises(ConfigError, match="kl_in_reward: the KL node needs") as e:
        decode(TrainConfig, {"algo": {"advantage": "reinforce_pp", "kl_in_reward": True, "kl_coef": 0.1},
                             "trainer": {"micro_batch_tokens": None}})
    assert e.value.key == "trainer.micro_batch_tokens"


def test_ppo_graph_plan_and_checks(tmp_path):
    cfg = decode(TrainConfig, {"algo": {"advantage": "gae"}})
    assert Flow.build(cfg).plan.order == ["rollout", "reward", "values", "advantage", "critic_update", "update"]
    kl = decode(TrainConfig, {"algo": {"advantage": "gae", "kl_in_reward": True, "kl_coef": 0.1}})
    order = Flow.build(kl).plan.order
    assert order.index("kl") < order.index("advantage") < order.index("reference") < order.index("update")
    rpp = decode(TrainConfig, {"algo": {"advantage": "reinforce_pp", "kl_in_reward": True, "kl_coef": 0.1}})
    assert Flow.build(rpp).plan.order.index("kl") < Flow.build(rpp).plan.order.index("advantage")
    with pytest.raises(GraphError, match="algo.advantage=gae needs a critic"):
        Flow.build(dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, graph="grpo")))
    with pytest.raises(GraphError, match="computes gae advantages but algo.advantage=grpo"):
        Flow.build(decode(TrainConfig, {"algo": {"graph": "ppo"}}))
    no_kl = tmp_path / "no_kl.yaml"
    no_kl.write_text(
        "nodes:\n"
        "  - {id: rollout, role: actor, type: model_inference}\n"
        "  - {id: reward, role: reward, type: compute, deps: [rollout]}\n"
        "  - {id: values, role: critic, type: model_inference, deps: [rollout]}\n"
        "  - {id: advantage, role: advantage, type: compute, deps: [reward, values]}\n"
        "  - {id: reference, role: reference, type: model_inference, deps: [advantage]}\n"
        "  - {id: train_critic, role: critic, type: model_train, deps: [advantage]}\n"
        "  - {id: update, role: actor, type: model_train, deps: [advantage, reference]}\n")
    with pytest.raises(GraphError, match="kl_in_reward needs a reference node the advantage node depends on"):
        Flow.build(dataclasses.replace(kl, algo=dataclasses.replace(kl.algo, graph=str(no_kl))))
