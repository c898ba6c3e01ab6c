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
* **Verified.** After orbax has committed a step, :meth:`CheckpointManager.save` fsyncs every file
  and directory in it and then writes ``<step>/COMMITTED`` last (temp file, fsync, rename, fsync):
  JSON with the size and SHA-256 of every file in the step. A step counts as good only if its marker
  is present, parses, and matches the files, and its ``meta/metadata`` JSON parses; ``restore`` then
  also requires orbax's restore to succeed. Steps written before markers existed ("legacy": no
  marker, and no ``jaxrl_checkpoint_format`` in orbax's ``_CHECKPOINT_METADATA``) are checked by
  parsing their metadata and by restoring them. A step saved by this code but without a marker
  (killed between orbax's rename and the marker) is *uncommitted* and treated as bad.
* **Never a dead end.** A bad step is logged in one line (which directory, why) and moved aside to
  ``<step>.corrupt`` (``.corrupt.1``, ``.corrupt.2`` … if taken), and ``latest_step``/``restore``
  fall back to the newest good step; if none is left, one line says the run starts fresh and
  ``restore`` returns None. Nothing is deleted: ``*.corrupt*`` directories are ignored by step
  discovery and by the keep-N policy. A restore *target* that does not match a good step (shape,
  dtype, structure) is a caller error and raises ``ValueError``; it never moves anything aside.
* **Keep last N.** Older steps are deleted after a newer one is committed, never before.
* **Restored into the caller's shardings.** ``restore(target=...)`` reads each leaf straight into
  the ``NamedSharding`` of the matching target leaf (each device reads only its slice), so a run can
  resume on a different mesh, and on another number of processes (each reads the slices its devices hold;
  ``processes(step)`` says how many saved it). Saved shapes and dtypes must match the target exactly: orbax itself
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

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)

_ITEMS = ("state", "meta")
MARKER = "COMMITTED"  # written last, inside the step directory, once everything else is durable
_FORMAT_KEY = "jaxrl_checkpoint_format"  # in orbax's custom metadata: "this step must have a marker"
_FORMAT = 2
_PROCESSES_KEY = "jaxrl_processes"  # in orbax's custom metadata: how many processes saved the step
_META_FILE = Path("meta") / "metadata"


class _Bad(Exception):
    """A step directory that is not a usable checkpoint; the message is the one-line reason."""


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or "(no message)"
    text = f"{type(e).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _hash_file(path: Path, *, fsync: bool = False) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return size, h.hexdigest()


def _files(step_dir: Path) -> list[Path]:
    """Every regular file under ``step_dir`` except the marker (and its temp file), sorted."""
    out = []
    for root, dirs, names in os.walk(step_dir):
        dirs.sort()
        for n in names:
            p = Path(root, n)
            rel = p.relative_to(step_dir)
            if rel.parts[0] in (MARKER, MARKER + ".tmp"):
                continue
            out.append(p)
    return sorted(out)


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
        self._good: dict[int, tuple] = {}  # step -> fingerprint of the files when it last verified
        self._bad: set[int] = set()  # steps found bad in this process (normally also renamed away)
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

    # ------------------------------------------------------------------ verification

    def _step_dir(self, step: int) -> Path:
        return self.directory / str(int(step))

    @staticmethod
    def _is_primary() -> bool:
        return jax.process_index() == 0

    @staticmethod
    def _fingerprint(step_dir: Path) -> tuple:
        """Cheap identity of a step's files (names, sizes, mtimes): a verified step is re-hashed only if it changes."""
        out = []
        for p in _files(step_dir) + [step_dir / MARKER]:
            try:
                st = p.stat()
            except OSError:
                out.append((str(p), None))
                continue
            out.append((str(p), st.st_size, st.st_mtime_ns, st.st_ino))
        return tuple(out)

    @staticmethod
    def _format_of(step_dir: Path):
        """The format this code records in orbax's step metadata; None for legacy (pre-marker) steps."""
        try:
            doc = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
            return (doc.get("custom_metadata") or {}).get(_FORMAT_KEY)
        except Exception:  # unreadable: decided by the legacy checks and the restore itself
            return None

    def processes(self, step: int) -> int | None:
        """How many processes saved ``step`` (None: a step saved before this was recorded)."""
        try:
            doc = json.loads((self._step_dir(step) / "_CHECKPOINT_METADATA").read_text())
            return int((doc.get("custom_metadata") or {})[_PROCESSES_KEY])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _verify(self, step: int) -> None:
        """Raise ``_Bad(reason)`` unless ``step`` looks complete (see the module docstring)."""
        d = self._step_dir(step)
        if not d.is_dir():
            raise _Bad("the directory is missing")
        fingerprint = self._fingerprint(d)
        if self._good.get(step) == fingerprint:
            return
        marker = d / MARKER
        if marker.exists():
            self._check_marker(d, step, marker)
        elif self._format_of(d) is not None:
            raise _Bad(f"no {MARKER} marker (the save did not finish)")
        self._check_meta(d)
        if not marker.exists():  # legacy step: orbax must at least read its metadata (restore decides the rest)
            try:
                self._mgr.item_metadata(step).state.tree  # noqa: B018
            except Exception as e:
                raise _Bad(f"orbax cannot read its state metadata ({_one_line(e)})") from None
        self._good[step] = fingerprint

    @staticmethod
    def _check_marker(d: Path, step: int, marker: Path) -> None:
        try:
            doc = json.loads(marker.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise _Bad(f"{MARKER} marker is unreadable ({_one_line(e)})") from None
        files = doc.get("files") if isinstance(doc, dict) else None
        if not isinstance(files, dict) or not files or doc.get("step") != step:
            raise _Bad(f"{MARKER} marker is malformed")
        for rel, want in sorted(files.items()):
            if not (isinstance(want, dict) and isinstance(want.get("size"), int) and isinstance(want.get("sha256"), str)):
                raise _Bad(f"{MARKER} marker is malformed (entry {rel!r})")
            path = d / rel
            if not path.is_file():
                raise _Bad(f"{rel} is missing")
            size = path.stat().st_size
            if size != want["size"]:
                raise _Bad(f"{rel} has {size} bytes, {MARKER} says {want['size']}")
            if _hash_file(path)[1] != want["sha256"]:
                raise _Bad(f"{rel} does not match its SHA-256 in {MARKER}")

    @staticmethod
    def _check_meta(d: Path) -> None:
        path = d / _META_FILE
        if not path.is_file():
            raise _Bad(f"{_META_FILE.as_posix()} is missing")
        try:
            meta = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise _Bad(f"{_META_FILE.as_posix()} is not valid JSON ({_one_line(e)})") from None
        if not isinstance(meta, dict):
            raise _Bad(f"{_META_FILE.as_posix()} holds a {type(meta).__name__}, not a JSON object")

    def _quarantine(self, step: int, reason: str) -> None:
        """Log one line and move ``<step>`` aside to ``<step>.corrupt`` (``.corrupt.N`` if taken)."""
        src = self._step_dir(step)
        self._good.pop(step, None)
        self._bad.add(step)  # skipped in this process even if the rename fails or is left to the primary
        dst = src.with_name(f"{src.name}.corrupt")
        n = 0
        while dst.exists():
            n += 1
            dst = src.with_name(f"{src.name}.corrupt.{n}")
        if self._is_primary():
            try:
                src.rename(dst)
                _fsync_dir(self.directory)
                where = f"moved it to {dst.name}"
            except OSError as e:
                where = f"could not move it aside ({_one_line(e)})"
            log.warning("checkpoint %s is unusable: %s; %s, falling back to an older checkpoint", src, reason, where)
        self._reload()

    RELOAD_TRIES, RELOAD_WAIT_S = 50, 0.1

    def _reload(self) -> None:
        """orbax's reload, again while a step directory vanishes under it: in a multi-process run the primary
        renames a bad step aside while the others reload (seen: a 2-process resume after a kill, the other
        process's orbax reading ``<step>/_CHECKPOINT_METADATA`` after the rename: NotADirectoryError)."""
        for attempt in range(self.RELOAD_TRIES):
            try:
                return self._mgr.reload()
            except (FileNotFoundError, NotADirectoryError):
                if attempt == self.RELOAD_TRIES - 1:
                    raise
                time.sleep(self.RELOAD_WAIT_S)

    def _newest_good(self) -> tuple[int | None, bool]:
        """(newest step that passes ``_verify`` or None, whether any step was moved aside on the way)."""
        self._reload()
        moved = False
        for step in sorted(self._mgr.all_steps(), reverse=True):
            if step in self._bad:
                continue
            try:
                self._verify(step)
                return int(step), moved
            except _Bad as e:
                self._quarantine(step, str(e))
                moved = True
        return None, moved

    def _starting_fresh(self) -> None:
        if self._is_primary():
            log.warning("no usable checkpoint left in %s; starting fresh", self.directory)

    # ------------------------------------------------------------------ queries

    def all_steps(self) -> list[int]:
        """Steps on disk, ascending (temporary directories of interrupted saves and ``*.corrupt*`` never listed).

        Not verified: ``latest_step``/``restore`` verify, and move aside what fails.
        """
        return sorted(s for s in self._mgr.all_steps() if s not in self._bad)

    def latest_step(self) -> int | None:
        """Newest *good* step; bad newer ones are logged and moved aside (see the module docstring)."""
        step, moved = self._newest_good()
        if step is None and moved:
            self._starting_fresh()
        return step

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        """Write ``state`` and ``meta`` as ``step``; returns whether a checkpoint was written.

        Blocks until the step directory is committed, fsynced and has its ``COMMITTED`` marker.
        Raises if ``step`` is not newer than the latest saved step (orbax would skip it silently), if
        ``meta`` is not JSON-serialisable, or if ``state`` holds a typed PRNG key.
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
            # "this step is only complete with its marker"; the processes that wrote it (a resume may use others)
            custom_metadata={_FORMAT_KEY: _FORMAT, _PROCESSES_KEY: jax.process_count()},
            force=True,  # the interval decision was made above
        )
        self._mgr.wait_until_finished()
        if not saved:  # orbax declined although we checked: never let that pass silently
            raise RuntimeError(f"orbax did not save step {step} in {self.directory}")
        self._commit(step)
        return True

    def _commit(self, step: int) -> None:
        """fsync every file and directory of the step, then write the marker last (temp, fsync, rename, fsync)."""
        d = self._step_dir(step)
        if self._is_primary():
            files = {}
            for path in _files(d):
                size, digest = _hash_file(path, fsync=True)
                files[path.relative_to(d).as_posix()] = {"size": size, "sha256": digest}
            for root, _, _ in os.walk(d):
                _fsync_dir(Path(root))
            tmp = d / (MARKER + ".tmp")
            with open(tmp, "w") as f:
                json.dump({"format": _FORMAT, "step": step, "files": files}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, d / MARKER)
            _fsync_dir(d)
            _fsync_dir(self.directory)
            self._good[step] = self._fingerprint(d)
        self._bad.discard(step)
        if jax.process_count() > 1:  # no process may look for the marker before it exists
            multihost_utils.sync_global_devices(f"jaxrl_checkpoint_commit_{self.directory}_{step}")

    # ------------------------------------------------------------------ restore

    def _resolve_explicit(self, step: int) -> int:
        self._reload()  # another process (or an earlier run) may have written steps
        step = int(step)
        if step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}")
        try:
            self._verify(step)
        except _Bad as e:
            self._quarantine(step, str(e))
            raise FileNotFoundError(f"checkpoint step {step} in {self.directory} is unusable: {e} (moved aside)") from None
        return step

    def _candidates(self, step: int | None):
        """Yield the explicit step once, or good steps newest first (the caller quarantines failures)."""
        if step is not None:
            yield self._resolve_explicit(step)
            return
        moved = False
        while True:
            s, m = self._newest_good()
            moved |= m
            if s is None:
                if moved:
                    self._starting_fresh()
                return
            moved = True  # if the caller rejects this one, the next None means "nothing usable left"
            yield s

    def meta(self, step: int | None = None) -> dict | None:
        """Only the JSON item (e.g. to read the saved config before building the model); None if empty."""
        for s in self._candidates(step):
            try:
                return self._mgr.restore(s, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            except Exception as e:
                self._quarantine(s, f"orbax could not restore meta ({_one_line(e)})")
                if step is not None:
                    raise FileNotFoundError(f"checkpoint step {s} in {self.directory} is unusable (moved aside)") from e
        return None

    def restore(self, step: int | None = None, *, target: Any) -> tuple[int, Any, dict] | None:
        """Restore ``step`` (default: newest good) as ``(step, state, meta)``; None if there is none.

        ``target`` has the structure of the saved state; each leaf is a ``jax.ShapeDtypeStruct``
        with a ``sharding`` (or a ``jax.Array``, whose shape/dtype/sharding are used) — the restored
        leaf is a ``jax.Array`` with exactly that sharding — or an ``np.ndarray``, restored as numpy.
        Structure, shape or dtype mismatches with the saved step raise ``ValueError``. A step that
        fails verification or orbax's restore is moved aside and the next older one is tried.
        """
        _check_no_typed_keys(target, "restore target")
        spec = _restore_spec(target)
        for s in self._candidates(step):
            try:
                saved_tree = self._mgr.item_metadata(s).state.tree
            except Exception as e:
                self._bad_during_restore(s, step, f"orbax cannot read its state metadata ({_one_line(e)})", e)
                continue
            self._check_matches_saved(s, spec, saved_tree)  # a caller error, not a damaged step
            try:
                restored = self._mgr.restore(
                    s,
                    args=ocp.args.Composite(state=ocp.args.StandardRestore(spec), meta=ocp.args.JsonRestore()),
                )
            except Exception as e:
                self._bad_during_restore(s, step, f"orbax restore failed ({_one_line(e)})", e)
                continue
            return s, restored.state, restored.meta
        return None

    def _bad_during_restore(self, s: int, explicit: int | None, reason: str, e: Exception) -> None:
        self._quarantine(s, reason)
        if explicit is not None:
            raise FileNotFoundError(f"checkpoint step {s} in {self.directory} is unusable: {reason} (moved aside)") from e

    def _check_matches_saved(self, step: int, spec, saved_tree) -> None:
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
