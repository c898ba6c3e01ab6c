"""Compiled executables on disk, keyed by what determines them, loaded without tracing or lowering.

JAX's persistent compilation cache keys an executable by its lowered program, so even a cache hit first traces
the Python function and lowers it to StableHLO: for the rollout's decode step of the tiny test model on a 2-core
Xeon about 160 ms and 200 ms before a 65 ms load (`jaxrl.compile_log`). This store keys an executable by its
inputs instead: the function (a module-level function of ours, found again by module and name, or a
`functools.partial` of one) with its bound and static arguments (values with a stable text form: numbers,
strings, tuples, dicts, enums, frozen dataclasses of them, shardings on the inputs' mesh, and objects that carry
the text of what made them, `KEY_ATTRIBUTE`: `jaxrl.train.optim.make_optimizer`'s transformations) and the jit's
options (static and donated arguments; a jit that places its inputs or outputs itself is not stored), the
abstract signature of every input (pytree structure, shapes, dtypes, shardings: the spec and the mesh's axis
names and shape; a Python scalar by its type) and everything else the program depends on: a hash of our
packages' sources (`jaxrl`, `models`, `kernels`, `sharding`), the JAX and jaxlib versions, the backend and its
devices' kind, JAX's config values that can change a program (and this thread's overrides of them), XLA_FLAGS,
and on the CPU the processor's feature flags. A hit is a file read and a deserialisation (about 5 ms).

The key holds no device: one file serves every device group of the same mesh shape (a TP1 rollout instance per
device, the processes of a multi-process run, each on its own devices) and every mesh of that shape over
several processes' devices (a multi-process run's train layout: each process loads the SPMD program, the
1-process run's too). The executable is serialised with its devices' ids (`jaxrl.serialized_executable`), which
a load maps, position by position in the mesh, onto the devices of the mesh it is loaded for, with XLA's device
assignment rebuilt for them (as JAX's persistent cache does with the CPU keys `jaxrl.runtime` makes device- and
process-free). One process at a time builds a missing entry (`Entry.load_or_build`); the others wait for it and
load it.

`ExecutableStore.default()` is the store under the persistent cache's directory (`executables/`), when that
cache is on and local; JAXRL_EXECUTABLE_STORE=0 turns the store off alone. `jaxrl.rollout.executor`'s
`ExecutableCache` uses it for every executable it builds: the rollout's prefill and decode steps, the train
update's gradient, optimizer-update, log-prob and blockwise-backward steps, the critic's (what cannot be keyed,
a closure, is compiled as before). A load records the events a persistent-cache hit
records (`jaxrl.runtime.CompileCounter` and `jaxrl.compile_log` count it as a load). A file that cannot be read
is removed and the program compiled. Like JAX's cache, loading runs the code in the files: the directory must be
as trusted as the program.

The store is bounded: a load marks its file used (its modification time), and a save that takes the store past
`max_bytes` (JAXRL_EXECUTABLE_STORE_MAX_GB, default 2) removes the least recently used files until it holds 90%
of it. Every change of our sources, JAX or its settings keys new entries, so without a bound the old ones piled
up (1.4 GB over a few weeks of this project's own development). Each process counts the store's size once, at
its first save, then adds what it writes; another process's writes are seen at the next count (a bound kept
within what the processes write between counts, not a quota).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib.util
import logging
import os
import pickle
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jaxlib
import numpy as np
from jax._src import config, monitoring
from jax.sharding import NamedSharding

from jaxrl import runtime, serialized_executable as serialized

log = logging.getLogger(__name__)

FORMAT = 1
PACKAGES = ("jaxrl", "models", "kernels", "sharding")
# JAX settings that change no program: where caches live and what is logged (the rest are part of the key)
_CONFIG_IGNORED = {"jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                   "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size",
                   "jax_enable_compilation_cache", "jax_num_cpu_devices", "jax_platforms", "jax_platform_name",
                   "jax_log_compiles", "jax_explain_cache_misses", "jax_logging_level", "jax_debug_log_modules"}
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_HIT = "/jax/compilation_cache/cache_hits"
_COMPILE = "/jax/core/compile/backend_compile_duration"


class NotStorable(Exception):
    """These inputs or static arguments have no stable key (the executable is compiled as usual)."""


KEY_ATTRIBUTE = "__jaxrl_key__"


def stable_text(x, mesh=None) -> str:
    """A text form of a static argument that is the same in every process, or NotStorable. An object that is
    none of the kinds listed in the module docstring can carry one in `KEY_ATTRIBUTE`: the text of what made it,
    which must determine the programs it takes part in (`jaxrl.train.optim.make_optimizer`'s transformations).
    A NamedSharding is stable on `mesh` (the inputs' mesh, whose devices a load maps) only."""
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return repr(x)
    key = getattr(x, KEY_ATTRIBUTE, None)
    if isinstance(key, str):
        return key
    text = functools.partial(stable_text, mesh=mesh)
    if isinstance(x, enum.Enum):
        return f"{type(x).__qualname__}.{x.name}"
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__}({', '.join(map(text, x))})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{text(k)}: {text(v)}" for k, v in sorted(x.items(), key=lambda kv: text(kv[0]))) + "}"
    if isinstance(x, NamedSharding):
        if mesh is None or x.mesh != mesh:
            raise NotStorable("a sharding off the inputs' mesh")
        return f"NamedSharding{tuple(x.spec)}{x.memory_kind}"
    if dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x).__dataclass_params__.frozen:
        fields = ", ".join(f"{f.name}={text(getattr(x, f.name))}" for f in dataclasses.fields(x))
        return f"{type(x).__module__}.{type(x).__qualname__}({fields})"
    raise NotStorable(f"no stable key for {type(x).__name__}")


def _function(fn) -> str:
    """What a jitted function compiles: a module-level function of our packages, or a `functools.partial` of one
    with stable bound arguments, and the jit's options (a closure's program depends on what it closes over;
    another package's sources are not in the key). Jits that place their inputs or outputs themselves
    (in/out shardings or layouts, a device or backend) are not stored."""
    info, target = getattr(fn, "_jit_info", None), getattr(fn, "__wrapped__", None)
    if info is None or target is None:
        raise NotStorable(f"{fn!r} is not a jitted function")
    placed = (info.user_specified_in_shardings, info.device, info.backend,
              *(type(x).__name__ != "UnspecifiedValue" for x in info.out_shardings_leaves),
              *info.in_layouts_leaves, *info.out_layouts_leaves)
    if any(x not in (None, False) for x in placed):
        raise NotStorable("a jit with its own placement")
    bound = ""
    if isinstance(target, functools.partial):
        bound = (f"({', '.join(map(stable_text, target.args))}; "
                 f"{', '.join(f'{k}={stable_text(v)}' for k, v in sorted(target.keywords.items()))})")
        target = target.func
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", "<locals>")
    if module is None or "<locals>" in name or getattr(sys.modules.get(module), name, None) not in (fn, target):
        raise NotStorable(f"{fn!r} is not of a module-level function")
    if module.split(".")[0] not in PACKAGES:                 # (the key hashes these packages' sources only)
        raise NotStorable(f"{module} is not in {', '.join(PACKAGES)}")
    options = (info.static_argnums, info.static_argnames, info.donate_argnums, info.donate_argnames,
               info.keep_unused, info.inline, info.compiler_options_kvs)
    return f"{module}:{name}{bound} jit{stable_text(options)}"


def _mesh_and_signature(args):
    """(the devices of the one mesh every input lives on, that mesh, the device-free signature of the inputs)."""
    leaves, treedef = jax.tree.flatten(args)
    mesh, sig = None, []
    for x in leaves:
        if isinstance(x, (bool, int, float)):             # a Python scalar: weakly typed, its value not compiled in
            sig.append(f"py{type(x).__name__}")
            continue
        if isinstance(x, (np.ndarray, np.generic)):
            sig.append(f"host{x.shape}{x.dtype}")
            continue
        sh = getattr(x, "sharding", None)
        if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or not isinstance(sh, NamedSharding):
            raise NotStorable("an input without a NamedSharding")
        if mesh is None:
            mesh = sh.mesh
        elif sh.mesh != mesh:
            raise NotStorable("inputs on different meshes")
        spec = tuple(sh.spec)                      # as given: spellings of one placement are stored apart
        sig.append(f"{x.shape}{x.dtype}{spec}{sh.memory_kind}")
    if mesh is None:
        raise NotStorable("no device inputs")
    devices = list(mesh.devices.flat)            # (a mesh over several processes' devices too: see the docstring)
    layout = f"{tuple(mesh.shape.items())}{mesh.axis_types}"
    return devices, mesh, f"{treedef}|{layout}|{';'.join(sig)}"


@functools.cache
def _sources_hash() -> str:
    """sha256 of our packages' Python sources (file names and contents)."""
    h = hashlib.sha256()
    for name in PACKAGES:
        for root in sorted(map(Path, importlib.util.find_spec(name).submodule_search_locations)):
            for path in sorted(root.rglob("*.py")):
                h.update(f"{name}/{path.relative_to(root)}\0".encode())
                h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _cpu_features() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return next((ln for ln in lines if ln.startswith(("flags", "Features"))), "unknown")


def _trace_context() -> str:
    """JAX's settings as tracing sees them in this thread (`with jax.default_matmul_precision(...)` and the
    like override the global values); inside a transformation's axis environment nothing is stored."""
    parts = []
    for x in config.trace_context():
        if hasattr(x, "axis_sizes"):                           # jax._src.core.AxisEnv
            if x.axis_sizes:
                raise NotStorable("inside a named-axis transformation")
            continue
        parts.append(stable_text(x))
    return ",".join(parts)


def _environment(device) -> str:
    """What every program depends on beyond its inputs: versions, backend, settings, sources."""
    settings = {k: v for k, v in jax.config.values.items() if k not in _CONFIG_IGNORED}
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG))
    client = device.client
    parts = [f"format {FORMAT}", jax.__version__, jaxlib.__version__, client.platform, client.platform_version,
             device.device_kind, repr(sorted(settings.items())), _trace_context(), flags, _sources_hash()]
    if client.platform == "cpu":
        parts.append(_cpu_features())
    return "\n".join(parts)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One executable's place in the store: `load()` it (None when absent or unreadable), `save(compiled)`."""

    store: ExecutableStore
    key: str
    devices: tuple
    label: str

    @property
    def path(self) -> Path:
        return self.store.directory / f"{hashlib.sha256(self.key.encode()).hexdigest()}.exe"

    def load(self):
        path = self.path
        start = time.perf_counter()
        try:
            with open(path, "rb") as f:
                record = pickle.load(f)
        except FileNotFoundError:
            return None
        except Exception as e:                                  # a file cut short or written by something else
            return self._discard(path, e)
        try:
            if record["key"] != self.key:                        # (a sha256 collision: never seen, but checked)
                return None
            compiled = serialized.deserialize(record, self.devices)
        except Exception as e:
            return self._discard(path, e)
        with contextlib.suppress(OSError):          # used now: the last to go when the store is trimmed
            os.utime(path)
        monitoring.record_event(_HIT)                # as a persistent-cache hit: CompileCounter, compile_log
        monitoring.record_event_duration_secs(_COMPILE, time.perf_counter() - start, fun_name=f"jit({self.label})")
        return compiled

    def load_or_build(self, build):
        """(the stored executable, True), or (`build()`, False), saved. One process at a time builds an entry
        (`jaxrl.runtime.build_once`: a lock file per entry, `locks/<file name>`): the processes of a
        multi-process run miss on the same programs at the same moment, and the others wait and load it
        instead of tracing and lowering it too."""
        exe = self.load()
        if exe is not None:
            return exe, True
        built = []

        def build_and_save():
            built.append(build())
            self.save(built[0])
            return built[0]

        exe = runtime.build_once(self.store.directory / "locks" / self.path.name, self.load, build_and_save)
        return exe, not built

    def _discard(self, path: Path, error: Exception):
        log.warning("executable store: %s unreadable (%s: %s); removed, compiling instead", path,
                    type(error).__name__, error)
        path.unlink(missing_ok=True)
        return None

    def save(self, compiled) -> bool:
        """Write `compiled` (atomically: a reader sees the whole file or none); False if it cannot be stored.
        An executable JAX's persistent cache loaded is stored with the bytes that cache holds: XLA:CPU cannot
        serialise a deserialised executable again (the copy fails at run time: "Function ... not found")."""
        ids = [d.id for d in self.devices]
        try:
            if [d.id for d in serialized.assigned_devices(compiled)] != ids:
                return False                      # assigned in another order than the mesh's: not remapped here
            payload, in_tree, out_tree = serialized.serialize(compiled)
        except (ValueError, NotImplementedError, AttributeError) as e:   # e.g. host callbacks, constants
            log.debug("executable store: %s not serialisable: %s", self.label, e)
            return False
        record = {"key": self.key, "ids": ids, "payload": payload,
                  "in": in_tree.unflatten(range(in_tree.num_leaves)),
                  "out": out_tree.unflatten(range(out_tree.num_leaves))}
        self.store.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.store.directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        try:
            self.store.added(self.path)
        except OSError as e:         # (another process trimmed it already, a file not ours to remove): still saved
            log.warning("executable store %s: not trimmed (%s: %s)", self.store.directory, type(e).__name__, e)
        return True


DEFAULT_MAX_GB = 2.0
_sizes: dict[Path, int] = {}            # directory -> its bytes as this process counts them (`ExecutableStore.added`)
_sizes_lock = threading.Lock()


def max_bytes_from_env() -> int:
    """JAXRL_EXECUTABLE_STORE_MAX_GB (default `DEFAULT_MAX_GB`) in bytes; a clear error for a bad value."""
    text = os.environ.get("JAXRL_EXECUTABLE_STORE_MAX_GB", str(DEFAULT_MAX_GB))
    try:
        gb = float(text)
    except ValueError:
        gb = -1.0
    if not 0 < gb < 2**33:                            # (not NaN nor infinite: the store's bound is a size)
        raise ValueError(f"JAXRL_EXECUTABLE_STORE_MAX_GB={text!r}: a positive number of GB (default "
                         f"{DEFAULT_MAX_GB}); JAXRL_EXECUTABLE_STORE=0 turns the store off")
    return max(1, int(gb * 2**30))


@dataclasses.dataclass(frozen=True)
class ExecutableStore:
    """A directory of serialised executables (see the module docstring), at most about `max_bytes` of them."""

    directory: Path
    max_bytes: int = int(DEFAULT_MAX_GB * 2**30)

    def added(self, path: Path) -> None:
        """Count the file just written at `path`; past `max_bytes`, `trim`."""
        size = path.stat().st_size
        with _sizes_lock:
            known = _sizes.get(self.directory)
            total = self._count() if known is None else known + size
            _sizes[self.directory] = total
            if total > self.max_bytes:
                _sizes[self.directory] = self.trim(keep=path)

    def _count(self) -> int:
        return sum(size for _, size, _ in self._files())

    def _files(self) -> list:
        files = []
        for p in self.directory.glob("*.exe"):
            try:
                st = p.stat()
            except FileNotFoundError:                # (another process trimmed it meanwhile)
                continue
            files.append((st.st_mtime, st.st_size, p))
        return files

    def trim(self, keep: Path | None = None) -> int:
        """Remove the least recently used entries (oldest modification time: a load touches its file) until the
        store holds at most 90% of `max_bytes` (not `keep`); returns the bytes left."""
        files = sorted(self._files())
        total, removed, freed = sum(size for _, size, _ in files), 0, 0
        for _, size, p in files:
            if total <= 0.9 * self.max_bytes:
                break
            if p == keep:
                continue
            p.unlink(missing_ok=True)
            total, removed, freed = total - size, removed + 1, freed + size
        if removed:
            log.info("executable store %s: removed the %d least recently used entries (%.0f MB) to stay under "
                     "%.2f GB (JAXRL_EXECUTABLE_STORE_MAX_GB)", self.directory, removed, freed / 2**20,
                     self.max_bytes / 2**30)
        return total

    @classmethod
    def default(cls) -> ExecutableStore | None:
        """The store beside JAX's persistent cache (`<cache dir>/executables`), or None when that cache is off,
        remote, or JAXRL_EXECUTABLE_STORE is 0."""
        if os.environ.get("JAXRL_EXECUTABLE_STORE", "1").lower() in ("0", "false", "off", "no"):
            return None
        directory = jax.config.jax_compilation_cache_dir
        if not directory or "://" in directory:
            return None
        return cls(Path(directory) / "executables", max_bytes_from_env())

    def entry(self, label: str, fn, args: tuple, static: dict) -> Entry | None:
        """The entry of jitted `fn` on these inputs (arrays or ShapeDtypeStructs with NamedShardings) and
        static keyword arguments; None when they have no stable key."""
        try:
            devices, mesh, signature = _mesh_and_signature(args)
            statics = ", ".join(f"{k}={stable_text(v, mesh)}" for k, v in sorted(static.items()))
            key = "\n".join([_function(fn), statics, signature, _environment(devices[0])])
        except NotStorable as e:
            log.debug("executable store: %s not stored: %s", label, e)
            return None
        return Entry(self, key, tuple(devices), getattr(fn, "__name__", label))
