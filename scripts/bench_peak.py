"""This machine's achievable matmul FLOP/s and memory bandwidth: the "peak" every throughput figure is a
fraction of.

    python scripts/bench_peak.py                     # -> scripts/results/bench_peak.json (about 3 minutes)
    python scripts/bench_peak.py --quick --out /tmp/peak.json
    python scripts/bench_peak.py --bf16-all          # bfloat16 on every shape too (slower)

GEMMs ([m, k] x [k, n], FLOPs = 2·m·k·n): a square 2048³ reference, then the matmuls of the two
benchmark models at the train step's token counts (32 × 82 = 2624 and 8 × 1024 = 8192 rows) and at
decode batch sizes (1, 16, 32, 64 rows):

    58m   Qwen3, hidden 512, 8 layers, 8 heads / 4 KV heads, head_dim 64, MLP 1536, vocab 32000
          (the model of bench_rollout.py / bench_train_memory.py; 58M parameters with untied embeddings)
    3.2m  hidden 256, 4 layers, 4 / 2 heads, head_dim 64, MLP 768, vocab 32000 (3.2M parameters
          outside the embeddings; no preset in models/config.py has this shape)

Per model: q_proj [h -> heads·d], k_proj/v_proj [h -> kv·d] (one shape, `per_layer` 2), o_proj,
gate_proj/up_proj [h -> mlp] (one shape, `per_layer` 2), down_proj [mlp -> h], lm_head [h -> vocab].

Method: each GEMM is a jitted `jnp.dot` on one device (`jax.devices()[0]`; the tests' 8 fake CPU
devices share one thread pool), compiled and run once before timing (compile excluded). A timed repeat
calls it back to back, one call in flight (call i+1 is dispatched before call i is waited for, so
the host's dispatch overlaps the previous dot but outputs do not pile up), until at least
`--min-seconds`; seconds = elapsed / calls, and the best of `--repeats` repeats is kept: the
achievable rate, not the average of a busy machine. The square shape is run once untimed first (the
first large dots of a process measured about half speed). A separate dot costs a whole executable launch
(`call_overhead_us`, a trivial jitted op, is measured too), so the decode rows at 1-16 rows measure the
launch more than the kernel; a dot inside one compiled step does not pay that launch. The peak is the best
shape, which is a large one.

dtypes: float32 for every shape. bfloat16 on the square shape and the 58m gate_proj/up_proj and lm_head
at 2624 rows (every shape with `--bf16-all`), three ways: `native` (bf16 x bf16 -> bf16, plain `jnp.dot`),
`native_f32acc` (bf16 x bf16 -> f32 via `preferred_element_type`) and `upcast` (the project's CPU path:
`kernels.attention.cpu_upcast` converts the operands to float32 on XLA:CPU, then the f32-accumulating
dot; on other backends it is the same as `native_f32acc`). Each row's `kernel` says what the compiled
HLO does (e.g. `ynn_fusion` = XLA:CPU's YNNPACK dot, `+convert` = operands converted first). A
variant the backend refuses is recorded with its error, not fatal. Without native bf16 FMA units (the
cpu `flags` lack avx512_bf16 / amx_bf16) bf16 arithmetic is converted to f32 in the kernel, so its peak
is near the f32 peak or below it.

Bandwidth, over a 256 MiB float32 array, best of repeats of >= `--min-seconds`:
`bandwidth_gbs` is a jitted `x + 1` with `x` donated (in place, each call on the previous output),
counting one read and one write per element: the streaming copy bandwidth. `bandwidth_read_gbs` is a
jitted `jnp.sum(x)`, reads only: the figure a weight-streaming decode step is bound by.
`bandwidth_fresh_output_gbs` is `x + 1` into a new output buffer each call: on XLA:CPU a large buffer
is freshly mapped memory, so this includes the page faults of first touch, and it can be several
times lower than the in-place figure. It is the cost every large out-of-place result pays (the
`lm_head` at 8192 rows writes a 1 GB logits array per call).

Reading it: `peak_gflops[dtype]` is the best rate over all shapes (and variants) of that dtype; other
benchmarks load it with `load_peak()` and report `achieved / peak_gflops[dtype]`. `loadavg_before` /
`loadavg_after` are the 1/5/15-minute load averages: a loaded machine gives a lower peak, so every
fraction against it reads too high; re-run on an idle machine for figures to keep.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_harness import write_result  # noqa: E402
from kernels.attention import cpu_upcast  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_peak.json"
MODELS = {"58m": dict(hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, mlp=1536, vocab=32000),
          "3.2m": dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, mlp=768, vocab=32000)}
TRAIN_ROWS = (2624, 8192)
DECODE_ROWS = (1, 16, 32, 64)
BF16_VARIANTS = ("native", "native_f32acc", "upcast")
BF16_OPS = ("gate_proj/up_proj", "lm_head")      # bf16 by default at the 58m train shape (time budget)

OUTPUTS = ("bench_peak.json",)  # its files in scripts/results/ (tests/test_docs.py)


def load_peak(path: str | os.PathLike = DEFAULT_OUT) -> dict | None:
    """The JSON of a previous run (`peak_gflops[dtype]`, `bandwidth_gbs`, ...), or None if there is none."""
    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else None


def model_gemms(model: str, m: int) -> list[dict]:
    """One layer's projections and the LM head of `model` at `m` token rows."""
    d = MODELS[model]
    h, q, kv = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    phase = "train" if m in TRAIN_ROWS else "decode"
    ops = [("q_proj", h, q, 1), ("k_proj/v_proj", h, kv, 2), ("o_proj", q, h, 1),
           ("gate_proj/up_proj", h, d["mlp"], 2), ("down_proj", d["mlp"], h, 1), ("lm_head", h, d["vocab"], 0)]
    return [dict(name=f"{model} {op} {phase} m={m}", model=model, op=op, phase=phase, m=m, k=k, n=n, per_layer=per)
            for op, k, n, per in ops]


def shapes(quick: bool) -> list[dict]:
    """GEMMs to time; `bf16` marks the ones also timed in bfloat16 by default."""
    if quick:
        return [dict(name="square 256", model=None, op="square", phase="reference", m=256, k=256, n=256, bf16=True),
                *model_gemms("3.2m", 16)[:2]]
    out = [dict(name="square 2048", model=None, op="square", phase="reference", m=2048, k=2048, n=2048, bf16=True)]
    for model in MODELS:
        for m in TRAIN_ROWS + DECODE_ROWS:
            out += [dict(g, bf16=(model == "58m" and m == 2624 and g["op"] in BF16_OPS)) for g in model_gemms(model, m)]
    return out


def _time(fn, args, min_seconds: float, repeats: int) -> float:
    """Best seconds per call over `repeats` repeats of >= min_seconds each; compile and first call excluded."""
    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(repeats):
        n, prev, t0 = 0, None, time.perf_counter()
        while True:
            out = fn(*args)
            n += 1
            if prev is not None:
                jax.block_until_ready(prev)
            prev = out
            if time.perf_counter() - t0 >= min_seconds:
                jax.block_until_ready(out)
                break
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def _dot(dtype: str, variant: str):
    if dtype == "float32" or variant == "native":
        return jax.jit(lambda a, b: jnp.dot(a, b))
    if variant == "native_f32acc":
        return jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    if variant == "upcast":
        return jax.jit(lambda a, b: jnp.dot(*cpu_upcast(a, b), preferred_element_type=jnp.float32))
    raise ValueError(f"unknown variant {variant!r}")


def _kernel(fn, a, b) -> str:
    """What the compiled dot is: the backend's fusion or custom call, plus `+convert` when operands are cast."""
    text = fn.lower(a, b).compile().as_text() or ""
    kind = "dot"
    for marker, label in (("__ynn_fusion", "ynn_fusion"), ("__onednn", "onednn"), ("__xnn_fusion", "xnn_fusion")):
        if marker in text:
            kind = label
            break
    else:
        if "custom_call_target=" in text:
            kind = "custom_call:" + text.split("custom_call_target=", 1)[1].split('"')[1]
    return kind + ("+convert" if " convert(" in text else "")


def gemm(g: dict, dtype: str, variant: str, min_seconds: float, repeats: int) -> dict:
    dev = jax.devices()[0]
    rng = np.random.default_rng(0)
    m, k, n = g["m"], g["k"], g["n"]
    a = jax.device_put(rng.standard_normal((m, k), np.float32), dev).astype(dtype)
    b = jax.device_put(rng.standard_normal((k, n), np.float32), dev).astype(dtype)
    row = {key: g[key] for key in ("name", "model", "op", "phase", "m", "k", "n")}
    row.update(per_layer=g.get("per_layer"), dtype=dtype, variant=variant)
    fn = _dot(dtype, variant)
    try:
        row["kernel"] = _kernel(fn, a, b)
        s = _time(fn, (a, b), min_seconds, repeats)
    except Exception as e:      # e.g. a backend without this dot: recorded, not fatal
        return {**row, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"}
    return {**row, "seconds": s, "gflops": 2 * m * k * n / s / 1e9}


def bandwidth(mib: int, min_seconds: float, repeats: int) -> dict:
    """GB/s over a `mib` MiB float32 array: `x + 1` in place (input donated; read + write), `x + 1` into a
    fresh output (read + write, plus the first touch of newly mapped pages), `sum(x)` (read only)."""
    dev = jax.devices()[0]
    x = jax.device_put(jnp.zeros(mib * (1 << 20) // 4, jnp.float32), dev)
    nbytes = x.nbytes
    fresh = _time(jax.jit(lambda v: v + 1.0), (x,), min_seconds, repeats)
    read = _time(jax.jit(jnp.sum), (x,), min_seconds, repeats)
    inc = jax.jit(lambda v: v + 1.0, donate_argnums=0)
    x = jax.block_until_ready(inc(x))
    best = math.inf
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < min_seconds:
            x = inc(x)      # each call waits on the previous one's output: one in flight
            n += 1
        jax.block_until_ready(x)
        best = min(best, (time.perf_counter() - t0) / n)
    return {"inplace": 2 * nbytes / best / 1e9, "fresh": 2 * nbytes / fresh / 1e9, "read": nbytes / read / 1e9}


def call_overhead_us(min_seconds: float, repeats: int) -> float:
    """Microseconds per call of a trivial jitted op (dispatch + launch + wait), the floor under every row."""
    x = jax.device_put(jnp.zeros((8,), jnp.float32), jax.devices()[0])
    f = jax.jit(lambda v: v + 1.0)
    jax.block_until_ready(f(x))
    best = math.inf
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < min_seconds:
            jax.block_until_ready(f(x))
            n += 1
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def machine() -> dict:
    cpu, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            info = {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in f if ":" in line)}
        cpu = info.get("model name", cpu)
        flags = sorted(fl for fl in info.get("flags", "").split()
                       if fl.startswith(("avx", "amx", "fma", "f16c")) or fl in ("sse4_2",))
    except OSError:
        pass
    return {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "python": platform.python_version(),
            "jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "device_used": str(jax.devices()[0])}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file to write (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="small shapes, short timing (a smoke test)")
    ap.add_argument("--min-seconds", type=float, default=None,
                    help="seconds per timed repeat (default 0.5; --quick 0.02)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed repeats per shape, best kept (default 3; --quick 1)")
    ap.add_argument("--bf16-all", action="store_true", help="bfloat16 on every shape, not only the marked ones")
    ap.add_argument("--bandwidth-mib", type=int, default=None,
                    help="array size for bandwidth (default 256; --quick 16)")
    args = ap.parse_args(argv)
    min_s = args.min_seconds if args.min_seconds is not None else (0.02 if args.quick else 0.5)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    mib = args.bandwidth_mib or (16 if args.quick else 256)

    t_start, load_before = time.perf_counter(), _loadavg()
    overhead = call_overhead_us(min_s, repeats)
    todo = shapes(args.quick)
    gemm(todo[0], "float32", "native", min_s, 1)      # untimed: the process's first big dots ran slow
    rows = []
    for g in todo:
        variants = [("float32", "native")]
        if g.get("bf16") or args.bf16_all:
            variants += [("bfloat16", v) for v in BF16_VARIANTS]
        for dtype, variant in variants:
            row = gemm(g, dtype, variant, min_s, repeats)
            rows.append(row)
            print(f"{row['name']:>36} {g['m']:>5}x{g['k']:>5}x{g['n']:>5} {dtype:>8} {variant:>13}: "
                  + (f"{row['gflops']:8.1f} GFLOP/s ({row['kernel']})" if "gflops" in row else row["error"]),
                  file=sys.stderr)
    bw = bandwidth(mib, min_s, repeats)

    def best(pred):
        rates = [r["gflops"] for r in rows if "gflops" in r and pred(r)]
        return max(rates) if rates else None

    result = {
        "machine": machine(),
        "gemm": rows,
        "peak_gflops": {dt: best(lambda r, dt=dt: r["dtype"] == dt) for dt in ("float32", "bfloat16")},
        "peak_gflops_by_variant": {f"bfloat16/{v}": best(lambda r, v=v: r["dtype"] == "bfloat16" and r["variant"] == v)
                                   for v in BF16_VARIANTS},
        "bandwidth_gbs": bw["inplace"],
        "bandwidth_read_gbs": bw["read"],
        "bandwidth_fresh_output_gbs": bw["fresh"],
        "bandwidth_mib": mib,
        "call_overhead_us": overhead,
        "models": MODELS,
        "timing": {"min_seconds": min_s, "repeats": repeats, "quick": args.quick,
                   "method": "jitted jnp.dot on jax.devices()[0], compile + first call excluded, one call in "
                             "flight, >= min_seconds per repeat, best of repeats"},
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "wall_seconds": time.perf_counter() - t_start,
        "note": "measured on a machine that may have been running other work at the time (see loadavg_*): "
                "a loaded machine lowers the peak, so fractions against it read too high; re-run "
                "`python scripts/bench_peak.py` on an idle machine for figures to keep.",
    }
    write_result(args.out, result, indent=2)
    print(f"peak GFLOP/s {result['peak_gflops']}, bandwidth {bw['inplace']:.1f} GB/s (read {bw['read']:.1f}, "
          f"into a fresh buffer {bw['fresh']:.1f}), "
          f"{result['wall_seconds']:.0f} s -> {args.out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
