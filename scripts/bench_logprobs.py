"""Chunked log-probs vs the naive full-logits path: compiled temp memory, and gradient equality.

    python scripts/bench_logprobs.py --out bench_logprobs.json
    python scripts/bench_logprobs.py --out /tmp/b.json --chunk-size 4096 --dtype float32

Memory: `jax.value_and_grad` (w.r.t. hidden and w) of loss = sum(logp) + 0.01 * sum(entropy) is
lowered and compiled for both paths on abstract inputs (`jax.ShapeDtypeStruct`; nothing of size
tokens x vocab is allocated) at the issue's sizes — vocab 151936 (Qwen), hidden 1024, 4096 tokens —
and `compiled.memory_analysis().temp_size_in_bytes` is compared (ARCHITECTURE.md: temp bytes, not
peak bytes, on the CPU). Arguments and outputs (hidden, w, d_hidden, d_w) are the same for both paths
and not counted in temp bytes. ratio = naive / chunked.

Gradients: both paths run on real float32 inputs at a smaller size (tokens and vocab chosen not to be
multiples of the chunk) with the same loss; the JSON gets the max abs difference of logp, entropy,
d_hidden and d_w, and the largest |d| of each gradient for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_harness import write_result  # noqa: E402
from kernels.logprobs import token_logprobs, token_logprobs_reference  # noqa: E402

VOCAB, HIDDEN, TOKENS = 151936, 1024, 4096
ENT_COEF = 0.01

OUTPUTS = ("bench_logprobs.json", "bench_logprobs_f32.json")  # its files in scripts/results/ (tests/test_docs.py)


def loss_fn(impl, chunk_size):
    def loss(hidden, w, targets):
        if impl == "naive":
            logp, ent = token_logprobs_reference(hidden, w, targets)
        else:
            logp, ent = token_logprobs(hidden, w, targets, chunk_size=chunk_size)
        return jnp.sum(logp) + ENT_COEF * jnp.sum(ent)
    return jax.value_and_grad(loss, argnums=(0, 1))


def temp_bytes(impl, chunk_size, tokens, hidden, vocab, dtype):
    args = (jax.ShapeDtypeStruct((tokens, hidden), dtype), jax.ShapeDtypeStruct((hidden, vocab), dtype),
            jax.ShapeDtypeStruct((tokens,), jnp.int32))
    compiled = jax.jit(loss_fn(impl, chunk_size)).lower(*args).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def grad_check(chunk_size, tokens=515, hidden=128, vocab=None, seed=0):
    vocab = vocab or 5 * chunk_size + 77
    k = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k[0], (tokens, hidden), jnp.float32)
    w = jax.random.normal(k[1], (hidden, vocab), jnp.float32) / hidden ** 0.5 * 3.0
    t = jax.random.randint(k[2], (tokens,), 0, vocab)
    out = {}
    for impl in ("naive", "chunked"):
        (val, (dh, dw)) = jax.jit(loss_fn(impl, chunk_size))(h, w, t)
        fwd = token_logprobs_reference(h, w, t) if impl == "naive" else token_logprobs(h, w, t, chunk_size=chunk_size)
        out[impl] = (val, dh, dw, *fwd)
    (lv, dh, dw, lp, en), (lv2, dh2, dw2, lp2, en2) = out["naive"], out["chunked"]
    diff = lambda a, b: float(jnp.max(jnp.abs(a - b)))  # noqa: E731
    return {"tokens": tokens, "hidden": hidden, "vocab": vocab, "dtype": "float32",
            "loss_abs_diff": diff(lv, lv2), "logp_max_abs_diff": diff(lp, lp2), "entropy_max_abs_diff": diff(en, en2),
            "d_hidden_max_abs_diff": diff(dh, dh2), "d_w_max_abs_diff": diff(dw, dw2),
            "d_hidden_max_abs": float(jnp.max(jnp.abs(dh))), "d_w_max_abs": float(jnp.max(jnp.abs(dw)))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--chunk-size", type=int, default=1024, help="vocabulary columns per chunk")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="hidden and w dtype")
    args = ap.parse_args(argv)
    dtype = jnp.dtype(args.dtype)

    naive = temp_bytes("naive", args.chunk_size, TOKENS, HIDDEN, VOCAB, dtype)
    chunked = temp_bytes("chunked", args.chunk_size, TOKENS, HIDDEN, VOCAB, dtype)
    check = grad_check(args.chunk_size)
    result = {
        "naive_temp_bytes": naive, "chunked_temp_bytes": chunked, "ratio": naive / chunked,
        "chunk_size": args.chunk_size, "vocab": VOCAB, "hidden": HIDDEN, "tokens": TOKENS, "dtype": args.dtype,
        "logits_f32_bytes": TOKENS * VOCAB * 4,
        "grad_max_abs_diff": max(check["d_hidden_max_abs_diff"], check["d_w_max_abs_diff"]),
        "grad_check": check, "backend": jax.default_backend(),
    }
    write_result(args.out, result, indent=2)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
