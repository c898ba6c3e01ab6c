"""MetroRLHF's blockwise backward against the full-sequence gradient step: compiled memory at the qwen3-0.6b shape
and measured time on a small model on the CPU.

    python scripts/bench_blockwise.py --out scripts/results/bench_blockwise.json     # (+ a PNG beside it)
    python scripts/bench_blockwise.py --quick --out /tmp/b.json                       # tiny sizes (smoke test)

Memory (compile only, nothing runs): for each sequence length and block size T, the executables one training
micro-batch of `--rows` rows runs, lowered on ShapeDtypeStructs (no weights are allocated) and compiled by
XLA:CPU, with `memory_analysis()`: peak = arguments + outputs + temp - aliased (donated) bytes, so the
weights, the micro-batch, the gradient sums and, for blockwise, the K/V cache C and the history gradient ∇C
are all counted. full = `step.make_grad_step` on the whole rows; blockwise = the larger of the K/V recompute
pass (`blockwise.recompute_kv`) and the block step (`blockwise.block_step`). Both use the same attention
implementation (`--attention`, default pallas: the flash kernel, interpret mode on the CPU, whose memory
does not grow with the score matrix; XLA's path materialises score tiles) and the same `--remat`. The
optimizer update (the same in both) is left out. A batch of 8 sequences trains as micro-batches of `--rows`
rows: memory is one micro-batch's, as in the paper's Algorithm 1, which loops over the sequences.

Time (CPU, measured, interleaved repeats, best kept): the full gradient step vs the blockwise gradients with
kv_source=recompute (the recompute pass included), on `--time-model` at `--time-len` tokens per row.
Only the ratio means much on the CPU; the blockwise step's XLA attention runs each block's queries against
the whole (masked) row, about twice the full step's causal attention work (module docstring of
jaxrl/train/blockwise.py), which is most of the difference on a small model.

JSON: {"rows": [{seq_len, block, full_bytes, blockwise_bytes, ratio, full_s, blockwise_s, ...}], ...}; times are
null in the memory rows and memory null in the time rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_harness import interleaved, write_result  # noqa: E402
from jaxrl.train.blockwise import BlockwiseUpdater, block_step, recompute_kv  # noqa: E402
from jaxrl.train.optim import make_optimizer  # noqa: E402
from jaxrl.config.train import OptimSection  # noqa: E402
from jaxrl.train.step import STATS, LossSpec, make_grad_step  # noqa: E402
from models import PRESETS, abstract, init, lora  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_blockwise.json"
FLOAT_FIELDS = ("advantages", "weights", "ref_logp")
INT_FIELDS = ("tokens", "positions", "segment_ids", "targets", "loss_mask")

OUTPUTS = ("bench_blockwise.json", "bench_blockwise.png")  # its files in scripts/results/ (tests/test_docs.py)


def _spec(args) -> LossSpec:
    return LossSpec(clip_high=0.28, kl_coef=0.05, kl_estimator="k3", remat=args.remat, attention_impl=args.attention)


def _mb(rows: int, length: int):
    sd = lambda dt: jax.ShapeDtypeStruct((rows, length), dt)  # noqa: E731
    return {**{k: sd(jnp.int32) for k in INT_FIELDS}, **{k: sd(jnp.float32) for k in FLOAT_FIELDS}}


def _peak(exe) -> dict:
    m = exe.memory_analysis()
    parts = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes, "temp": m.temp_size_in_bytes,
             "alias": m.alias_size_in_bytes}
    parts["peak"] = parts["argument"] + parts["output"] + parts["temp"] - parts["alias"]
    return parts


def memory_row(cfg, dtype, rows: int, seq_len: int, block: int, spec: LossSpec, full_cache: dict) -> dict:
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), abstract(cfg))
    mb = _mb(rows, seq_len)
    t0 = time.perf_counter()
    if seq_len not in full_cache:
        full_cache[seq_len] = _peak(make_grad_step(cfg, spec).lower(params, mb).compile())
    full = full_cache[seq_len]
    P = -(-seq_len // block) * block
    mbp = _mb(rows, P)
    kv_fn = jax.jit(functools.partial(recompute_kv, cfg=cfg, spec=spec, stored=True))
    kv_exe = kv_fn.lower(params, mbp).compile()
    hk = jax.eval_shape(kv_fn, params, mbp)[0]      # C as the block step takes it (`stored_history`)
    gk = jax.ShapeDtypeStruct(hk.shape, jnp.float32)
    acc = (lora.split(params)[0], {k: jax.ShapeDtypeStruct((), jnp.float32) for k in STATS})   # (LoRA: adapters)
    step = jax.jit(functools.partial(block_step, cfg=cfg, spec=spec, block=block), donate_argnums=(4, 5, 6))
    step_exe = step.lower(params, mbp, hk, hk, gk, gk, acc, jax.ShapeDtypeStruct((), jnp.int32)).compile()
    kv_mem, step_mem = _peak(kv_exe), _peak(step_exe)
    blockwise = max(kv_mem["peak"], step_mem["peak"])
    cache = 2 * np.prod(hk.shape) * hk.dtype.itemsize
    row = {"seq_len": seq_len, "block": block, "rows": rows, "full_bytes": full["peak"], "blockwise_bytes": blockwise,
           "ratio": full["peak"] / blockwise, "full_s": None, "blockwise_s": None,
           "full_parts": full, "recompute_parts": kv_mem, "block_step_parts": step_mem,
           "kv_cache_bytes": int(cache), "history_grad_bytes": int(2 * np.prod(gk.shape) * 4),
           "compile_s": time.perf_counter() - t0}
    print(f"memory {seq_len:>6} T={block:>5}: full {full['peak'] / 2**30:7.2f} GiB, blockwise {blockwise / 2**30:6.2f} "
          f"GiB (cache {cache / 2**30:.2f}, grad C {row['history_grad_bytes'] / 2**30:.2f}), ratio {row['ratio']:.2f}",
          file=sys.stderr, flush=True)
    return row


def _batch(cfg, rows: int, seq_len: int, prompt: int, seed: int = 0):
    """One sequence per row: a prompt, then response tokens to the end of the row (the loss region)."""
    rng = np.random.default_rng(seed)
    tok = rng.integers(1, cfg.vocab_size, (rows, seq_len)).astype(np.int32)
    pos = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy()
    mask = np.zeros((rows, seq_len), np.int32)
    mask[:, prompt - 1:seq_len - 1] = 1
    b = {"tokens": tok, "positions": pos, "segment_ids": np.ones_like(tok), "targets": np.roll(tok, -1, 1) * mask,
         "loss_mask": mask, "advantages": rng.normal(size=(rows, seq_len)).astype(np.float32) * mask,
         "weights": mask.astype(np.float32) / mask.sum(), "ref_logp": np.full((rows, seq_len), -8.0, np.float32)}
    return {k: jnp.asarray(v) for k, v in b.items()}


def time_rows(args) -> list[dict]:
    cfg = PRESETS[args.time_model] if args.time_model in PRESETS else _SMALL
    spec = dataclasses.replace(_spec(args), attention_impl="xla")
    params = init(jax.random.key(0), cfg)
    batch = _batch(cfg, args.time_rows, args.time_len, args.time_len // 4)
    tx = make_optimizer(OptimSection(), 1)[0]
    full = make_grad_step(cfg, spec)
    runs = {"full": lambda: full(params, batch)}
    ups = {}
    for T in args.time_blocks:
        ups[T] = BlockwiseUpdater(cfg, spec, tx, block_size=T)
        ups[T].warm(params, tx.init(params), batch)
        runs[T] = functools.partial(ups[T].gradients, params, [batch])
    times = interleaved(runs, args.repeats, warmup=1, sync=jax.block_until_ready).seconds
    full_s = min(times["full"])
    out = []
    for T in args.time_blocks:
        s = min(times[T])
        out.append({"seq_len": args.time_len, "block": T, "rows": args.time_rows, "model": args.time_model,
                    "full_bytes": None, "blockwise_bytes": None, "ratio": None, "full_s": full_s, "blockwise_s": s,
                    "time_ratio": s / full_s, "blocks_run": ups[T].last["blocks"],
                    "full_times_s": times["full"], "blockwise_times_s": times[T]})
        print(f"time {args.time_len} T={T}: full {full_s:.3f}s blockwise {s:.3f}s ({s / full_s:.2f}x)", file=sys.stderr)
    return out


_SMALL = dataclasses.replace(PRESETS["tiny-qwen3"], vocab_size=32000, hidden_size=256, intermediate_size=768,
                             num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=16384)


def plot(result: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mem = [r for r in result["rows"] if r["full_bytes"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for L in sorted({r["seq_len"] for r in mem}):
        rs = sorted((r for r in mem if r["seq_len"] == L), key=lambda r: r["block"])
        ax.plot([r["block"] for r in rs], [r["blockwise_bytes"] / 2**30 for r in rs], "o-", label=f"blockwise, {L} tokens")
        ax.axhline(rs[0]["full_bytes"] / 2**30, ls="--", color=ax.lines[-1].get_color(), lw=1,
                   label=f"full, {L} tokens")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("block size T (tokens)")
    ax.set_ylabel("compiled peak memory (GiB)")
    s = result["settings"]
    ax.set_title(f"{s['model']} {s['dtype']}, {s['rows']} row(s) per micro-batch, attention {s['attention']}, "
                 f"remat {s['remat']}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true", help="tiny model and sizes (a smoke test)")
    ap.add_argument("--model", default="qwen3-0.6b", help="preset for the memory rows")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=1, help="rows (sequences) per micro-batch")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--attention", default="pallas", choices=("pallas", "xla"))
    ap.add_argument("--remat", default="none", choices=("none", "dots", "layer"))
    ap.add_argument("--time-model", default="small", help="model for the timed rows (a preset or 'small')")
    ap.add_argument("--time-len", type=int, default=8192)
    ap.add_argument("--time-rows", type=int, default=1)
    ap.add_argument("--time-blocks", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=("memory", "time"), help="run one part only")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.seq_lens, args.blocks, args.dtype = "tiny-qwen3", [64, 128], [16, 32], "float32"
        args.time_model, args.time_len, args.time_blocks, args.repeats = "tiny-qwen3", 64, [16, 32], 1
    for flag in ("seq_lens", "blocks", "time_blocks"):
        if any(v < 1 for v in getattr(args, flag)):
            ap.error(f"--{flag.replace('_', '-')}: positive values only")
    if args.model not in PRESETS:
        ap.error(f"--model {args.model}: valid choices: {', '.join(sorted(PRESETS))}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    cfg = PRESETS[args.model]
    spec = _spec(args)
    result = {"settings": {"model": args.model, "dtype": args.dtype, "rows": args.rows, "attention": args.attention,
                           "remat": args.remat, "loss": dataclasses.asdict(spec), "time_model": args.time_model,
                           "peak": "argument + output + temp - alias bytes of XLA:CPU's memory_analysis()",
                           "history_grad_dtype": "float32"}}
    rows, full_cache = [], {}
    for L in args.seq_lens if args.only != "time" else ():
        for T in args.blocks:
            if T <= L:
                rows.append(memory_row(cfg, jnp.dtype(args.dtype), args.rows, L, T, spec, full_cache))
    if args.only != "memory":
        rows += time_rows(args)
    result.update(rows=rows, wall_seconds=time.perf_counter() - t0)
    write_result(args.out, result, indent=2, default=float)
    plot(result, args.out.with_suffix(".png"))
    print(markdown(result))
    return result


def markdown(result: dict) -> str:
    lines = ["| tokens per row | T | full GiB | blockwise GiB | memory ratio | full s | blockwise s | time ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        g = lambda b: f"{b / 2**30:.2f}" if b is not None else "-"  # noqa: E731
        f = lambda x, spec=".2f": format(x, spec) if x is not None else "-"  # noqa: E731
        lines.append(f"| {r['seq_len']} | {r['block']} | {g(r['full_bytes'])} | {g(r['blockwise_bytes'])} | "
                     f"{f(r['ratio'])} | {f(r['full_s'], '.3f')} | {f(r['blockwise_s'], '.3f')} | "
                     f"{f(r.get('time_ratio'))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
