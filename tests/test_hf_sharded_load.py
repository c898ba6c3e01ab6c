"""`load_hf` straight into a sharding equals the unsharded load, and reads only each device's slice."""

import dataclasses

import jax
import numpy as np
import pytest

from models import PRESETS, init, load_hf, logical_axes, save_hf
from models import safetensors_io as st
from sharding import Layout, ShardingRules, shardings_for

CFG = dataclasses.replace(PRESETS["tiny-qwen2"], num_heads=8, num_kv_heads=4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    save_hf(d, CFG, init(jax.random.key(0), CFG), max_shard_bytes=60_000)  # several files + index
    return d


@pytest.mark.parametrize("role,layout", [("train", Layout(fsdp=4, tp=2)), ("train", Layout(fsdp=8)),
                                         ("rollout", Layout(tp=4))])
def test_sharded_equals_unsharded(ckpt, role, layout):
    devices = jax.devices()[: layout.size]
    mesh = layout.make_mesh(devices)
    shardings = shardings_for(logical_axes(CFG), mesh, ShardingRules.for_role(role, CFG, layout))
    _, full = load_hf(ckpt)
    _, sharded = load_hf(ckpt, shardings=shardings)
    for a, b, s in zip(jax.tree.leaves(full), jax.tree.leaves(sharded), jax.tree.leaves(shardings)):
        assert b.sharding == s
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_each_device_reads_only_its_slice(ckpt, monkeypatch):
    """With fsdp=8, every read of a sharded projection covers 1/8 of it (not the whole tensor)."""
    reads = []
    orig = st.TensorFile.read

    def counting(self, name, index=None):
        out = orig(self, name, index)
        reads.append((name, out.size, int(np.prod(self.shape(name)))))
        return out

    monkeypatch.setattr(st.TensorFile, "read", counting)
    layout = Layout(fsdp=8)
    mesh = layout.make_mesh(jax.devices())
    load_hf(ckpt, shardings=shardings_for(logical_axes(CFG), mesh, ShardingRules.train(CFG, layout)))
    q_reads = [(n, got, total) for n, got, total in reads if n.endswith("q_proj.weight")]
    assert q_reads and all(got * 8 == total for _, got, total in q_reads)
