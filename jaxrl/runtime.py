"""Process-wide runtime settings shared by the entry points and the rollout service.

`enable_compilation_cache()` turns on JAX's persistent compilation cache (on by default): compiled
executables (rollout decode buckets, prefill chunks, train steps) are written to disk and reused by
the next process with the same program, so restarts, resumes and CI re-runs skip most compilation.
Within one process, jit's own cache keys every step by (shapes, shardings) = (layout, bucket, chunk).

    JAXRL_COMPILATION_CACHE=0          disable
    JAXRL_COMPILATION_CACHE_DIR=PATH   location (default ~/.cache/jaxrl/xla)
"""

from __future__ import annotations

import os
from pathlib import Path

import jax


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Enable the persistent cache unless disabled or already configured; returns the directory in use."""
    if os.environ.get("JAXRL_COMPILATION_CACHE", "1").lower() in ("0", "false", "off", "no"):
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = Path(path or os.environ.get("JAXRL_COMPILATION_CACHE_DIR") or Path.home() / ".cache" / "jaxrl" / "xla")
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return str(path)


def request_cpu_devices(n: int) -> None:
    """Ask for `n` fake CPU devices (multi-device layouts on a laptop; no effect on GPU/TPU backends).

    JAX only accepts this before its backend starts. When called later (e.g. a second `main()` in the
    same process), the devices already present are used if there are enough; otherwise a clear error.
    """
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        if jax.device_count() < n:
            raise SystemExit(f"need {n} devices but JAX already started with {jax.device_count()}; "
                             "start a fresh process") from None
