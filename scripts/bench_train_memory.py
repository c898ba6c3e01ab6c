"""Compiled temp memory of the real train step for each rematerialisation policy.

    python scripts/bench_train_memory.py                      # -> scripts/results/bench_train_memory.json
    python scripts/bench_train_memory.py --out /tmp/m.json --tokens 4096 8192 --remat none layer dots

The step is `jaxrl.train.step.make_train_step` as the trainer builds it: GRPO clipped token loss with
a k3 KL term to reference log-probs and an entropy bonus, log-probs from the chunked vocabulary
projection (`kernels.logprobs`), AdamW with global-norm clipping (`jaxrl.train.optim`), one
micro-batch of one packed row of `tokens` tokens. It is lowered and compiled on abstract inputs
(`jax.ShapeDtypeStruct`: nothing is allocated, nothing runs) and
`compiled.memory_analysis().temp_size_in_bytes` is recorded: the step's working memory beyond its
arguments and outputs (params, optimizer state and batch are the same for every policy). On the CPU
this is XLA's CPU buffer assignment; a GPU compile (same script, JAX_PLATFORMS unset) gives the GPU's.

Model (float32): hidden 512, 8 layers, 8 heads / 4 KV heads, head_dim 64, MLP 1536, vocab 32000,
untied embeddings; XLA attention (the Pallas kernel would not hold [heads, T, T] probabilities).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_harness import write_result  # noqa: E402
from jaxrl.config.train import OptimSection  # noqa: E402
from jaxrl.train.optim import make_optimizer  # noqa: E402
from jaxrl.train.step import LossSpec, make_train_step  # noqa: E402
from models import ModelConfig, abstract  # noqa: E402
from models.forward import REMAT_POLICIES  # noqa: E402

MODEL = ModelConfig(architecture="qwen3", vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=8,
                    num_heads=8, num_kv_heads=4, head_dim=64, max_position_embeddings=16384, qk_norm=True,
                    tie_embeddings=False)
SPEC = LossSpec(clip_low=0.2, clip_high=0.28, kl_coef=0.05, kl_estimator="k3", entropy_coef=0.001)

OUTPUTS = ("bench_train_memory.json",)  # its files in scripts/results/ (tests/test_docs.py)


def abstract_batch(tokens: int) -> dict:
    i32 = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    f32 = jax.ShapeDtypeStruct((1, tokens), jnp.float32)
    return {"tokens": i32, "positions": i32, "segment_ids": i32, "targets": i32, "loss_mask": i32,
            "advantages": f32, "weights": f32, "ref_logp": f32}


def measure(tokens: int, remat: str, attention_impl: str) -> dict:
    tx, _ = make_optimizer(OptimSection(lr=1e-6, weight_decay=0.01, clip_norm=1.0), 100)
    params = abstract(MODEL, jnp.float32)
    opt_state = jax.eval_shape(tx.init, params)
    step = make_train_step(MODEL, dataclasses.replace(SPEC, remat=remat, attention_impl=attention_impl), tx, 1)
    t0 = time.perf_counter()
    compiled = step.lower(params, opt_state, abstract_batch(tokens), jax.ShapeDtypeStruct((), jnp.float32)).compile()
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    return {"tokens": tokens, "remat": remat, "attention_impl": attention_impl,
            "temp_bytes": int(mem.temp_size_in_bytes), "temp_gib": mem.temp_size_in_bytes / 2**30,
            "argument_bytes": int(mem.argument_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
            "compile_s": round(seconds, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "bench_train_memory.json"))
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--remat", nargs="+", default=list(REMAT_POLICIES), choices=REMAT_POLICIES)
    ap.add_argument("--attention-impl", default="xla", choices=("xla", "pallas"))
    args = ap.parse_args(argv)
    rows = []
    for tokens in args.tokens:
        for remat in args.remat:
            row = measure(tokens, remat, args.attention_impl)
            rows.append(row)
            print(f"tokens={tokens:6d} remat={remat:5s} temp={row['temp_gib']:8.3f} GiB  "
                  f"(compile {row['compile_s']:.1f} s)", flush=True)
    out = {"device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform, "jax": jax.__version__,
           "model": dataclasses.asdict(MODEL), "loss": dataclasses.asdict(SPEC),
           "optimizer": "adamw + clip_by_global_norm",
           "rows": rows}
    path = write_result(args.out, out, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
