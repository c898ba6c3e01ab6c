"""LoRA against full-parameter training: the train step, the weight sync, the reference policy's memory and
MetroRLHF's blockwise backward in the paper's LoRA setting.

    python scripts/bench_lora.py --out scripts/results/bench_lora.json
    python scripts/bench_lora.py --quick --out /tmp/l.json          # tiny sizes (smoke test)

Parts (each a list of rows in the JSON):
  train      the fused train step (`step.make_train_step`: gradients + AdamW update) at the 58M shape (measured on
             the CPU, interleaved repeats, median; and compiled) and at qwen3-0.6b's (compile only: nothing is
             allocated): XLA's memory analysis (arguments = weights + optimizer state + batch, temp, peak) and
             the step time, full vs LoRA (rank `--rank`, all seven projections).
  sync       the weight sync into 2 rollout instances (tp=2, devices 4-7) from an fsdp=4 train mesh (devices
             0-3) at the 58M shape: bytes moved (`ReshardReport.bytes_moved`) and seconds (median), full vs
             LoRA (the adapters only: `RolloutService.update_weights`).
  decode     greedy decoding with the adapters as a low-rank path (the engine's choice) vs a merged copy at the
             58M shape: seconds and tokens/s (median of interleaved repeats), and whether the tokens agree.
  memory     state bytes per model shape, computed from the abstract weights: weights, AdamW moments, the
             reference policy (a copy of the weights when training every weight; none with LoRA, whose
             reference is the base), the gradient sums, and the checkpoint's arrays.
  blockwise  MetroRLHF Table 1's setting: Qwen3-0.6B shapes, bfloat16, LoRA rank 4, one 32K sequence per
             micro-batch, T = 1K..16K: compiled peak of the full-sequence gradient step vs the blockwise
             backward (`bench_blockwise.memory_row`, K/V cache included), beside the paper's figures.

On the CPU only ratios and bytes mean much; the machine is named in the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_blockwise as bb  # noqa: E402
from bench_harness import interleaved, write_result  # noqa: E402
from bench_train import MODELS, QUICK_MODELS  # noqa: E402
from jaxrl.config.train import OptimSection  # noqa: E402
from jaxrl.rollout import RolloutService, SamplingParams  # noqa: E402
from jaxrl.train.optim import init_state, make_optimizer  # noqa: E402
from jaxrl.train.step import LossSpec, make_train_step  # noqa: E402
from models import PRESETS, abstract, init, logical_axes, lora  # noqa: E402
from models.config import LoraConfig  # noqa: E402
from sharding import Layout, ShardingRules, shardings_for  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_lora.json"
OUTPUTS = ("bench_lora.json",)      # its files in scripts/results/ (tests/test_docs.py)
# MetroRLHF Table 1, Qwen3-0.6B, Ctx = 32K, W = inf, LoRA rank 4, bf16, MI300: peak memory (GiB)
PAPER_PM = {"full": 72.3, 1024: 12.2, 2048: 14.7, 4096: 19.5, 8192: 29.1, 16384: 48.4}
SPEC = LossSpec(clip_high=0.28, kl_coef=0.05, remat="dots")


def _with(cfg, rank: int | None):
    return dataclasses.replace(cfg, lora=None if rank is None else LoraConfig(rank=rank, alpha=2.0 * rank))


def _abstract(cfg, dtype):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), abstract(cfg))


def _nbytes(tree) -> int:
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _batch(cfg, rows: int, length: int):
    b = bb._batch(cfg, rows, length, length // 4)
    b["old_logp"] = b["ref_logp"]
    return b


def _compiled(cfg, dtype, rows, length):
    tx = make_optimizer(OptimSection(), 10)[0]
    p = _abstract(cfg, dtype)
    o = jax.eval_shape(tx.init, lora.split(p)[0])
    mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _batch(PRESETS["tiny-qwen3"], rows, length))
    exe = make_train_step(cfg, SPEC, tx, 1).lower(p, o, mb, 1.0).compile()
    return bb._peak(exe)


def train_rows(args) -> list[dict]:
    out = []
    models = QUICK_MODELS if args.quick else {"58m": MODELS["58m"]}
    for name, base in models.items():
        rows, length = (2, 64) if args.quick else (args.rows, args.length)
        steps, mem = {}, {}
        for kind, rank in (("full", None), ("lora", args.rank)):
            cfg = _with(base, rank)
            mem[kind] = _compiled(cfg, jnp.float32, rows, length)
            tx = make_optimizer(OptimSection(lr=1e-5), 10)[0]
            params = init(jax.random.key(0), cfg)
            mesh = Layout().make_mesh(jax.devices()[:1])
            sh = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), params)
            state = [params, init_state(tx, params, sh, mesh)]
            batch = _batch(cfg, rows, length)
            fn = make_train_step(cfg, SPEC, tx, 1)

            def run(fn=fn, state=state, batch=batch):
                state[0], state[1], m = fn(state[0], state[1], batch, 1.0)
                jax.block_until_ready(m)
            run()
            steps[kind] = run
        times = interleaved(steps, args.repeats).seconds
        med = {k: statistics.median(v) for k, v in times.items()}
        out.append({"model": name, "rows": rows, "seq_len": length, "rank": args.rank, "dtype": "float32",
                    "full_s": med["full"], "lora_s": med["lora"], "time_ratio": med["lora"] / med["full"],
                    "full_times_s": times["full"], "lora_times_s": times["lora"],
                    "full_mem": mem["full"], "lora_mem": mem["lora"],
                    "peak_ratio": mem["full"]["peak"] / mem["lora"]["peak"],
                    "temp_ratio": mem["full"]["temp"] / max(mem["lora"]["temp"], 1)})
        print(f"train {name}: full {med['full']:.3f}s lora {med['lora']:.3f}s; peak {mem['full']['peak'] / 2**20:.0f} "
              f"vs {mem['lora']['peak'] / 2**20:.0f} MiB", file=sys.stderr, flush=True)
    if not args.quick:
        name, base = "qwen3-0.6b", PRESETS["qwen3-0.6b"]
        mem = {k: _compiled(_with(base, r), jnp.bfloat16, 1, args.length) for k, r in (("full", None), ("lora", args.rank))}
        out.append({"model": name, "rows": 1, "seq_len": args.length, "rank": args.rank, "dtype": "bfloat16",
                    "full_s": None, "lora_s": None, "time_ratio": None, "full_mem": mem["full"], "lora_mem": mem["lora"],
                    "peak_ratio": mem["full"]["peak"] / mem["lora"]["peak"],
                    "temp_ratio": mem["full"]["temp"] / max(mem["lora"]["temp"], 1)})
        print(f"train {name} (compiled): peak {mem['full']['peak'] / 2**30:.2f} vs {mem['lora']['peak'] / 2**30:.2f} GiB",
              file=sys.stderr, flush=True)
    return out


def sync_rows(args) -> list[dict]:
    base = QUICK_MODELS["tiny"] if args.quick else MODELS["58m"]
    out = []
    for kind, rank in (("full", None), ("lora", args.rank)):
        cfg = _with(base, rank)
        layout = Layout(fsdp=4)
        mesh = layout.make_mesh(jax.devices()[:4])
        sh = shardings_for(logical_axes(cfg), mesh, ShardingRules.train(cfg, layout))
        params = init(jax.random.key(0), cfg, shardings=sh)
        svc = RolloutService(cfg, params, tp=2, instances=2, devices=jax.devices()[4:8], max_batch=8, max_seq_len=64,
                             num_pages=16)
        seconds, moved = [], []
        for i in range(args.repeats + 1):
            new = jax.tree.map(lambda x: x * 1.0, params)      # a fresh update's arrays (never donated here)
            jax.block_until_ready(new)
            t0 = time.perf_counter()
            reports = svc.update_weights(new, adapters_only=rank is not None)     # (what an RL step's sync does)
            jax.block_until_ready([inst.weights for inst in svc.instances])
            if i:
                seconds.append(time.perf_counter() - t0)
                moved.append(sum(r.bytes_moved for r in reports))
        out.append({"kind": kind, "rank": rank, "model": "tiny" if args.quick else "58m", "bytes_moved": moved[-1],
                    "seconds": statistics.median(seconds), "times_s": seconds,
                    "trainable_bytes": lora.adapter_bytes(params), "weight_bytes": _nbytes(params)})
        print(f"sync {kind}: {moved[-1] / 2**20:.2f} MiB in {statistics.median(seconds) * 1e3:.1f} ms", file=sys.stderr)
    return out


def decode_rows(args) -> list[dict]:
    """Decode with the adapters as a low-rank path (what the engine does) vs a merged copy (plain weights):
    the same greedy tokens' time, interleaved repeats, median. This is the measurement behind the choice."""
    base = QUICK_MODELS["tiny"] if args.quick else MODELS["58m"]
    cfg = _with(base, args.rank)
    params = init(jax.random.key(0), cfg)
    t, f = lora.split(params)
    t = jax.tree.map(lambda x: x + 0.01, t)                    # B != 0: the adapters change the tokens
    params = lora.join(t, f)
    rng = np.random.default_rng(0)
    batch, new = (4, 8) if args.quick else (args.decode_batch, args.decode_tokens)
    prompts = [rng.integers(1, cfg.vocab_size, 16).tolist() for _ in range(batch)]
    sp = SamplingParams(max_new_tokens=new, temperature=0.0)
    kinds = {"low-rank": (cfg, params), "merged": (dataclasses.replace(cfg, lora=None), lora.merge(params))}
    svcs = {k: RolloutService(c, w, tp=1, instances=1, devices=jax.devices()[:1], max_batch=batch,
                              max_seq_len=16 + new + 8) for k, (c, w) in kinds.items()}

    def run(svc):
        for p in prompts:
            svc.add(p, sp)
        return [c.tokens for c in svc.run()]
    tokens = {k: run(s) for k, s in svcs.items()}           # (compiles)
    times = interleaved({k: functools.partial(run, s) for k, s in svcs.items()}, args.repeats).seconds
    med = {k: statistics.median(v) for k, v in times.items()}
    same = sum(a == b for a, b in zip(sorted(tokens["low-rank"]), sorted(tokens["merged"])))
    print(f"decode: low-rank {med['low-rank']:.3f}s merged {med['merged']:.3f}s", file=sys.stderr, flush=True)
    return [{"kind": k, "model": "tiny" if args.quick else "58m", "rank": args.rank, "batch": batch, "new_tokens": new,
             "seconds": med[k], "times_s": times[k], "tokens_per_s": batch * new / med[k],
             "sequences_identical": same, "sequences": batch} for k in svcs]


def memory_rows(args) -> list[dict]:
    out = []
    for name in (("tiny-qwen3",) if args.quick else ("qwen3-0.6b", "qwen3-8b", "qwen3-14b")):
        for kind, rank in (("full", None), ("lora", args.rank)):
            p = _abstract(_with(PRESETS[name], rank), jnp.bfloat16)
            trainable = lora.split(p)[0]
            w, t = _nbytes(p), _nbytes(trainable)
            out.append({"model": name, "kind": kind, "rank": rank, "dtype": "bfloat16", "weight_bytes": w,
                        "trainable_bytes": t, "adam_bytes": 2 * t, "grad_bytes": t,
                        "reference_bytes": 0 if rank else w, "checkpoint_bytes": 3 * t,
                        "total_bytes": w + 2 * t + t + (0 if rank else w)})
    return out


def blockwise_rows(args) -> list[dict]:
    cfg = _with(QUICK_MODELS["tiny"] if args.quick else PRESETS["qwen3-0.6b"], 4)
    spec = LossSpec(clip_high=0.28, kl_coef=0.05, kl_estimator="k3", remat="none", attention_impl="pallas")
    seq, blocks = (256, (64, 128)) if args.quick else (32768, (1024, 2048, 4096, 8192, 16384))
    cache, out = {}, []
    for T in blocks:
        row = bb.memory_row(cfg, jnp.bfloat16, 1, seq, T, spec, cache)
        row.update(rank=4, paper_full_gib=None if args.quick else PAPER_PM["full"],
                   paper_blockwise_gib=None if args.quick else PAPER_PM[T],
                   paper_ratio=None if args.quick else PAPER_PM["full"] / PAPER_PM[T])
        out.append(row)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true", help="tiny model and sizes (a smoke test)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--only", nargs="+", choices=("train", "sync", "decode", "memory", "blockwise"),
                    help="run these parts only, keeping the other parts of an existing --out file")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    parts = args.only or ("memory", "sync", "decode", "train", "blockwise")
    t0 = time.perf_counter()
    earlier = json.loads(args.out.read_text()) if args.only and args.out.exists() else {}
    result = {**earlier, "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                          "cpus": os.cpu_count(), "jax": jax.__version__, "devices": str(jax.devices()[0].platform)}}
    for part in parts:
        result[part] = globals()[f"{part}_rows"](args)
    result["wall_seconds"] = time.perf_counter() - t0
    write_result(args.out, result)
    print(f"wrote {args.out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
