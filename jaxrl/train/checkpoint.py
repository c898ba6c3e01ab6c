"""Complete, atomic training checkpoints over orbax: array state + JSON metadata per step.

A checkpoint is one orbax step directory with two items:

* ``state`` — a pytree of arrays (params, optimizer state, RNG key *data*, counters …), written with
  ``StandardSave`` (OCDBT/tensorstore; each process writes only the shards it owns);
* ``meta``  — a JSON-able dict (data cursor, config YAML text, length-ranker state, long-prompt
  queue …), written with ``JsonSave`` by the primary process.

Guarantees, and what provides them:

* **Atomic.** Orbax writes ``<step>.orbax-checkpoint-tmp-<ts>/`` and renames it to ``<step>/`` only
  after every item is complete (``AtomicRenameTemporaryPath`` on POSIX file systems; a
  ``commit_success.txt`` marker on object stores such as GCS). Step discovery ignores temporary
  directories, so a save killed at any moment leaves ``latest_step()`` at the previous complete step;
  ``cleanup_tmp_directories=True`` deletes the debris when the next manager opens the directory.
* **Durable on return.** :meth:`CheckpointManager.save` blocks until the write (and the rename) has
  finished, so a ``kill -9`` right after it returns cannot lose that step. (Process death only; the
  file system's own crash semantics decide what survives a power loss.)
* **Keep last N.** Older steps are deleted after a newer one is committed, never before.
* **Restored into the caller's shardings.** ``restore(target=...)`` reads each leaf straight into
  the ``NamedSharding`` of the matching target leaf (each device reads only its slice), so a run can
  resume on a different mesh. Saved shapes and dtypes must match the target exactly: orbax itself
  would silently cast dtypes and pad/truncate shapes, which would break bit-identical resume.

Multi-process runs: every process must call ``save``/``restore``/``latest_step`` with the same
arguments (orbax synchronises the processes and elects the primary for directory operations and for
the JSON item); ``directory`` must be on a file system all processes see. Only process 0's ``meta``
is written, so per-process state (e.g. a process-local data cursor) must either be identical across
processes or go into ``state`` as a global array. Tests here are single-process.

PRNG keys: orbax stores plain arrays, and typed keys (``jax.random.key``) are rejected with a
message. Store ``jax.random.key_data(key)`` (uint32) in ``state`` and rewrap after restore with
``jax.random.wrap_key_data(data, impl=...)`` — the impl (threefry by default) is part of the
config, not the checkpoint.

Simplified: synchronous saves only (orbax's async mode would overlap the write with the next step,
but then "durable on return" no longer holds); no best-by-metric retention; no partial restore.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["CheckpointManager"]

_ITEMS = ("state", "meta")


def _path_str(path) -> str:
    """A tree path in orbax's leaf-name form: ``opt.0.mu.w`` (dict keys, indices, attribute names)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return ".".join(parts)


def _is_typed_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _check_no_typed_keys(tree, what: str) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if _is_typed_key(leaf):
            raise TypeError(
                f"{what} leaf {_path_str(path)!r} is a typed PRNG key ({leaf.dtype}); store "
                "jax.random.key_data(key) and rewrap with jax.random.wrap_key_data after restore"
            )


def _restore_spec(target):
    """Target leaves → what orbax restores into: ShapeDtypeStruct with a sharding, or np.ndarray."""

    def one(path, x):
        if isinstance(x, jax.ShapeDtypeStruct):
            if x.sharding is None:
                raise ValueError(
                    f"restore target leaf {_path_str(path)!r} is a ShapeDtypeStruct without a "
                    "sharding; give every jax leaf a sharding (orbax would otherwise fall back to "
                    "the saved device layout, which need not exist on this mesh)"
                )
            return x
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, np.ndarray | np.generic):
            return np.asarray(x)
        raise TypeError(
            f"restore target leaf {_path_str(path)!r} has type {type(x).__name__}; expected "
            "jax.ShapeDtypeStruct (with .sharding), jax.Array or np.ndarray"
        )

    return jax.tree_util.tree_map_with_path(one, target)


class CheckpointManager:
    """Saves and restores ``(step, state pytree, meta dict)`` under ``directory/<step>/``.

    ``keep``: how many most recent steps to retain. ``every``: ``save`` writes only when
    ``step % every == 0`` (or ``force=True``, e.g. at the last step or on a preemption signal).
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, every: int = 1):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.directory = Path(directory).absolute()
        self.every = every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            cleanup_tmp_directories=True,  # remove debris of saves killed mid-write
            enable_async_checkpointing=False,  # save() returns only once the step is committed
        )
        self._mgr = ocp.CheckpointManager(
            self.directory,
            item_names=_ITEMS,
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
            options=options,
        )

    # ------------------------------------------------------------------ queries

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (temporary directories of interrupted saves are never listed)."""
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        """Write ``state`` and ``meta`` as ``step``; returns whether a checkpoint was written.

        Blocks until the step directory is committed. Raises if ``step`` is not newer than the
        latest saved step (orbax would skip it silently), if ``meta`` is not JSON-serialisable, or if
        ``state`` holds a typed PRNG key.
        """
        step = int(step)
        if not force and step % self.every:
            return False
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(f"checkpoint step {step} is not newer than the latest saved step {latest} in {self.directory}")
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint meta must be JSON-serialisable: {e}") from e
        _check_no_typed_keys(state, "checkpoint state")
        saved = self._mgr.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,  # the interval decision was made above
        )
        self._mgr.wait_until_finished()
        if not saved:  # orbax declined although we checked: never let that pass silently
            raise RuntimeError(f"orbax did not save step {step} in {self.directory}")
        return True

    # ------------------------------------------------------------------ restore

    def _resolve_step(self, step: int | None) -> int | None:
        self._mgr.reload()  # another process (or an earlier run) may have written steps
        if step is None:
            return self.latest_step()
        if step not in self._mgr.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}")
        return int(step)

    def meta(self, step: int | None = None) -> dict | None:
        """Only the JSON item (e.g. to read the saved config before building the model); None if empty."""
        step = self._resolve_step(step)
        if step is None:
            return None
        return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def restore(self, step: int | None = None, *, target: Any) -> tuple[int, Any, dict] | None:
        """Restore ``step`` (default: latest) as ``(step, state, meta)``; None if there is no checkpoint.

        ``target`` has the structure of the saved state; each leaf is a ``jax.ShapeDtypeStruct``
        with a ``sharding`` (or a ``jax.Array``, whose shape/dtype/sharding are used) — the restored
        leaf is a ``jax.Array`` with exactly that sharding — or an ``np.ndarray``, restored as numpy.
        Structure, shape or dtype mismatches with the saved step raise ``ValueError``.
        """
        step = self._resolve_step(step)
        if step is None:
            return None
        _check_no_typed_keys(target, "restore target")
        spec = _restore_spec(target)
        self._check_matches_saved(step, spec)
        restored = self._mgr.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(spec), meta=ocp.args.JsonRestore()),
        )
        return step, restored.state, restored.meta

    def _check_matches_saved(self, step: int, spec) -> None:
        saved_tree = self._mgr.item_metadata(step).state.tree
        saved = {
            _path_str(p): m
            for p, m in jax.tree_util.tree_flatten_with_path(saved_tree, is_leaf=lambda m: hasattr(m, "shape"))[0]
        }
        wanted = {_path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(spec)[0]}
        problems = []
        for name in sorted(set(saved) ^ set(wanted)):
            problems.append(f"{name}: {'missing from target' if name in saved else 'not in checkpoint'}")
        for name in sorted(set(saved) & set(wanted)):
            s, w = saved[name], wanted[name]
            if not hasattr(s, "shape"):
                continue
            if tuple(s.shape) != tuple(w.shape) or np.dtype(s.dtype) != np.dtype(w.dtype):
                problems.append(f"{name}: saved {s.dtype}{list(s.shape)}, target {w.dtype}{list(w.shape)}")
        if problems:
            shown = "\n  ".join(problems[:20]) + (f"\n  … and {len(problems) - 20} more" if len(problems) > 20 else "")
            raise ValueError(f"checkpoint step {step} in {self.directory} does not match the restore target:\n  {shown}")

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        self._mgr.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
