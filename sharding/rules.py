"""`ShardingRules`: logical weight axes -> mesh axes, one small typed rule set per role.

Model code names axes logically (`models.weights.LOGICAL_AXES`); only this module knows mesh axis names. A rule
set maps each logical axis to one mesh axis or `None` (replicated along it). Two roles exist:

- **train** (`ShardingRules.train`): FSDP + tensor parallelism, Megatron-style. `embed -> "fsdp"`, and
  `vocab`, `heads`, `kv_heads`, `mlp -> "tp"`. Every matrix is sharded on both axes (e.g. `wq` is
  `[layers, embed/fsdp, heads/tp, head_dim]`), so optimizer state — which takes the parameter sharding — is
  spread over all fsdp*tp devices. `dp` replicates weights (pure data parallelism over the remaining axis).
  Axes of size 1 are allowed: `Layout(fsdp=8)` gives the same rules, with `tp` trivial.
- **rollout** (`ShardingRules.rollout`): one instance is one TP group on its own sub-mesh, so only `tp`
  shards (`vocab`, `heads`, `kv_heads`, `mlp -> "tp"`; `embed` replicated, as in vLLM/Megatron inference: the
  residual stream is whole on every device and each layer ends in one all-reduce). A rollout layout with
  `dp` or `fsdp` > 1 is an error: rollout data parallelism is several instances (`split_devices`), not a mesh axis.

The rollout's paged KV cache (`models.kv_cache_spec`: layers, pages, kv_heads, page_size, head_dim) follows the
same rollout rules: `kv_heads` on `tp` (replicated when tp > num_kv_heads), pages and page slots whole on every
device of the instance.

`layers` and `head_dim` are never sharded: layers are scanned (and resharded one at a time, `sharding.reshard`),
and head_dim is the contraction inside one attention head.

KV heads (GQA): with `tp <= num_kv_heads`, `kv_heads` is sharded on `tp` and must divide. With `tp >
num_kv_heads` and `tp % num_kv_heads == 0` (e.g. 2 KV heads, tp=8) the K/V projections are **replicated** on
`tp` — the same choice as vLLM, which gives each TP rank a copy of the KV head its query heads use. Ours is the
simple form of that: every rank holds *all* KV heads (a named sharding cannot express "each rank holds head
rank // (tp/kv)" without splitting the tp axis in two); the extra memory is small, since K/V projections are
`2 * kv_heads/heads` of the attention weights, and GSPMD slices the right head for each rank's query heads.
Any other non-divisible combination is an error here (not silently replicated).

Every shape is checked against the mesh in `specs_for`/`shardings_for`: a dimension that does not divide its
mesh axis is a `ValueError` naming the leaf path, shape, dimension and mesh axis — never silent replication.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.weights import LOGICAL_AXES, ArraySpec, is_spec

from .layout import MESH_AXES, Layout

ROLES = ("train", "rollout")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis name (`"dp"`, `"fsdp"`, `"tp"`) or `None` (replicated). Fields = `LOGICAL_AXES`."""

    layers: str | None = None
    vocab: str | None = None
    embed: str | None = None
    heads: str | None = None
    kv_heads: str | None = None
    head_dim: str | None = None
    mlp: str | None = None
    pages: str | None = None
    page_size: str | None = None

    def __post_init__(self):
        for name in LOGICAL_AXES:
            value = getattr(self, name)
            if value is not None and value not in MESH_AXES:
                raise ValueError(f"ShardingRules.{name}={value!r}; valid: None or one of {MESH_AXES}")

    @classmethod
    def train(cls, cfg: ModelConfig, layout: Layout) -> "ShardingRules":
        """FSDP on `embed`, TP on `vocab`/`heads`/`kv_heads`/`mlp` (kv_heads replicated when tp > num_kv_heads)."""
        return cls(vocab="tp", embed="fsdp", heads="tp", kv_heads=_kv_heads_axis(cfg, layout), mlp="tp")

    @classmethod
    def rollout(cls, cfg: ModelConfig, layout: Layout) -> "ShardingRules":
        """TP only, inside one instance: `vocab`/`heads`/`kv_heads`/`mlp` on `tp`, `embed` replicated."""
        if layout.dp != 1 or layout.fsdp != 1:
            raise ValueError(f"rollout layout {layout} must have dp=1 and fsdp=1: one rollout instance is one TP "
                             f"group; use several instances (sharding.split_devices) for data parallelism")
        return cls(vocab="tp", heads="tp", kv_heads=_kv_heads_axis(cfg, layout), mlp="tp")

    @classmethod
    def for_role(cls, role: str, cfg: ModelConfig, layout: Layout) -> "ShardingRules":
        """`train` or `rollout` rules by name."""
        if role not in ROLES:
            raise ValueError(f"role={role!r}; valid choices: {', '.join(ROLES)}")
        return getattr(cls, role)(cfg, layout)


def _kv_heads_axis(cfg: ModelConfig, layout: Layout) -> str | None:
    """`"tp"` when KV heads divide over tp, `None` (replicated) when tp is a multiple of them, else an error."""
    kv, tp = cfg.num_kv_heads, layout.tp
    if kv % tp == 0:
        return "tp"
    if tp > kv and tp % kv == 0:
        return None
    raise ValueError(f"num_kv_heads={kv} and tp={tp}: KV heads must be a multiple of tp (sharded) or divide tp "
                     f"(replicated, tp > num_kv_heads); neither holds")


def logical_to_spec(axes: tuple[str | None, ...], rules: ShardingRules) -> PartitionSpec:
    """`PartitionSpec` for one leaf's logical axes; an error if two dimensions land on the same mesh axis."""
    mesh_axes = []
    for axis in axes:
        if axis is not None and axis not in LOGICAL_AXES:
            raise ValueError(f"unknown logical axis {axis!r} in {axes}; valid: {LOGICAL_AXES}")
        mesh_axes.append(None if axis is None else getattr(rules, axis))
    used: dict[str, str] = {}
    for axis, mesh_axis in zip(axes, mesh_axes):
        if mesh_axis is None:
            continue
        if mesh_axis in used:
            raise ValueError(f"logical axes {used[mesh_axis]!r} and {axis!r} of {axes} both map to mesh axis "
                             f"{mesh_axis!r}; a mesh axis can shard only one dimension of an array")
        used[mesh_axis] = axis
    return PartitionSpec(*mesh_axes)


def path_str(path) -> str:
    """`layers.wq` for a pytree key path (attribute, dict and sequence keys joined by dots)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        else:  # FlattenedIndexKey and future key types
            parts.append(str(getattr(key, "key", key)))
    return ".".join(parts)


def specs_for(tree: Any, rules: ShardingRules, mesh_shape: Mapping[str, int]) -> Any:
    """The same tree with a `PartitionSpec` per `ArraySpec` leaf, checked against `mesh_shape` (no devices needed).

    `mesh_shape` maps mesh axis name -> size (`Layout.mesh_shape` or `mesh.shape`). Raises one `ValueError`
    listing every leaf whose dimension does not divide its mesh axis (path, shape, dimension, axis and size).
    """
    mesh_shape = dict(mesh_shape)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec)
    specs, problems = [], []
    for path, leaf in flat:
        name = path_str(path)
        if not isinstance(leaf, ArraySpec):
            raise TypeError(f"{name}: expected an ArraySpec leaf (models.weight_specs / logical_axes), "
                            f"got {type(leaf).__name__}")
        try:
            spec = logical_to_spec(leaf.axes, rules)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        for dim, (size, logical, mesh_axis) in enumerate(zip(leaf.shape, leaf.axes, spec)):
            if mesh_axis is None:
                continue
            if mesh_axis not in mesh_shape:
                raise ValueError(f"{name}: mesh axis {mesh_axis!r} (for {logical!r}) is not in the mesh "
                                 f"{mesh_shape}")
            if size % mesh_shape[mesh_axis]:
                hint = " (pad the vocabulary: sharding.padded_vocab_for)" if logical == "vocab" else ""
                problems.append(f"{name}: shape {leaf.shape} dim {dim} ({logical}={size}) is not divisible by mesh "
                                f"axis {mesh_axis!r} of size {mesh_shape[mesh_axis]}{hint}")
        specs.append(spec)
    if problems:
        raise ValueError(f"{len(problems)} weight dimension(s) do not divide their mesh axis (no silent "
                         f"replication; change the layout or the rules):\n  " + "\n  ".join(problems))
    return jax.tree_util.tree_unflatten(treedef, specs)


def shardings_for(tree: Any, mesh: Mesh, rules: ShardingRules) -> Any:
    """The same tree with a `NamedSharding` on `mesh` per `ArraySpec` leaf (see `specs_for` for the checks)."""
    specs = specs_for(tree, rules, mesh.shape)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
