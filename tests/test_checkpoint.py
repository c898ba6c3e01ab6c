"""jaxrl.train.checkpoint: sharded round trips, resharding on restore, retention, interrupted saves."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.train.checkpoint import CheckpointManager

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8
    return Mesh(np.array(jax.devices()), ("x",))


def make_state(mesh, seed=0):
    w = jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(16, 4) + seed, NamedSharding(mesh, P("x")))
    b = jax.device_put(jnp.full((3,), seed, jnp.bfloat16), NamedSharding(mesh, P()))
    params = {"w": w, "b": b}
    return {
        "params": params,
        "opt": optax.adam(1e-3).init(params),  # NamedTuples, an empty node, a scalar count
        "rng": jax.random.key_data(jax.random.key(seed)),
        "counter": np.array([seed, 7], np.int64),
    }


META = {"data_cursor": {"epoch": 1, "index": 42}, "config_yaml": "trainer:\n  lr: 1.0e-06\n", "queue": [3, 1, 4]}


def assert_same_values(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_sharded_state_and_meta(tmp_path, mesh):
    state = make_state(mesh, seed=3)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.save(5, state, META)
    with CheckpointManager(tmp_path / "ckpt") as mgr:  # a fresh process would see the same
        assert mgr.latest_step() == 5
        step, restored, meta = mgr.restore(target=state)
        assert step == 5 and meta == META
        assert mgr.meta() == META
    assert_same_values(restored, state)
    assert restored["params"]["w"].sharding == state["params"]["w"].sharding
    assert isinstance(restored["counter"], np.ndarray)
    key = jax.random.wrap_key_data(restored["rng"])  # typed keys are rewrapped by the caller
    assert np.array_equal(jax.random.key_data(key), jax.random.key_data(jax.random.key(3)))


def test_restore_into_a_different_sharding(tmp_path, mesh):
    state = make_state(mesh, seed=1)
    mesh2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "tp"))

    def target_leaf(x):
        if not isinstance(x, jax.Array):
            return x
        spec = P("tp", "dp") if x.ndim == 2 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh2, spec))

    target = jax.tree.map(target_leaf, state)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state, {})
        _, restored, meta = mgr.restore(target=target)
    assert meta == {}
    assert_same_values(restored, state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
        if isinstance(want, jax.ShapeDtypeStruct):
            assert got.sharding == want.sharding
    w = restored["params"]["w"]
    assert w.addressable_shards[0].data.shape == (8, 1)  # each device holds only its 16/2 x 4/4 slice


def test_keep_last_two_and_latest_step(tmp_path, mesh):
    with CheckpointManager(tmp_path, keep=2) as mgr:
        assert mgr.latest_step() is None
        for step in (1, 2, 3):
            mgr.save(step, make_state(mesh, seed=step), {"step": step})
        assert mgr.all_steps() == [2, 3] and mgr.latest_step() == 3
        assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "3"]
        step, restored, meta = mgr.restore(2, target=make_state(mesh))
        assert step == 2 and meta == {"step": 2}
        assert_same_values(restored, make_state(mesh, seed=2))
        with pytest.raises(FileNotFoundError, match="step 1"):
            mgr.restore(1, target=make_state(mesh))


def test_empty_directory_restores_none(tmp_path, mesh):
    with CheckpointManager(tmp_path / "none") as mgr:
        assert mgr.latest_step() is None
        assert mgr.restore(target=make_state(mesh)) is None
        assert mgr.meta() is None


def test_interval_force_and_misuse(tmp_path, mesh):
    state = make_state(mesh)
    with CheckpointManager(tmp_path, every=10) as mgr:
        assert not mgr.save(5, state, {})
        assert mgr.latest_step() is None
        assert mgr.save(7, state, {}, force=True)
        assert mgr.save(10, state, {})
        with pytest.raises(ValueError, match="not newer"):
            mgr.save(10, state, {}, force=True)
        with pytest.raises(TypeError, match="key_data"):
            mgr.save(20, {"key": jax.random.key(0)}, {})
        with pytest.raises(TypeError, match="JSON"):
            mgr.save(20, state, {"x": object()})
        bad = make_state(mesh)
        bad["counter"] = np.zeros(3, np.int64)
        bad["params"]["w"] = bad["params"]["w"].astype(jnp.bfloat16)
        with pytest.raises(ValueError, match=r"counter: saved int64\[2\], target int64\[3\]") as e:
            mgr.restore(target=bad)
        assert "params.w: saved float32[16, 4], target bfloat16[16, 4]" in str(e.value)
        no_sharding = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, state)
        with pytest.raises(ValueError, match="without a sharding"):
            mgr.restore(target=no_sharding)


def test_interrupted_save_is_ignored_and_cleaned(tmp_path, mesh):
    state = make_state(mesh, seed=4)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state, META)
    # What a save killed mid-write leaves: orbax's temporary directory, half filled, in both the
    # current ("<step>.orbax-checkpoint-tmp") and the older timestamped naming.
    for name in ("2.orbax-checkpoint-tmp", "3.orbax-checkpoint-tmp-1718000000"):
        shutil.copytree(tmp_path / "1", tmp_path / name)
        shutil.rmtree(tmp_path / name / "meta")
        (tmp_path / name / "state" / "manifest.ocdbt").unlink()
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.latest_step() == 1 and mgr.all_steps() == [1]
        step, restored, meta = mgr.restore(target=state)
        assert step == 1 and meta == META
        assert_same_values(restored, state)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # debris removed on open
        assert mgr.save(2, make_state(mesh, seed=5), {})
        assert mgr.latest_step() == 2


def test_kill_right_after_save_returns_keeps_the_step(tmp_path, mesh):
    """SIGKILL immediately after save() returns: the step must be complete on disk."""
    child = textwrap.dedent(
        f"""
        import os, signal
        import jax, jax.numpy as jnp
        from jaxrl.train.checkpoint import CheckpointManager
        mgr = CheckpointManager({str(tmp_path)!r})
        state = {{"w": jnp.arange(64, dtype=jnp.float32).reshape(16, 4), "rng": jax.random.key_data(jax.random.key(9))}}
        mgr.save(3, state, {{"cursor": 17}})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", child], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    target = {
        "w": jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=NamedSharding(mesh, P("x"))),
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P())),
    }
    with CheckpointManager(tmp_path) as mgr:
        step, restored, meta = mgr.restore(target=target)  # saved on 1 device, restored onto 8
    assert step == 3 and meta == {"cursor": 17}
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(64, dtype=np.float32).reshape(16, 4))
    assert restored["w"].sharding == target["w"].sharding
