"""Layouts, sharding rules per role, and exact layer-wise resharding between meshes (8 fake CPU devices)."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import models
from sharding import (Layout, ShardingRules, leaf_bytes_moved, logical_to_spec, reshard, reshard_bytes,
                      path_str, shardings_for, specs_for, split_devices)


def _cfg(name="tiny-qwen3", **changes):
    # 8 query heads so tp=8 divides; 2 KV heads so tp=8 exercises KV replication.
    return dataclasses.replace(models.preset(name), **{"num_heads": 8, **changes})


@functools.lru_cache(maxsize=None)
def _host_weights(cfg):
    """`models.init` weights as numpy, once per config (init compiles for seconds on the CPU)."""
    return jax.tree.map(np.asarray, models.init(jax.random.key(0), cfg))


def _train_weights(cfg, layout=Layout(fsdp=8)):
    """Fresh device weights in the training sharding of `layout` over all 8 devices, and the shardings."""
    mesh = layout.make_mesh(jax.devices())
    shardings = shardings_for(models.logical_axes(cfg), mesh, ShardingRules.train(cfg, layout))
    return jax.device_put(_host_weights(cfg), shardings), shardings


# ---------------------------------------------------------------------------------------------- layout


def test_layout_validation_and_mesh():
    layout = Layout(fsdp=4, tp=2)
    assert layout.size == 8 and layout.name == "dp1-fsdp4-tp2"
    mesh = layout.make_mesh(jax.devices())
    assert mesh.axis_names == ("dp", "fsdp", "tp") and dict(mesh.shape) == {"dp": 1, "fsdp": 4, "tp": 2}
    # tp is the fastest axis: a TP group is adjacent devices.
    assert list(mesh.devices[0, 0]) == jax.devices()[:2]
    for bad in (dict(tp=0), dict(dp=-1), dict(fsdp=1.5), dict(tp=True)):
        with pytest.raises(ValueError, match="must be a positive int"):
            Layout(**bad)
    with pytest.raises(ValueError, match=r"needs dp\*fsdp\*tp = 1\*4\*2 = 8 devices, got 4"):
        layout.make_mesh(jax.devices()[:4])


def test_split_devices():
    devices = jax.devices()
    groups = split_devices(devices, 4)
    assert groups == [devices[0:2], devices[2:4], devices[4:6], devices[6:8]]
    assert split_devices(devices, 1) == [devices]
    with pytest.raises(ValueError, match="cannot split 8 devices into 3"):
        split_devices(devices, 3)


# ---------------------------------------------------------------------------------------------- rules


def test_rules_per_role():
    cfg = models.preset("qwen3-8b")
    train = ShardingRules.train(cfg, Layout(fsdp=4, tp=2))
    assert (train.embed, train.vocab, train.heads, train.kv_heads, train.mlp) == ("fsdp", "tp", "tp", "tp", "tp")
    assert train.layers is None and train.head_dim is None
    rollout = ShardingRules.rollout(cfg, Layout(tp=4))
    assert (rollout.embed, rollout.vocab, rollout.heads, rollout.kv_heads, rollout.mlp) == (None, "tp", "tp", "tp", "tp")
    # Size-1 axes are allowed; specs still name them.
    specs = specs_for(models.logical_axes(cfg), ShardingRules.train(cfg, Layout(fsdp=8)), Layout(fsdp=8).mesh_shape)
    assert specs.layers.wq == P(None, "fsdp", "tp", None)
    assert specs.embed == P("tp", "fsdp") and specs.lm_head == P("fsdp", "tp")
    with pytest.raises(ValueError, match="dp=1 and fsdp=1"):
        ShardingRules.rollout(cfg, Layout(fsdp=2, tp=2))
    with pytest.raises(ValueError, match="valid: None or one of"):
        ShardingRules(embed="model")


def test_collision_rejected():
    rules = ShardingRules(embed="tp", heads="tp")
    with pytest.raises(ValueError, match="'embed' and 'heads'.*both map to mesh axis 'tp'"):
        logical_to_spec(("layers", "embed", "heads", "head_dim"), rules)
    with pytest.raises(ValueError, match="layers.wq: logical axes"):
        specs_for(models.logical_axes(_cfg()), rules, Layout(tp=2).mesh_shape)


def test_non_divisible_names_leaf_shape_and_axis():
    cfg = models.preset("qwen2.5-7b")  # 28 query heads, 4 KV heads
    layout = Layout(tp=8)
    rules = ShardingRules.rollout(cfg, layout)
    assert rules.kv_heads is None  # 8 % 4 == 0: replicated, not an error
    with pytest.raises(ValueError) as err:
        specs_for(models.logical_axes(cfg), rules, layout.mesh_shape)
    msg = str(err.value)
    assert "layers.wq: shape (28, 3584, 28, 128) dim 2 (heads=28) is not divisible by mesh axis 'tp' of size 8" in msg
    assert "layers.wo:" in msg and "layers.bq:" in msg and "layers.wk" not in msg


def test_kv_heads_replicated_when_tp_exceeds_them():
    cfg = _cfg()  # 2 KV heads
    assert ShardingRules.rollout(cfg, Layout(tp=2)).kv_heads == "tp"
    rules = ShardingRules.rollout(cfg, Layout(tp=8))
    assert rules.kv_heads is None
    mesh = Layout(tp=8).make_mesh(jax.devices())
    shardings = shardings_for(models.logical_axes(cfg), mesh, rules)
    assert shardings.layers.wk.spec == P(None, None, None, None)
    assert shardings.layers.wq.spec == P(None, None, "tp", None)
    # 3 KV heads: neither divides the other -> error, for tp > kv and tp < kv alike.
    for kv, heads, tp in ((3, 12, 4), (3, 12, 2)):
        with pytest.raises(ValueError, match=f"num_kv_heads={kv} and tp={tp}"):
            ShardingRules.train(_cfg(num_kv_heads=kv, num_heads=heads), Layout(tp=tp))


def test_shardings_for_tree():
    cfg = models.preset("tiny-qwen2")  # biases present, untied head
    mesh = Layout(fsdp=4, tp=2).make_mesh(jax.devices())
    shardings = shardings_for(models.logical_axes(cfg), mesh, ShardingRules.train(cfg, Layout(fsdp=4, tp=2)))
    assert isinstance(shardings, models.Weights) and shardings.layers.q_norm is None
    assert all(isinstance(s, NamedSharding) and s.mesh == mesh for s in jax.tree.leaves(shardings))
    assert shardings.layers.bk.spec == P(None, "tp", None)


# ---------------------------------------------------------------------------------------------- reshard


def _assert_equal(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        assert np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(path)


def _paths(tree):
    return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _on_mesh(tree, mesh):
    return {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set} == set(mesh.devices.flat)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen2"])
def test_reshard_round_trip_exact(name):
    cfg = _cfg(name)
    axes, abstract = models.logical_axes(cfg), models.abstract(cfg)
    devices = jax.devices()
    n_stacked = len(jax.tree.leaves(axes.layers, is_leaf=models.is_spec))

    weights, train_sh = _train_weights(cfg)
    train_mesh = train_sh.embed.mesh
    reference = _host_weights(cfg)

    def check(src, dst_sh):
        src_sh = jax.tree.map(lambda x: x.sharding, src)
        expected = reshard_bytes(abstract, src_sh, dst_sh)
        # Stacked leaves whose sharding changes: each must go over in num_layers one-layer steps.
        moved_stacked = sum(not s.is_equivalent_to(d, len(a.shape)) for a, s, d in
                            zip(jax.tree.leaves(abstract.layers), jax.tree.leaves(src_sh.layers),
                                jax.tree.leaves(dst_sh.layers)))
        out, report = reshard(src, dst_sh)
        _assert_equal(reference, out)
        assert jax.tree.map(lambda x: x.sharding, out) == dst_sh
        assert report.bytes_moved == expected > 0
        assert report.leaves == len(jax.tree.leaves(abstract))
        assert report.total_bytes == sum(x.nbytes for x in jax.tree.leaves(out))
        assert report.layer_steps == cfg.num_layers * moved_stacked
        return out, report

    # fsdp=8 training -> four tp=2 rollout instances, each on its own sub-mesh.
    inst_layout = Layout(tp=2)
    inst_meshes = [inst_layout.make_mesh(d) for d in split_devices(devices, 4)]
    instances = []
    for mesh in inst_meshes:
        out, report = check(weights, shardings_for(axes, mesh, ShardingRules.rollout(cfg, inst_layout)))
        assert _on_mesh(out, mesh) and report.layer_steps == cfg.num_layers * n_stacked
        instances.append(out)

    # one tp=2 instance -> one tp=8 instance (KV heads now replicated) -> back to fsdp=8 training.
    big_layout = Layout(tp=8)
    big_mesh = big_layout.make_mesh(devices)
    big, _ = check(instances[0], shardings_for(axes, big_mesh, ShardingRules.rollout(cfg, big_layout)))
    back, _ = check(big, train_sh)
    assert _on_mesh(back, train_mesh)


def test_reshard_identity_moves_nothing():
    cfg = _cfg()
    weights, sh = _train_weights(cfg, Layout(fsdp=4, tp=2))
    out, report = reshard(weights, sh)
    assert report.bytes_moved == 0 and report.leaves_moved == 0 and report.layer_steps == 0
    assert reshard_bytes(models.abstract(cfg), sh, sh) == 0
    _assert_equal(weights, out)


def test_reshard_layer_steps_bound_transient_memory():
    """Stacked leaves move one layer per step: the largest single transfer is one layer, not the whole leaf."""
    cfg = _cfg()
    devices = jax.devices()
    weights, _ = _train_weights(cfg)
    dst_mesh = Layout(tp=2).make_mesh(devices[:2])
    dst_sh = shardings_for(models.logical_axes(cfg), dst_mesh, ShardingRules.rollout(cfg, Layout(tp=2)))
    layers_only, report = reshard(weights.layers, dst_sh.layers, stacked=lambda path: True)
    largest = max(x.nbytes for x in jax.tree.leaves(weights.layers))
    assert report.layer_steps == cfg.num_layers * len(jax.tree.leaves(weights.layers))
    assert report.max_step_bytes == largest // cfg.num_layers
    _assert_equal(weights.layers, layers_only)
    # whole_leaf_bytes: the leaves of at most that size move in one step (the weight sync's small-leaf path), the
    # others still layer by layer; the same values, the same bytes counted
    sizes = sorted(x.nbytes for x in jax.tree.leaves(weights.layers))
    cut = sizes[len(sizes) // 2]
    mixed, r2 = reshard(weights.layers, dst_sh.layers, stacked=lambda path: True, whole_leaf_bytes=cut)
    per_layer = [x for x in jax.tree.leaves(weights.layers) if x.nbytes > cut]
    assert 0 < len(per_layer) < len(sizes) and r2.layer_steps == cfg.num_layers * len(per_layer)
    assert r2.max_step_bytes == max(cut, max(x.nbytes for x in per_layer) // cfg.num_layers)
    assert r2.bytes_moved == report.bytes_moved
    _assert_equal(weights.layers, mixed)


def test_reshard_donate_consumes_source():
    cfg = _cfg()
    devices = jax.devices()
    weights, _ = _train_weights(cfg)
    reference = _host_weights(cfg)
    dst_sh = shardings_for(models.logical_axes(cfg), Layout(tp=8).make_mesh(devices),
                           ShardingRules.rollout(cfg, Layout(tp=8)))
    out, report = reshard(weights, dst_sh, donate=True)
    _assert_equal(reference, out)
    moved = [x.is_deleted() for p, x in _paths(weights).items() if report.bytes_by_leaf[p] > 0]
    assert moved and all(moved)  # every moved leaf was consumed (relabelled in-place ones alias the output)


def test_leaf_bytes_moved_counts_missing_boxes():
    devices = jax.devices()
    mesh8 = Layout(tp=8).make_mesh(devices)
    mesh2 = Layout(tp=2).make_mesh(devices[:2])
    shape, dtype = (8, 4), np.float32  # 128 bytes
    rows8 = NamedSharding(mesh8, P("tp", None))       # device i holds row i
    repl2 = NamedSharding(mesh2, P(None, None))       # devices 0,1 hold everything
    rows2 = NamedSharding(mesh2, P("tp", None))       # device 0 rows 0-3, device 1 rows 4-7
    # Each of devices 0,1 already holds one row (16 bytes) of the 128 it needs.
    assert leaf_bytes_moved(shape, dtype, rows8, repl2) == 2 * (128 - 16)
    assert leaf_bytes_moved(shape, dtype, rows8, rows2) == (64 - 16) + 64  # device 1 holds row 1, needs 4-7
    assert leaf_bytes_moved(shape, dtype, repl2, rows2) == 0
    # device 0 holds row 0 already; device 1 (rows 4-7) lacks row 1; devices 2..7 hold nothing.
    assert leaf_bytes_moved(shape, dtype, rows2, rows8) == 7 * 16


def test_reshard_from_host_numpy():
    """Host (numpy) leaves, as a multi-process gather produces, go straight into the target sharding."""
    import numpy as np

    cfg = models.PRESETS["tiny-qwen3"]
    host = jax.tree.map(np.asarray, models.init(jax.random.key(0), cfg))
    layout = Layout(tp=2)
    target = shardings_for(models.logical_axes(cfg), layout.make_mesh(jax.devices()[:2]),
                           ShardingRules.rollout(cfg, layout))
    out, report = reshard(host, target)
    for h, o, t in zip(jax.tree.leaves(host), jax.tree.leaves(out), jax.tree.leaves(target)):
        assert o.sharding == t
        np.testing.assert_array_equal(h, np.asarray(o))
    assert report.bytes_moved == report.total_bytes == sum(h.nbytes for h in jax.tree.leaves(host))
