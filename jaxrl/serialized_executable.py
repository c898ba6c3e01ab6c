"""Compiled executables to bytes and back, for `jaxrl.executable_store`: JAX's executable pickler with two changes.

A program JAX's persistent cache loaded is written with the bytes that cache holds (XLA:CPU cannot serialise a
deserialised executable again: the copy fails at run time, "Function ... not found"), so the loads JAX's cache
makes are noted here (`FROM_JAX_CACHE`). A load maps the saved device ids onto the devices of the mesh it is for,
position by position, and rebuilds XLA's device assignment for them (`_Unpickler`).
"""

from __future__ import annotations

import io

import jax
import numpy as np
from jax._src import compilation_cache, compiler
from jax._src.lib import xla_client as xc
from jax.experimental import serialize_executable


def assigned_devices(compiled) -> list:
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


def serialize(compiled):
    """(payload bytes, input tree, output tree) of `compiled`: `jax.experimental.serialize_executable.serialize`,
    through `_Pickler`, with the bytes JAX's persistent cache loaded it from where it did (`jax_cache_bytes`)."""
    cached = jax_cache_bytes(compiled.runtime_executable())
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if unloaded is None or compiled._params.const_args:
        raise ValueError("not serialisable")
    args_info_flat, in_tree = jax.tree.flatten(compiled.args_info)
    with io.BytesIO() as f:
        _Pickler(f, cached).dump((unloaded, args_info_flat, compiled._no_kwargs))
        return f.getvalue(), in_tree, compiled.out_tree


FROM_JAX_CACHE: dict[int, tuple[bytes, str]] = {}     # id(LoadedExecutable) -> (its fingerprint, JAX's key)


def _note_jax_cache_loads() -> None:
    """Remember which XLA executables JAX's persistent cache deserialised, and under which key: JAX's in-memory
    caches hand the same object to every later `lower().compile()` of the same program."""
    get = compilation_cache.get_executable_and_time
    if getattr(get, "_jaxrl_noted", False):
        return

    def noted(cache_key, compile_options, backend, executable_devices):
        executable, seconds = get(cache_key, compile_options, backend, executable_devices)
        if executable is not None:
            FROM_JAX_CACHE[id(executable)] = (executable.fingerprint, cache_key)
        return executable, seconds

    noted._jaxrl_noted = True
    compilation_cache.get_executable_and_time = noted


_note_jax_cache_loads()


def jax_cache_bytes(executable) -> bytes | None:
    """The bytes JAX's persistent cache deserialised `executable` from (None: compiled in this process).

    The table is keyed by id() (an XLA executable takes no weak reference), so an entry can be stale: a freed
    executable's id reused by another one. Every load from JAX's cache writes its id's entry anew, so an entry
    whose fingerprint differs from the executable's is stale and the executable was compiled here: it is
    serialised itself. An empty fingerprint (XLA:CPU gives a program without inputs none) tells nothing:
    such a program under a noted id is not stored (compiled again next time)."""
    fingerprint, key = FROM_JAX_CACHE.get(id(executable), (None, None))
    if key is None:
        return None
    if not executable.fingerprint:                   # (whatever the entry says: another program's bytes, or its own)
        raise ValueError("cannot tell it from a program JAX's cache loaded")
    if fingerprint != executable.fingerprint:
        FROM_JAX_CACHE.pop(id(executable), None)                       # stale: compiled in this process
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


def deserialize(record: dict, devices: tuple):
    """The executable `record` (a store file's: payload, saved device ids, trees) holds, on `devices`."""
    unloaded, args_info_flat, no_kwargs = _Unpickler(io.BytesIO(record["payload"]), list(devices),
                                                     record["ids"]).load()
    args_info = jax.tree.structure(record["in"]).unflatten(args_info_flat)
    return jax.stages.Compiled(unloaded.load(), [], args_info, jax.tree.structure(record["out"]),
                               no_kwargs=no_kwargs)
