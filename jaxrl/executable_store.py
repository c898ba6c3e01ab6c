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
1-process run's too). The executable is serialised with its devices' ids, which a load maps, position by
position in the mesh, onto the devices of the mesh it is loaded for, with XLA's device assignment rebuilt for
them (as JAX's persistent cache does with the CPU keys `jaxrl.runtime` makes device- and process-free). One
process at a time builds a missing entry (`Entry.load_or_build`); the others wait for it and load it.

`ExecutableStore.default()` is the store under the persistent cache's directory (`executables/`), when that
cache is on and local; JAXRL_EXECUTABLE_STORE=0 turns the store off alone. `jaxrl.rollout.executor`'s
`ExecutableCache` uses it for every executable it builds: the rollout's prefill and decode steps, the train
update's gradient, optimizer-update, log-prob and blockwise-backward steps, the critic's (what cannot be keyed,
a closure, is compiled as before). A load records the events a persistent-cache hit
records (`jaxrl.runtime.CompileCounter` and `jaxrl.compile_log` count it as a load). A file that cannot be read
is removed and the program compiled. Like JAX's cache, loading runs the code in the files: the directory must be
as trusted as the program. Entries are never evicted (nor are JAX's by default); delete the directory to clear.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.util
import io
import logging
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import jax
import jaxlib
import numpy as np
from jax._src import compilation_cache, compiler, config, monitoring
from jax._src.lib import xla_client as xc
from jax.experimental import serialize_executable
from jax.sharding import NamedSharding

from jaxrl import runtime

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
            compiled = _deserialize(record, self.devices)
        except Exception as e:
            return self._discard(path, e)
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
            if [d.id for d in _assigned_devices(compiled)] != ids:
                return False                      # assigned in another order than the mesh's: not remapped here
            payload, in_tree, out_tree = _serialize(compiled, _jax_cache_bytes(compiled.runtime_executable()))
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
        return True


def _assigned_devices(compiled) -> list:
    """The executable's device assignment, every process's devices (the XLA executable lists its own only)."""
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if unloaded is None:
        raise ValueError("not serialisable")
    return list(unloaded.device_list)


class _Pickler(serialize_executable._JaxPjrtPickler):
    """JAX's pickler for compiled executables, with the XLA executable's bytes given (`cached`) or serialised."""

    def __init__(self, file, cached: bytes | None):
        super().__init__(file)
        self.cached = cached

    def persistent_id(self, obj):
        if self.cached is not None and isinstance(obj, xc.LoadedExecutable):
            return "exec", self.cached
        return super().persistent_id(obj)


def _serialize(compiled, cached: bytes | None):
    """`jax.experimental.serialize_executable.serialize`, through `_Pickler`."""
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if unloaded is None or compiled._params.const_args:
        raise ValueError("not serialisable")
    args_info_flat, in_tree = jax.tree.flatten(compiled.args_info)
    with io.BytesIO() as f:
        _Pickler(f, cached).dump((unloaded, args_info_flat, compiled._no_kwargs))
        return f.getvalue(), in_tree, compiled.out_tree


_FROM_JAX_CACHE: dict[int, tuple[bytes, str]] = {}     # id(LoadedExecutable) -> (its fingerprint, JAX's key)


def _note_jax_cache_loads() -> None:
    """Remember which XLA executables JAX's persistent cache deserialised, and under which key: JAX's in-memory
    caches hand the same object to every later `lower().compile()` of the same program."""
    get = compilation_cache.get_executable_and_time
    if getattr(get, "_jaxrl_noted", False):
        return

    def noted(cache_key, compile_options, backend, executable_devices):
        executable, seconds = get(cache_key, compile_options, backend, executable_devices)
        if executable is not None:
            _FROM_JAX_CACHE[id(executable)] = (executable.fingerprint, cache_key)
        return executable, seconds

    noted._jaxrl_noted = True
    compilation_cache.get_executable_and_time = noted


_note_jax_cache_loads()


def _jax_cache_bytes(executable) -> bytes | None:
    """The bytes JAX's persistent cache deserialised `executable` from (None: compiled in this process).

    The table is keyed by id() (an XLA executable takes no weak reference), so an entry can be stale: a freed
    executable's id reused by another one. Every load from JAX's cache writes its id's entry anew, so an entry
    whose fingerprint differs from the executable's is stale and the executable was compiled here: it is
    serialised itself. An empty fingerprint (XLA:CPU gives a program without inputs none) tells nothing:
    such a program under a noted id is not stored (compiled again next time)."""
    fingerprint, key = _FROM_JAX_CACHE.get(id(executable), (None, None))
    if key is None:
        return None
    if not executable.fingerprint:                   # (whatever the entry says: another program's bytes, or its own)
        raise ValueError("cannot tell it from a program JAX's cache loaded")
    if fingerprint != executable.fingerprint:
        _FROM_JAX_CACHE.pop(id(executable), None)                       # stale: compiled in this process
        return None
    cache = compilation_cache._get_cache(executable.client)
    data = cache.get(key) if cache is not None else None
    if data is None:
        raise ValueError("its persistent-cache entry is gone")
    return compilation_cache.extract_executable_and_time(compilation_cache.decompress_executable(data))[0]


class _Unpickler(serialize_executable._JaxPjrtUnpickler):
    """JAX's unpickler for serialised executables, with the saved device ids mapped onto `devices` (the same
    positions in the mesh) and the XLA executable's device assignment rebuilt for them."""

    def __init__(self, file, devices: list, saved_ids: list[int]):
        super().__init__(file, devices[0].client, devices)
        self.devices_by_id = dict(zip(saved_ids, devices))
        self._assignment = np.array(devices)[None, :]

    def persistent_load(self, pid):
        if pid[0] == "exec":
            options = compiler.get_compile_options(num_replicas=1, num_partitions=self._assignment.shape[1],
                                                   device_assignment=self._assignment, backend=self.backend)
            return self.backend.deserialize_executable(pid[1], self.execution_devices, options)
        return super().persistent_load(pid)


def _deserialize(record: dict, devices: tuple):
    unloaded, args_info_flat, no_kwargs = _Unpickler(io.BytesIO(record["payload"]), list(devices),
                                                     record["ids"]).load()
    args_info = jax.tree.structure(record["in"]).unflatten(args_info_flat)
    return jax.stages.Compiled(unloaded.load(), [], args_info, jax.tree.structure(record["out"]),
                               no_kwargs=no_kwargs)


@dataclasses.dataclass(frozen=True)
class ExecutableStore:
    """A directory of serialised executables (see the module docstring)."""

    directory: Path

    @classmethod
    def default(cls) -> ExecutableStore | None:
        """The store beside JAX's persistent cache (`<cache dir>/executables`), or None when that cache is off,
        remote, or JAXRL_EXECUTABLE_STORE is 0."""
        if os.environ.get("JAXRL_EXECUTABLE_STORE", "1").lower() in ("0", "false", "off", "no"):
            return None
        directory = jax.config.jax_compilation_cache_dir
        if not directory or "://" in directory:
            return None
        return cls(Path(directory) / "executables")

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
