"""`scripts/gpu_check.py` sections "train" and "memory".

train   scripts/bench_train.py's RL step (GRPO clipped loss + k3 KL, chunked log-probs, AdamW; its `SPEC`,
        `OPTIM`, `grpo_samples`, `packed_batch`, `compile_step`, `step_flops`) at the qwen3-0.6b shape in
        bfloat16 on 16 rows x 1024 tokens (16384 packed tokens; the tiny model and batch with --smoke).
        Seconds per step (median of 3 after a warm-up), and MFU = model FLOPs / step seconds / the bf16 matmul
        peak the env section measured, the FLOPs from bench_train's `step_flops`, which counts attention
        causally, as `attention_chunked` computes it (`causal_pairs`: whole query chunks against the keys up to
        their end); the full S x S square's total is recorded beside it (`total_full_square`). Beside it, where
        torch has CUDA, bench_train_torch's `TorchStep` (transformers' model with the same weights, full logits,
        bf16 on the GPU) on the same rows.
memory  MetroRLHF's blockwise backward against the full-sequence gradient step at 8K and 16K tokens (one row,
        qwen3-0.6b bf16, Pallas flash attention, blocks of 2048): compiled peak = arguments + outputs + temp -
        aliased bytes of `compiled.memory_analysis()` (scripts/bench_blockwise.py's `memory_row`), and, on a
        device with `memory_stats()`, the measured `peak_bytes_in_use` of each variant run for real. That peak
        only grows within a process, so the variants run in ascending order of their compiled peak (the section
        has a process of its own in a full run) and a reading not above the one before is recorded as a lower
        bound only. With --smoke: the tiny model at 64 tokens, blocks of 32, compiled figures only.
"""

from __future__ import annotations

import types

import gpu_check_engine
from gpu_check_common import Section, gib, median_time

TRAIN_ROWS, TRAIN_PROMPT, TRAIN_RESPONSE = 16, 256, 768
MEMORY_LENS, MEMORY_BLOCK = (8192, 16384), 2048


def _setup(s: Section) -> dict:
    """The model, the packed batch (with reference log-probs) and the weights the train step starts from."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import bench_train as bt
    from jaxrl.train.step import make_logprob_fn
    from models import PRESETS, init

    if s.smoke:
        (name, cfg), = bt.QUICK_MODELS.items()
        shape, dtype = bt.QUICK_BATCHES[0], jnp.float32
    else:
        name, cfg, dtype = "qwen3-0.6b", PRESETS["qwen3-0.6b"], jnp.bfloat16
        shape = bt.BatchShape(f"{TRAIN_ROWS}x{TRAIN_PROMPT + TRAIN_RESPONSE}", TRAIN_ROWS, TRAIN_PROMPT,
                              TRAIN_RESPONSE, 4)
    rng = np.random.default_rng(0)
    samples = bt.grpo_samples(rng, cfg.vocab_size, shape.rows, shape.group, shape.prompt,
                              [shape.response] * shape.rows)
    packed, where = bt.packed_batch(samples, shape.seq_len, shape.response)
    params = init(jax.random.key(0), cfg, dtype)
    batch = bt._device(packed)
    ref = jax.jit(bt.perturbed, static_argnums=2)(params, jax.random.key(1), bt.REF_NOISE)    # one program
    batch["ref_logp"] = make_logprob_fn(cfg, bt.SPEC)(ref, batch)
    return {"name": name, "cfg": cfg, "dtype": jnp.dtype(dtype).name, "shape": shape, "where": where,
            "params": params, "batch": batch}


def flops(cfg, tokens: int, seq_len: int) -> dict:
    import bench_train as bt

    f = bt.step_flops(cfg, tokens, seq_len)       # attention counted causally, as attention_chunked computes it
    square = f["attention"] // f["attention_pairs_per_row"] * seq_len * seq_len
    return {**f, "total_causal": f["total"], "total_full_square": f["total"] - f["attention"] + square}


def jax_step(s: Section, held: dict) -> dict:
    import jax

    import bench_train as bt

    cfg, params, batch, shape = held["cfg"], held["params"], held["batch"], held["shape"]
    tx, _ = bt.make_optimizer(bt.OPTIM, 1)
    state = [params, tx.init(params)]
    limit = (s.env().get("device") or {}).get("memory_bytes")
    budget = 0.5 * limit if limit else 12 * 2**30
    exe, remat, temp, compile_s = bt.compile_step(cfg, tx, *state, batch, budget)

    def run():
        state[0], state[1], m = exe(state[0], state[1], batch, 1.0)
        return state[0], m

    sec = median_time(run, 3, jax.block_until_ready)
    f = flops(cfg, shape.rows * shape.seq_len, shape.seq_len)
    dtype = held["dtype"]
    peak = (s.env().get("peak_gflops") or {}).get(dtype)
    achieved = f["total_causal"] / sec / 1e9
    return {"model": held["name"], "dtype": dtype, "rows": shape.rows, "seq_len": shape.seq_len,
            "tokens": shape.rows * shape.seq_len, "remat": remat, "temp_gib": gib(temp), "compile_s": compile_s,
            "step_s": sec, "flops": f, "achieved_gflops": achieved, "peak_gflops": peak,
            "mfu": achieved / peak if peak else None,
            "mfu_full_square": f["total_full_square"] / sec / 1e9 / peak if peak else None}


def torch_prepare(held: dict) -> dict:
    """transformers' model holding the same weights (a host copy taken before the jax step donated them) and the
    same rows, on the GPU in bfloat16."""
    import numpy as np
    import torch

    import bench_train as bt

    dev = gpu_check_engine.TORCH_DEVICE
    model = bt.torch_model(held["cfg"], held.pop("host")).to(dev, torch.bfloat16)
    tb = bt.torch_batch({k: np.asarray(v) for k, v in held["batch"].items()}, held["where"])
    held["torch"] = (bt.TorchStep(model, bt.SPEC, bt.OPTIM), {k: v.to(dev) for k, v in tb.items()})
    return {"dtype": "bfloat16", "attention": "sdpa"}


def torch_step(s: Section, held: dict) -> dict:
    step, tb = held.pop("torch")
    sec = median_time(lambda: step(tb), 3, gpu_check_engine.torch_sync)
    shape = held["shape"]
    f = flops(held["cfg"], shape.rows * shape.seq_len, shape.seq_len)
    peak = (s.env().get("peak_gflops") or {}).get("bfloat16")
    achieved = f["total_causal"] / sec / 1e9
    return {"step_s": sec, "achieved_gflops": achieved, "peak_gflops": peak, "mfu": achieved / peak if peak else None,
            "rows": shape.rows, "seq_len": shape.seq_len, "note": "one sequence per row (the timed rows hold one "
            "each, so packed and padded are the same tokens); full [tokens, vocab] logits"}


def run_train(s: Section) -> None:
    held = {}

    def setup():
        held.update(_setup(s))
        sh = held["shape"]
        return {"model": held["name"], "dtype": held["dtype"], "batch": sh.name, "tokens": sh.rows * sh.seq_len}

    if s.case("setup", setup) is None:
        return
    reason = "smoke runs on the CPU" if s.smoke else gpu_check_engine.torch_cuda_reason()
    if not reason:
        import jax
        held["host"] = jax.device_get(held["params"])          # the jax step donates the device copy
    s.case("jax_step", jax_step, s, held)
    if reason:
        s.skip("torch_step", f"torch train step skipped: {reason}")
        return
    s.case("torch_prepare", torch_prepare, held)
    if "torch" in held:
        s.case("torch_step", torch_step, s, held)


# ------------------------------------------------------------------------------------------------- memory

def _device_stats():
    import jax

    dev = jax.devices()[0]
    return dev.memory_stats() if hasattr(dev, "memory_stats") else None


def measured(held: dict, variant: str, seq_len: int, previous: int) -> dict:
    """Run one variant for real; its process peak (`peak_bytes_in_use`) afterwards."""
    import jax

    import bench_blockwise as bb
    from jaxrl.config.train import OptimSection
    from jaxrl.train.blockwise import BlockwiseUpdater
    from jaxrl.train.optim import make_optimizer
    from jaxrl.train.step import make_grad_step

    cfg, spec, params = held["cfg"], held["spec"], held["params"]
    batch = bb._batch(cfg, 1, seq_len, seq_len // 4)
    if variant == "full":
        out = make_grad_step(cfg, spec)(params, batch)
    else:
        tx = make_optimizer(OptimSection(), 1)[0]
        out = BlockwiseUpdater(cfg, spec, tx, block_size=held["block"]).gradients(params, [batch])
    jax.block_until_ready(out)
    del out, batch
    peak = int(_device_stats()["peak_bytes_in_use"])
    return {"variant": variant, "seq_len": seq_len, "peak_bytes": peak, "peak_gib": gib(peak),
            "above_previous": peak > previous, "valid": peak > previous,
            "note": None if peak > previous else "not above an earlier variant's peak: a lower bound only"}


def run_memory(s: Section) -> None:
    import jax
    import jax.numpy as jnp

    import bench_blockwise as bb
    from models import PRESETS, init

    if s.smoke:
        cfg, dtype, lens, block = PRESETS["tiny-qwen3"], jnp.float32, (64,), 32
    else:
        cfg, dtype, lens, block = PRESETS["qwen3-0.6b"], jnp.bfloat16, MEMORY_LENS, MEMORY_BLOCK
    spec = bb._spec(types.SimpleNamespace(remat="none", attention="pallas"))
    s.info.update(model="tiny-qwen3" if s.smoke else "qwen3-0.6b", dtype=jnp.dtype(dtype).name, block=block,
                  rows=1, attention="pallas", remat="none",
                  compiled_peak="argument + output + temp - alias bytes of compiled.memory_analysis()")
    full_cache, compiled = {}, {}
    for L in lens:
        row = s.case(f"compiled/{L}", lambda L=L: _compiled(cfg, dtype, L, block, spec, full_cache))
        if row:
            compiled[L] = row
    stats = _device_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        s.info["measured"] = f"no device memory_stats on {jax.default_backend()}: compiled figures only"
        return
    held = {"cfg": cfg, "spec": spec, "block": block, "params": init(jax.random.key(0), cfg, dtype)}
    order = sorted(((c[f"{v}_bytes"], v, L) for L, c in compiled.items() for v in ("blockwise", "full")))
    previous = int(_device_stats()["peak_bytes_in_use"])
    for _, variant, L in order:
        got = s.case(f"measured/{variant}/{L}", measured, held, variant, L, previous)
        if got:
            previous = got["peak_bytes"]


def _compiled(cfg, dtype, L: int, block: int, spec, full_cache: dict) -> dict:
    import bench_blockwise as bb

    row = bb.memory_row(cfg, jnp_dtype(dtype), 1, L, block, spec, full_cache)
    return {k: row[k] for k in ("seq_len", "block", "rows", "full_bytes", "blockwise_bytes", "ratio",
                                "kv_cache_bytes", "history_grad_bytes", "compile_s")} | {
        "full_gib": gib(row["full_bytes"]), "blockwise_gib": gib(row["blockwise_bytes"])}


def jnp_dtype(dtype):
    import jax.numpy as jnp

    return jnp.dtype(dtype)
