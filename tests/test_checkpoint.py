"""jaxrl.train.checkpoint: sharded round trips, resharding on restore, retention, interrupted saves,
commit markers and falling back past damaged checkpoints."""

import json
import logging
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

from jaxrl.train.checkpoint import MARKER, CheckpointManager

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


def test_reload_waits_out_a_step_renamed_by_another_process(tmp_path, mesh, monkeypatch):
    """The primary renames a bad step aside while another process reloads: orbax then finds the step's
    directory gone (NotADirectoryError, seen in a 2-process resume after a kill); the reload is tried again."""
    with CheckpointManager(tmp_path, keep=2) as mgr:
        mgr.save(1, make_state(mesh, seed=1), {"step": 1})
        real, calls = mgr._mgr.reload, []

        def racing():
            calls.append(1)
            if len(calls) < 3:
                raise NotADirectoryError(f"Path is not a directory: {tmp_path / '2'}")
            return real()

        monkeypatch.setattr(mgr._mgr, "reload", racing)
        monkeypatch.setattr(CheckpointManager, "RELOAD_WAIT_S", 0.0)
        assert mgr.latest_step() == 1 and len(calls) >= 3
        calls.clear()
        monkeypatch.setattr(mgr._mgr, "reload", lambda: (_ for _ in ()).throw(FileNotFoundError("gone")))
        with pytest.raises(FileNotFoundError):             # for good: the error, after RELOAD_TRIES tries
            mgr._reload()


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


# ------------------------------------------------------------------ verification and corrupt checkpoints


def _largest_array_file(step_dir: Path) -> Path:
    # The merged OCDBT data files that restore reads (state/ocdbt.process_N/ holds per-process copies).
    files = [p for p in (step_dir / "state" / "d").iterdir() if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def _truncate_array(d):
    f = _largest_array_file(d)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _empty_meta(d):
    (d / "meta" / "metadata").write_bytes(b"")


def _delete_marker(d):
    (d / MARKER).unlink()


def _drop_state_dir(d):  # a directory part missing
    shutil.rmtree(d / "state")


def _garbage_marker(d):
    (d / MARKER).write_bytes(b"\x00\xffnot json{")


def _make_legacy(d):
    """What a checkpoint written before markers looks like: no marker, no format in orbax's metadata."""
    (d / MARKER).unlink()
    md = json.loads((d / "_CHECKPOINT_METADATA").read_text())
    md.pop("custom_metadata", None)
    (d / "_CHECKPOINT_METADATA").write_text(json.dumps(md))


def _save_two(path, mesh, **kw):
    with CheckpointManager(path, **kw) as mgr:
        for step in (1, 2):
            mgr.save(step, make_state(mesh, seed=step), {"step": step})


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "jaxrl.train.checkpoint" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    "damage, why",
    [
        (_truncate_array, "bytes, COMMITTED says"),
        (_empty_meta, "meta/metadata"),
        (_delete_marker, "no COMMITTED marker"),
        (_drop_state_dir, "is missing"),
        (_garbage_marker, "COMMITTED marker is unreadable"),
    ],
    ids=["truncated-array", "empty-meta", "deleted-marker", "missing-state-dir", "garbage-marker"],
)
def test_damaged_newest_falls_back_to_previous(tmp_path, mesh, caplog, damage, why):
    _save_two(tmp_path, mesh)
    damage(tmp_path / "2")
    caplog.set_level(logging.WARNING, logger="jaxrl.train.checkpoint")
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.latest_step() == 1
        step, restored, meta = mgr.restore(target=make_state(mesh))
    assert step == 1 and meta == {"step": 1}
    assert_same_values(restored, make_state(mesh, seed=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2.corrupt"]
    msgs = _warnings(caplog)
    assert len(msgs) == 1, msgs
    assert str(tmp_path / "2") in msgs[0] and why in msgs[0] and "2.corrupt" in msgs[0]
    assert "\n" not in msgs[0]


def test_damage_seen_by_the_same_manager_and_explicit_step(tmp_path, mesh, caplog):
    with CheckpointManager(tmp_path) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, make_state(mesh, seed=step), {"step": step})
        _empty_meta(tmp_path / "3")  # verified at save time; the cache must notice the change
        assert mgr.restore(target=make_state(mesh))[0] == 2
        _truncate_array(tmp_path / "1")
        with pytest.raises(FileNotFoundError, match="unusable"):
            mgr.restore(1, target=make_state(mesh))
        assert mgr.all_steps() == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1.corrupt", "2", "3.corrupt"]


def test_nothing_good_starts_fresh(tmp_path, mesh, caplog):
    _save_two(tmp_path, mesh)
    _garbage_marker(tmp_path / "1")
    _empty_meta(tmp_path / "2")
    caplog.set_level(logging.WARNING, logger="jaxrl.train.checkpoint")
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(target=make_state(mesh)) is None
        assert mgr.latest_step() is None and mgr.meta() is None
        msgs = _warnings(caplog)
        assert len(msgs) == 3 and "starting fresh" in msgs[-1] and str(tmp_path) in msgs[-1], msgs
        assert mgr.save(1, make_state(mesh, seed=9), {})  # and the run goes on from scratch
        assert mgr.restore(target=make_state(mesh))[0] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "1.corrupt", "2.corrupt"]


def test_corrupt_names_do_not_collide(tmp_path, mesh):
    _save_two(tmp_path, mesh)
    (tmp_path / "2.corrupt").mkdir()
    (tmp_path / "2.corrupt.1").mkdir()
    _delete_marker(tmp_path / "2")
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.latest_step() == 1
    assert (tmp_path / "2.corrupt.2" / "state").is_dir()


def test_marker_written_and_round_trip_bit_identical(tmp_path, mesh):
    state = make_state(mesh, seed=11)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(4, state, META)
    marker = json.loads((tmp_path / "4" / MARKER).read_text())
    assert marker["step"] == 4 and "meta/metadata" in marker["files"]
    assert not (tmp_path / "4" / (MARKER + ".tmp")).exists()
    for rel, entry in marker["files"].items():
        assert (tmp_path / "4" / rel).stat().st_size == entry["size"]
    with CheckpointManager(tmp_path) as mgr:
        step, restored, meta = mgr.restore(target=state)
    assert step == 4 and meta == META
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_legacy_checkpoints_without_marker(tmp_path, mesh, caplog):
    _save_two(tmp_path, mesh)
    _make_legacy(tmp_path / "1")
    _make_legacy(tmp_path / "2")
    with CheckpointManager(tmp_path) as mgr:  # intact legacy steps load as before
        step, restored, meta = mgr.restore(target=make_state(mesh))
        assert step == 2 and meta == {"step": 2}
        assert_same_values(restored, make_state(mesh, seed=2))
    _truncate_array(tmp_path / "2")  # a damaged legacy step fails its restore and is moved aside
    caplog.set_level(logging.WARNING, logger="jaxrl.train.checkpoint")
    with CheckpointManager(tmp_path) as mgr:
        step, restored, meta = mgr.restore(target=make_state(mesh))
    assert step == 1 and meta == {"step": 1}
    assert_same_values(restored, make_state(mesh, seed=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2.corrupt"]
    msgs = _warnings(caplog)
    assert len(msgs) == 1 and str(tmp_path / "2") in msgs[0], msgs


def test_target_mismatch_is_not_corruption(tmp_path, mesh):
    _save_two(tmp_path, mesh)
    bad = make_state(mesh)
    bad["counter"] = np.zeros(3, np.int64)
    with CheckpointManager(tmp_path) as mgr, pytest.raises(ValueError, match="does not match"):
        mgr.restore(target=bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


def test_keep_policy_ignores_corrupt_dirs(tmp_path, mesh):
    _save_two(tmp_path, mesh, keep=2)
    _truncate_array(tmp_path / "2")
    with CheckpointManager(tmp_path, keep=2) as mgr:
        assert mgr.latest_step() == 1
        for step in (2, 3, 4):
            mgr.save(step, make_state(mesh, seed=step), {"step": step})
        assert mgr.all_steps() == [3, 4] and mgr.latest_step() == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2.corrupt", "3", "4"]
