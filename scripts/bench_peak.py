"""This machine's achievable matmul FLOP/s and memory bandwidth: the "peak" every throughput figure is a
fraction of.

    python scripts/bench_peak.py                     # -> scripts/results/bench_peak.json
    python scripts/bench_peak.py --quick --out /tmp/peak.json

GEMMs: a square 2048³ reference, then the matmuls of the two benchmark models (58M Qwen3: hidden 512,
8 heads / 4 KV heads, head_dim 64, MLP 1536, vocab 32000; 3.2M: hidden 256, 4 / 2 heads, MLP 768) at
the train step's token counts (32 × 82 = 2624 and 8 × 1024 = 8192 rows) and at decode batch sizes
(1, 16, 32, 64): q/k/v/o projections, MLP gate/up/down, the LM head. Each is a jitted `jnp.dot` on one
device (`jax.devices()[0]`), compiled and run once before timing, then repeated until at least
`--min-seconds` per repeat; the best of `--repeats` repeats is kept (the achievable rate, not the
average of a busy machine). FLOPs = 2·m·k·n.

dtypes: float32 for every shape; on the square shape (every shape with `--bf16-all`) also bfloat16, two ways — `native` (bf16 × bf16 → bf16, whatever the backend does with
it) and `upcast` (bf16 operands converted to float32 for the dot, as `kernels.attention.cpu_upcast`
does on XLA:CPU, whose DotThunk has no bf16 × bf16 → f32). A variant the backend refuses is recorded
with its error, not fatal.

Bandwidth: a jitted `x + 1` over a 256 MiB float32 array, counting one read and one write per element.

Other benchmarks read the result with `load_peak()` and report `achieved / peak_gflops[dtype]`. Run it
on an idle machine: a loaded machine gives a lower peak, so every fraction against it reads too high.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_peak.json"
MODELS = {"58m": dict(hidden=512, heads=8, kv_heads=4, head_dim=64, mlp=1536, vocab=32000),
          "3.2m": dict(hidden=256, heads=4, kv_heads=2, head_dim=64, mlp=768, vocab=32000)}
TRAIN_ROWS = (2624, 8192)
DECODE_ROWS = (1, 16, 32, 64)


def model_gemms(name: str, m: int) -> list[tuple[str, int, int, int]]:
    """(label, m, k, n) of one layer's projections and the LM head at `m` token rows."""
    d = MODELS[name]
    h, q, kv = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    return [(f"{name} q_proj", m, h, q), (f"{name} kv_proj", m, h, kv), (f"{name} o_proj", m, q, h),
            (f"{name} mlp_up", m, h, d["mlp"]), (f"{name} mlp_down", m, d["mlp"], h),
            (f"{name} lm_head", m, h, d["vocab"])]


def shapes(quick: bool) -> list[tuple[str, int, int, int]]:
    if quick:
        return [("square", 256, 256, 256), *model_gemms("3.2m", 16)[:2]]
    out = [("square", 2048, 2048, 2048)]
    for name in MODELS:
        for m in TRAIN_ROWS + DECODE_ROWS:
            out += model_gemms(name, m)
    return out


def _time(fn, args, min_seconds: float, repeats: int) -> float:
    """Best seconds per call over `repeats` repeats of >= min_seconds each (compile and first run excluded)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            out = fn(*args)
            n += 1
            if time.perf_counter() - t0 >= min_seconds:
                jax.block_until_ready(out)
                break
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def _dot(variant: str):
    if variant == "upcast":
        return jax.jit(lambda a, b: jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32)))
    return jax.jit(lambda a, b: jnp.dot(a, b))


def gemm(label: str, m: int, k: int, n: int, dtype: str, variant: str, min_seconds: float, repeats: int) -> dict:
    dev = jax.devices()[0]
    rng = np.random.default_rng(0)
    a = jax.device_put(jnp.asarray(rng.standard_normal((m, k)), dtype), dev)
    b = jax.device_put(jnp.asarray(rng.standard_normal((k, n)), dtype), dev)
    row = {"name": label, "m": m, "k": k, "n": n, "dtype": dtype, "variant": variant}
    try:
        s = _time(_dot(variant), (a, b), min_seconds, repeats)
    except Exception as e:      # e.g. a backend without this dot
        return {**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return {**row, "seconds": s, "gflops": 2 * m * k * n / s / 1e9}


def bandwidth(mib: int, min_seconds: float, repeats: int) -> float:
    x = jax.device_put(jnp.zeros(mib * (1 << 20) // 4, jnp.float32), jax.devices()[0])
    s = _time(jax.jit(lambda v: v + 1.0), (x,), min_seconds, repeats)
    return 2 * x.nbytes / s / 1e9


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device": str(jax.devices()[0])}


def load_peak(path: str | os.PathLike = DEFAULT_OUT) -> dict | None:
    """`{"peak_gflops": {dtype: GFLOP/s}, "bandwidth_gbs": GB/s, ...}` from a previous run, or None."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true", help="small shapes, short timing (a smoke test)")
    ap.add_argument("--min-seconds", type=float, default=None, help="seconds per timed repeat (default 0.5)")
    ap.add_argument("--bf16-all", action="store_true", help="bf16 for every shape, not only the square one")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per shape, best kept (default 3)")
    args = ap.parse_args(argv)
    min_s = args.min_seconds if args.min_seconds is not None else (0.02 if args.quick else 0.5)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    rows = []
    for label, m, k, n in shapes(args.quick):
        variants = [("float32", "native")]
        if label == "square" or args.bf16_all:      # bf16 on the reference shape (XLA:CPU's bf16 is slow)
            variants += [("bfloat16", "native"), ("bfloat16", "upcast")]
        for dtype, variant in variants:
            row = gemm(label, m, k, n, dtype, variant, min_s, repeats)
            rows.append(row)
            print(f"{label:>16} {m:>5}x{k:>5}x{n:>5} {dtype:>8} {variant:>6}: "
                  + (f"{row['gflops']:8.1f} GFLOP/s" if "gflops" in row else row["error"]), file=sys.stderr)
    peak = {}
    for dtype in ("float32", "bfloat16"):
        rates = [r["gflops"] for r in rows if r["dtype"] == dtype and "gflops" in r]
        peak[dtype] = max(rates) if rates else None
    result = {"machine": machine(), "gemm": rows, "peak_gflops": peak,
              "bandwidth_gbs": bandwidth(16 if args.quick else 256, min_s, repeats),
              "min_seconds": min_s, "repeats": repeats,
              "note": "best of repeats on one device; run on an idle machine (a loaded one lowers the peak)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"peak GFLOP/s {peak}, bandwidth {result['bandwidth_gbs']:.1f} GB/s -> {args.out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
