"""Process-wide runtime settings shared by the entry points and the rollout service.

`enable_compilation_cache()` turns on JAX's persistent compilation cache (on by default): compiled
executables (rollout decode buckets, prefill chunks, train steps) are written to disk and reused by
the next process with the same program, so restarts, resumes and CI re-runs skip most compilation.
Within one process, jit's own cache keys every step by (shapes, shardings) = (layout, bucket, chunk).

On the CPU the persistent cache also serves one program to every device group and process it runs on:
JAX keys an XLA:CPU executable by its device assignment and the devices' topology (on GPU it strips the
assignment and passes the real one when it loads the executable), so 8 rollout instances at TP1 compiled
each decode bucket 8 times, once per device, a process its instances' programs though another process had
compiled them, and a 2-process run its train step though the 1-process run had.
`enable_compilation_cache()` makes the CPU key device- and process-free; the executable loaded from the
cache runs on the devices of the call (`_share_across_devices`).

Processes that share a cache directory compile each program once (`_compile_once`): the first to miss the
cache takes a lock file for the program's key and compiles it; the others wait for the lock to go and load
what it wrote. The processes of a multi-process run on one host (`scripts/launch_local.sh`; one process per
GPU on an 8-GPU box) miss on the same programs at the same moment, and each compiled all of them: a 2-process
PPO run of the tiny model on 2 cores, empty cache: 82 -> 70 CPU-s (tests/test_compile_lock.py checks that one
process compiles and the other loads).

A process whose only backend is the CPU compiles with XLA's LLVM backend at level 1 instead of 3
(`cpu_compile_level`, called by `request_cpu_devices`): the same HLO compiled in less time.

    JAXRL_COMPILATION_CACHE=0          disable
    JAXRL_COMPILATION_CACHE_DIR=PATH   location (default ~/.cache/jaxrl/xla)
    JAXRL_COMPILE_LOCK=0               every process compiles its misses itself
    JAXRL_COMPILE_LOG=DIR              log every trace, lowering and compilation (`jaxrl.compile_log`)
    JAXRL_EXECUTABLE_STORE=0           no store of executables beside the cache (`jaxrl.executable_store`)
    JAXRL_EXECUTABLE_STORE_MAX_GB=N    that store's bound, least recently used entries removed past it (default 2)
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import pkgutil
import socket
import threading
import time
from pathlib import Path

import jax
import jax.monitoring
from jax._src import cache_key, compilation_cache, compiler, distributed, monitoring, xla_bridge

from jaxrl import compile_log


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Enable the persistent cache unless disabled or already configured; returns the directory in use. Also
    starts `jaxrl.compile_log` when JAXRL_COMPILE_LOG names a directory."""
    compile_log.start()
    if os.environ.get("JAXRL_COMPILATION_CACHE", "1").lower() in ("0", "false", "off", "no"):
        return None
    _share_across_devices()
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = Path(path or os.environ.get("JAXRL_COMPILATION_CACHE_DIR") or Path.home() / ".cache" / "jaxrl" / "xla")
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.02)
    if os.environ.get("JAXRL_COMPILE_LOCK", "1").lower() not in ("0", "false", "off", "no"):
        _compile_once()
    return str(path)


LOCK_POLL_S = 0.02
LOCK_WAIT_S = 1800.0        # a holder that takes longer than this (or died on another host): compile anyway


def _compile_once() -> None:
    """Wrap JAX's compile-and-write-cache step (called on a persistent-cache miss) with a lock file per
    cache key in the cache directory (`locks/KEY`, `build_once`): the process that creates it compiles and
    writes the cache entry; the others wait for it and load the entry, compiling only if there is none (a
    program faster to compile than the cache's minimum is not written)."""
    if getattr(compiler._compile_and_write_cache, "_jaxrl_once", False):
        return
    compile_and_write = compiler._compile_and_write_cache

    def once(backend, computation, executable_devices, compile_options, host_callbacks, module_name, cache_key):
        args = (backend, computation, executable_devices, compile_options, host_callbacks, module_name, cache_key)
        directory = jax.config.jax_compilation_cache_dir
        if not directory or "://" in directory:          # (a remote cache: no lock files)
            return compile_and_write(*args)

        def read():
            executable, _ = compiler._cache_read(module_name, cache_key, compile_options, backend,
                                                 executable_devices)
            if executable is not None:
                monitoring.record_event("/jax/compilation_cache/cache_hits")
            return executable

        return build_once(Path(directory) / "locks" / cache_key, read,
                          lambda: _compile_and_write_any_process(compile_and_write, *args))

    once._jaxrl_once = True
    compiler._compile_and_write_cache = once


def _compile_and_write_any_process(compile_and_write, backend, computation, executable_devices, compile_options,
                                   host_callbacks, module_name, cache_key):
    """JAX's compile-and-write, the entry written by any process: JAX writes only process 0's (against
    write contention on remote filesystems; the lock above is for local ones), which left the others, when
    they won the lock, compiling for nothing."""
    start = time.monotonic()
    executable = compile_and_write(backend, computation, executable_devices, compile_options, host_callbacks,
                                   module_name, cache_key)
    seconds = time.monotonic() - start
    if (distributed.global_state.process_id != 0 and not host_callbacks
            and seconds >= jax.config.jax_persistent_cache_min_compile_time_secs):
        compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend, int(seconds))
    return executable


def build_once(lock: Path, read, build):
    """`build()` in the process that creates the lock file `lock` (holding "host pid"; removed after), `read()`
    in one that finds it, once it is gone (or its holder, on this host, is dead); a reader that reads nothing
    (None: the holder wrote nothing) takes the lock and builds. A waiter holds no lock and a holder waits for
    nothing while it builds, so processes cannot deadlock on each other's locks. Shared by JAX's persistent
    cache (`_compile_once`) and `jaxrl.executable_store`'s."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + LOCK_WAIT_S
    while time.monotonic() < deadline:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            _wait_for(lock, deadline)
            found = read()
            if found is not None:
                return found
            continue                                 # nothing written: take the lock and build here
        try:
            os.write(fd, f"{socket.gethostname()} {os.getpid()}".encode())
            os.close(fd)
            return build()
        finally:
            lock.unlink(missing_ok=True)
    return build()


def _wait_for(lock: Path, deadline: float) -> None:
    """Until `lock` is gone, its holder (on this host) is dead (the lock is then removed) or `deadline`."""
    while time.monotonic() < deadline:
        try:
            host, _, pid = lock.read_text().partition(" ")
        except FileNotFoundError:
            return
        if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
            lock.unlink(missing_ok=True)
            return
        time.sleep(LOCK_POLL_S)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _share_across_devices() -> None:
    """Key CPU executables in the persistent cache without their device assignment (JAX does so for GPU)
    and without the devices' topology, which on the CPU names the process and the process count (see the
    module docstring; tests/test_compilation_cache.py checks the loaded executables bit for bit). The
    options hash has no devices to look at, so it asks the default backend; the devices hash asks the
    program's own devices."""
    if getattr(cache_key._hash_serialized_compile_options, "_jaxrl_device_free", False):
        return
    hash_options, hash_devices = cache_key._hash_serialized_compile_options, cache_key._hash_accelerator_config

    def options(hash_obj, compile_options, strip_device_assignment=False):
        strip = strip_device_assignment or jax.default_backend() == "cpu"
        return hash_options(hash_obj, compile_options, strip_device_assignment=strip)

    def devices(hash_obj, accelerators):
        if next(iter(accelerators.flat)).platform == "cpu":
            hash_obj.update(f"cpu devices {accelerators.shape}".encode())    # the mesh's shape stays
        else:
            hash_devices(hash_obj, accelerators)

    options._jaxrl_device_free = True
    cache_key._hash_serialized_compile_options, cache_key._hash_accelerator_config = options, devices


def request_cpu_devices(n: int) -> None:
    """Ask for `n` fake CPU devices (multi-device layouts on a laptop; no effect on GPU/TPU backends), and
    XLA:CPU's quicker LLVM level (`cpu_compile_level`).

    JAX only accepts this before its backend starts. When called later (e.g. a second `main()` in the
    same process), the devices already present are used if there are enough; otherwise a clear error.
    """
    cpu_compile_level()
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        if jax.device_count() < n:
            raise SystemExit(f"need {n} devices but JAX already started with {jax.device_count()}; "
                             "start a fresh process") from None


CPU_OPT_LEVEL = 1      # XLA's default is 3
_LEVEL_FLAG = "--xla_backend_optimization_level"


def cpu_compile_level(environ=os.environ) -> bool:
    """Compile XLA:CPU programs at LLVM optimisation level `CPU_OPT_LEVEL` instead of XLA's 3, when the
    backend will be the CPU, has not started yet and XLA_FLAGS does not set the level; True if it set it.

    A cold start is mostly compilation (docs/benchmarks.md, "Cold start"), and level 1 compiles the same
    HLO in less time: the quickstart's init program 3.37 -> 1.25 s with the same weights; its first RL step on
    a cold cache 1.2x sooner (scripts/bench_cold_start.py). Measured interleaved on a 2-core Xeon, the 58M train
    step and decode differed by no more than run-to-run noise. A reduction may round apart from level 3's.
    Level 0 is not used: it compiles the init program into other weights. The flag also sets the LLVM level
    of GPU kernels, so it is left alone unless the CPU is the only platform JAX can start: `jax_platforms`
    (JAX_PLATFORMS) names only the CPU, or no GPU/TPU plugin is installed. XLA's default level back:
    `XLA_FLAGS=--xla_backend_optimization_level=3`. `jax_disable_most_optimizations` (level 0) still wins."""
    flags = environ.get("XLA_FLAGS", "")
    if _LEVEL_FLAG in flags or xla_bridge.backends_are_initialized() or not _cpu_only():
        return False
    environ["XLA_FLAGS"] = f"{flags} {_LEVEL_FLAG}={CPU_OPT_LEVEL}".strip()
    return True


def _cpu_only() -> bool:
    """Whether the CPU is the only backend JAX can start in this process (see `cpu_compile_level`)."""
    platforms = jax.config.jax_platforms
    if platforms:
        return {p.strip() for p in platforms.split(",")} <= {"cpu"}
    if importlib.metadata.entry_points(group="jax_plugins") or importlib.util.find_spec("libtpu"):
        return False
    plugins = importlib.util.find_spec("jax_plugins")      # the namespace package GPU plugins install into
    return plugins is None or not any(pkgutil.iter_modules(plugins.submodule_search_locations or []))


class CompileCounter:
    """XLA compilations in this process, from JAX's own monitoring events.

    Every executable JAX builds (jit's cache misses, AOT `lower().compile()`, a persistent-cache load
    included) records one `/jax/core/compile/backend_compile_duration` event; loads served from the
    persistent compilation cache also record `/jax/compilation_cache/cache_hits`. `take()` returns what
    happened since the previous `take()`: `{"compiles": n, "compile_s": seconds, "compile_cache_hits": k}`.
    A run whose shapes are bounded compiles nothing after its first steps; a non-zero `compiles` later
    on is a new shape (a bug to fix, not noise). One listener per process, installed on first use.
    Compilations on a thread inside `background()` (a cold start's exact buckets, `jaxrl.train.background`)
    are counted apart, as `compiles_background` / `compile_background_s`: they block no step.
    """

    _EVENT = "/jax/core/compile/backend_compile_duration"
    _HIT = "/jax/compilation_cache/cache_hits"
    _installed = False
    _count = _hits = _bg_count = 0
    _seconds = _bg_seconds = 0.0
    _names: list[str] = []
    _thread = threading.local()

    @classmethod
    @contextlib.contextmanager
    def background(cls):
        """Count this thread's compilations as background ones while inside."""
        cls._thread.background = True
        try:
            yield
        finally:
            cls._thread.background = False

    def __init__(self):
        cls = type(self)
        if not cls._installed:
            jax.monitoring.register_event_duration_secs_listener(cls._on_duration)
            jax.monitoring.register_event_listener(cls._on_event)
            cls._installed = True
        self._last = (cls._count, cls._seconds, cls._hits, cls._bg_count, cls._bg_seconds)

    @classmethod
    def _on_duration(cls, event: str, duration: float, fun_name: str = "?", **_) -> None:
        if event == cls._EVENT and getattr(cls._thread, "background", False):
            cls._bg_count += 1
            cls._bg_seconds += duration
        elif event == cls._EVENT:
            cls._count += 1
            cls._seconds += duration
            cls._names.append(fun_name)

    @classmethod
    def _on_event(cls, event: str, **_) -> None:
        if event == cls._HIT:
            cls._hits += 1

    def names(self) -> list[str]:
        """Names of the functions compiled since the last `take()` (for a log line about a late compile)."""
        cls = type(self)
        return cls._names[len(cls._names) - (cls._count - self._last[0]):] if cls._count > self._last[0] else []

    def take(self) -> dict:
        cls = type(self)
        now = (cls._count, cls._seconds, cls._hits, cls._bg_count, cls._bg_seconds)
        delta = {"compiles": now[0] - self._last[0], "compile_s": now[1] - self._last[1],
                 "compile_cache_hits": now[2] - self._last[2]}
        if now[3] > self._last[3]:
            delta.update(compiles_background=now[3] - self._last[3], compile_background_s=now[4] - self._last[4])
        self._last = now
        return delta
