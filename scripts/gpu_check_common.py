"""Pieces every section of `scripts/gpu_check.py` shares: the section record (budget, sub-cases that catch their
own failures), error measures at the CPU tests' tolerances, timing, and the environment section.

Not imported by the packages (ARCHITECTURE.md: scripts are leaves). Imports `jax` only inside functions, so the
entry point can choose the platform before JAX reads `JAX_PLATFORMS`.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT / "scripts"), str(ROOT)):      # the bench scripts and `tests.*` (their tolerances)
    if _p not in sys.path:
        sys.path.insert(0, _p)


class Section:
    """One section's record: its budget, its sub-cases (each catches its own exception and is skipped once the
    budget is spent), free-form `info`, and `flush` (the entry point writes it after every sub-case, so a run
    killed mid-section still leaves what it measured)."""

    def __init__(self, name: str, budget_s: float, *, smoke: bool, shared: dict, parts: Path, flush=None):
        self.name, self.budget_s, self.smoke, self.shared, self.parts = name, float(budget_s), smoke, shared, parts
        self.t0 = time.perf_counter()
        self.cases: dict[str, dict] = {}
        self.info: dict = {}
        self.error: str | None = None
        self._flush = flush

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def case(self, name: str, fn, *args, **kw):
        """Run `fn(*args, **kw)` (a dict of results) as sub-case `name`; None when it failed or was skipped."""
        if self.left() <= 0:
            self.cases[name] = {"status": "skipped", "reason": f"section budget of {self.budget_s:.0f} s spent"}
            self.flush()
            return None
        t0 = time.perf_counter()
        try:
            out = fn(*args, **kw)
            self.cases[name] = {"status": "ok", "seconds": round(time.perf_counter() - t0, 3), **(out or {})}
        except Exception:                        # recorded with its traceback; the next sub-case still runs
            out = None
            self.cases[name] = {"status": "failed", "seconds": round(time.perf_counter() - t0, 3),
                                "error": traceback.format_exc()[-4000:]}
            print(f"[gpu_check] {self.name}/{name} failed:\n{self.cases[name]['error']}", file=sys.stderr, flush=True)
        self.flush()
        return out

    def skip(self, name: str, reason: str) -> None:
        self.cases[name] = {"status": "skipped", "reason": reason}

    def status(self) -> str:
        states = {c["status"] for c in self.cases.values()}
        if self.error or "failed" in states:
            return "failed"
        budget = any(c["status"] == "skipped" and "budget" in c.get("reason", "") for c in self.cases.values())
        return "partial" if budget else "ok"

    def record(self, status: str | None = None) -> dict:
        return {"status": status or self.status(), "budget_s": self.budget_s,
                "seconds": round(time.perf_counter() - self.t0, 3), "error": self.error, "info": self.info,
                "cases": self.cases}

    def flush(self, status: str | None = None) -> None:
        path = self.parts / f"{self.name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record(status or "running"), indent=1, default=_json_default))
        os.replace(tmp, path)            # atomic: the parent process reads these while this one runs
        if self._flush is not None:
            self._flush()

    def env(self) -> dict:
        """The environment section's info (measured peak, copy bandwidth), from this process or its part file."""
        if "env" in self.shared:
            return self.shared["env"]
        path = self.parts / "env.json"
        return json.loads(path.read_text()).get("info", {}) if path.is_file() else {}


def _json_default(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


# ------------------------------------------------------------------------------------------------ errors

def max_abs(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def allclose(a, b, *, atol: float, rtol: float = 0.0) -> tuple[float, bool]:
    """(max |a - b|, whether every entry meets |a - b| <= atol + rtol |b|: numpy's assert_allclose rule)."""
    import numpy as np

    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    d = np.abs(a - b)
    return (float(d.max()) if d.size else 0.0), bool(np.all(d <= atol + rtol * np.abs(b)))


def judged(err: float, tol: float | None, ok: bool | None = None) -> dict:
    """A measured error and its verdict at `tol` (None: no CPU test sets one; recorded, not judged)."""
    if tol is None:
        return {"max_err": err, "tolerance": None, "passed": None}
    return {"max_err": err, "tolerance": tol, "passed": bool(err <= tol) if ok is None else bool(ok)}


# ------------------------------------------------------------------------------------------------ timing

def median_time(fn, repeats: int, sync) -> float:
    """Median seconds of `repeats` calls of `fn`, each followed by `sync(result)` (after one untimed call)."""
    sync(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gib(x) -> float | None:
    return None if x is None else x / 2**30


# --------------------------------------------------------------------------------------- section: env

def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    import jax

    out = {"python": platform.python_version(), "jax": jax.__version__}
    for name in ("jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                 "flax", "optax", "numpy", "torch", "transformers", "triton"):
        out[name] = _version(name)
    return out


def device_info() -> dict:
    import jax

    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    info = {"backend": jax.default_backend(), "platform": dev.platform, "device_kind": dev.device_kind,
            "device_count": jax.device_count(), "memory_bytes": (stats or {}).get("bytes_limit"),
            "compute_capability": getattr(dev, "compute_capability", None),
            "host": platform.node(), "cpu_cores": os.cpu_count()}
    try:
        import torch
        info["torch_cuda"] = bool(torch.cuda.is_available())
    except ImportError:
        info["torch_cuda"] = False
    return info


def apis() -> dict:
    """Whether the JAX APIs the kernels and checks use are importable here (JAX 0.11 deprecates Pallas' Triton
    backend; a missing name shows here before it fails a kernel case)."""
    import jax
    from jax.experimental import pallas as pl

    out = {"jax.export": hasattr(jax, "export"),
           "jax.default_matmul_precision": hasattr(jax, "default_matmul_precision"),
           "pl.BlockSpec": hasattr(pl, "BlockSpec"), "pl.ds": hasattr(pl, "ds"), "pl.cdiv": hasattr(pl, "cdiv"),
           "pl.next_power_of_2": hasattr(pl, "next_power_of_2")}
    try:
        from jax.experimental.pallas import triton as plgpu
        out.update({"pallas.triton.CompilerParams": hasattr(plgpu, "CompilerParams"),
                    "pallas.triton.dot": hasattr(plgpu, "dot")})
    except ImportError as e:
        out["pallas.triton"] = f"not importable: {e}"
    return out


def run_env(s: Section) -> None:
    """Versions and device; the bf16 (and f32) matmul peak and the device's copy bandwidth, measured with
    `scripts/bench_peak.py`'s own timing (`gemm`, `bandwidth`): the denominators of every fraction below."""
    import bench_peak

    s.info["versions"] = versions()
    s.info["device"] = device_info()
    s.info["apis"] = apis()
    size, mib = (256, 16) if s.smoke else (8192, 512)
    min_s, repeats = (0.02, 1) if s.smoke else (0.2, 3)
    g = dict(name=f"square {size}", model=None, op="square", phase="reference", m=size, k=size, n=size)
    variants = [("bfloat16", "native"), ("bfloat16", "native_f32acc"), ("float32", "native")]
    if s.info["device"]["backend"] == "cpu":
        variants.append(("bfloat16", "upcast"))     # the project's CPU path; the same as native_f32acc elsewhere
    rows = []

    def matmuls():
        for dtype, variant in variants:
            rows.append(bench_peak.gemm(g, dtype, variant, min_s, repeats))
        best = {dt: max((r["gflops"] for r in rows if r["dtype"] == dt and "gflops" in r), default=None)
                for dt in ("bfloat16", "float32")}
        if best["bfloat16"] is None:
            raise RuntimeError(f"no bf16 matmul ran: {[r.get('error') for r in rows]}")
        s.info["peak_gflops"] = best
        return {"shape": [size] * 3, "rows": rows, "peak_gflops": best}

    def copy():
        bw = bench_peak.bandwidth(mib, min_s, repeats)
        s.info.update(copy_gbs=bw["inplace"], read_gbs=bw["read"], bandwidth_mib=mib)
        return {"copy_gbs": bw["inplace"], "read_gbs": bw["read"], "fresh_output_gbs": bw["fresh"], "mib": mib,
                "method": "bench_peak.bandwidth: jitted x + 1 in place (read + write counted), sum(x) (read)"}

    s.case("matmul_peak", matmuls)
    s.case("copy_bandwidth", copy)
    s.shared["env"] = s.info


def peak_json(s: Section, path: Path) -> Path:
    """The measured peak in `bench_peak.json`'s layout (what bench_tail_batching's roofline reads)."""
    e = s.env()
    pk = e.get("peak_gflops") or {}
    path.write_text(json.dumps({"peak_gflops": {"float32": pk.get("float32") or pk.get("bfloat16"),
                                                "bfloat16": pk.get("bfloat16")},
                                "bandwidth_read_gbs": e.get("read_gbs") or e.get("copy_gbs"),
                                "bandwidth_gbs": e.get("copy_gbs"), "source": "scripts/gpu_check.py env section"}))
    return path


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
