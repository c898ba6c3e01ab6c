"""Meshes, sharding rules and resharding for the project's weights (and KV caches).

    from sharding import Layout, ShardingRules, shardings_for, reshard, split_devices
    mesh = Layout(fsdp=4, tp=2).make_mesh(jax.devices())
    train = shardings_for(models.logical_axes(cfg), mesh, ShardingRules.train(cfg, Layout(fsdp=4, tp=2)))
    instances = [Layout(tp=2).make_mesh(d) for d in split_devices(jax.devices(), 4)]
    rollout_weights, report = reshard(weights, shardings_for(models.logical_axes(cfg), instances[0],
                                                             ShardingRules.rollout(cfg, Layout(tp=2))))

Golden snapshots of the rules: `python -m sharding.golden [--update]`.
"""

from .groups import mirror_mesh, to_local_groups
from .layout import MESH_AXES, Layout, split_devices
from .reshard import ReshardReport, is_layer_path, leaf_bytes_moved, reshard, reshard_bytes
from .reuse import nested_order, reshard_reusing, reuse_bytes_moved, tp_groups, tree_reuse_bytes
from .rules import ROLES, ShardingRules, logical_to_spec, path_str, shardings_for, specs_for
from .vocab import padded_vocab_for

__all__ = [
    "MESH_AXES", "Layout", "split_devices", "mirror_mesh", "to_local_groups",
    "ROLES", "ShardingRules", "logical_to_spec", "path_str", "shardings_for", "specs_for",
    "ReshardReport", "is_layer_path", "leaf_bytes_moved", "reshard", "reshard_bytes",
    "padded_vocab_for", "nested_order", "tp_groups", "reshard_reusing", "reuse_bytes_moved", "tree_reuse_bytes",
]
