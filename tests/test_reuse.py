"""`sharding.reuse`: the nested device order and the reshard that slices what devices already hold (PAT's
merged TP mesh). Merges between power-of-two TP layouts move no weight byte; splits move what each device
lacks; values are exact; the rollout service's relayout uses it mid-generation."""

import dataclasses

import jax
import numpy as np
import pytest

import models
from jaxrl.rollout import RolloutService, SamplingParams
from sharding import (Layout, ShardingRules, nested_order, reshard_reusing, shardings_for, to_local_groups,
                      tp_groups, tree_reuse_bytes)

# 8 query and 8 KV heads: every TP up to 8 shards the attention (no leaf replicated at a larger TP)
CFG = dataclasses.replace(models.PRESETS["tiny-qwen3"], num_kv_heads=8, head_dim=8)


def _rollout_shardings(groups):
    out = []
    for g in groups:
        layout = Layout(tp=len(g))
        out.append(shardings_for(models.logical_axes(CFG), layout.make_mesh(g), ShardingRules.rollout(CFG, layout)))
    return out


def test_nested_order_and_groups():
    ids = lambda gs: [[d for d in g] for g in gs]
    assert nested_order(list(range(8))) == [0, 4, 2, 6, 1, 5, 3, 7]
    assert nested_order([0, 1, 2, 3]) == [0, 2, 1, 3] and nested_order([5, 6]) == [5, 6]
    assert nested_order([0, 1, 2]) == [0, 1, 2]                     # not a power of two: pool order
    assert ids(tp_groups(list(range(8)), [4, 2, 2])) == [[0, 2, 1, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("src,dst", [(2, 4), (2, 8), (4, 8), (1, 8)])
def test_merges_move_nothing_in_nested_order(src, dst):
    """A device at rank t of a TP-src group holds what its rank in the merged TP-dst group needs; the
    contiguous order (rank = position in the pool) moves bytes for every merge from TP > 1."""
    abstract = models.abstract(CFG)
    devs = jax.devices()
    nested = tree_reuse_bytes(abstract, _rollout_shardings(tp_groups(devs, [src] * (8 // src))),
                              _rollout_shardings(tp_groups(devs, [dst] * (8 // dst)))[0])
    plain = lambda tp: [devs[i:i + tp] for i in range(0, 8, tp)]
    contiguous = tree_reuse_bytes(abstract, _rollout_shardings(plain(src)), _rollout_shardings(plain(dst))[0])
    assert nested == 0
    assert (contiguous > 0) == (src > 1)


@pytest.mark.parametrize("src,dst", [(2, 8), (8, 2)])
def test_reshard_reusing_is_exact_and_counts_bytes(src, dst):
    w = models.init(jax.random.key(1), CFG)
    host = jax.device_get(w)
    devs = jax.devices()
    replicas = [jax.device_put(w, s) for s in _rollout_shardings(tp_groups(devs, [src] * (8 // src)))]
    targets = _rollout_shardings(tp_groups(devs, [dst] * (8 // dst)))
    want = tree_reuse_bytes(models.abstract(CFG), [jax.tree.map(lambda x: x.sharding, r) for r in replicas],
                            targets[0]) * len(targets)
    outs, rep = reshard_reusing(replicas, targets, consumed=lambda x: True)
    assert rep.bytes_moved == want and (want == 0) == (dst > src)
    for out, target in zip(outs, targets):
        for x, y, sh in zip(jax.tree.leaves(out), jax.tree.leaves(host), jax.tree.leaves(target)):
            assert x.sharding == sh
            np.testing.assert_array_equal(np.asarray(x), y)
    assert all(x.is_deleted() for r in replicas for x in jax.tree.leaves(r))     # consumed leaf by leaf


def test_relayout_mid_generation_reuses_shards():
    """TP2x4 -> TP4x2 -> TP8x1 mid-generation: no weight byte moves (the contiguous order would move some),
    then TP8x1 -> TP2x4 moves what the devices lack; the tokens equal a static run's."""
    w = models.init(jax.random.key(2), CFG)
    kw = dict(max_batch=8, max_seq_len=64)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=())
    prompts = [list(range(1, 4 + p)) for p in range(6)]

    def run(moves):
        svc = RolloutService(CFG, w, tp=2, instances=4, **kw)
        for p in prompts:
            svc.add(p, params)
        reports, steps = [], 0
        while svc.has_work():
            svc.step()
            steps += 1
            if steps in moves:
                reports.append(svc.relayout(moves[steps], 8 // moves[steps]))
        return {c.request_id: c.tokens for c in svc.run()}, reports, svc

    static, _, _ = run({})
    got, reps, svc = run({3: 4, 6: 8, 9: 2})
    assert [r.weight_bytes for r in reps[:2]] == [0, 0]
    assert all(r.weight_bytes_contiguous > 0 for r in reps[:2]) and reps[2].weight_bytes > 0
    assert [[d.id for d in i.mesh.devices.flat] for i in svc.instances] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert got == static


def test_to_local_groups_rows_follow_the_nested_order():
    """Multi-process weight sync's mirror mesh has the instances' device order (a group in another order is
    refused rather than filled with the wrong shards)."""
    w = models.init(jax.random.key(3), CFG)
    devs = jax.devices()
    train = Layout(fsdp=8)
    w = jax.device_put(w, shardings_for(models.logical_axes(CFG), train.make_mesh(devs), ShardingRules.train(CFG, train)))
    groups = tp_groups(devs, [4, 4])
    specs = jax.tree.map(lambda s: s.spec, _rollout_shardings(groups)[0])
    copies = to_local_groups(w, specs, groups, 4)
    for c, g in zip(copies, groups):
        for x, y in zip(jax.tree.leaves(c), jax.tree.leaves(w)):
            assert list(x.sharding.mesh.devices.flat) == g
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="not rows of the mirror mesh"):
        to_local_groups(w, specs, [devs[:4]], 4)
