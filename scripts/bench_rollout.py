"""Rollout engine vs `transformers.generate()` on the CPU, side by side in one run.

    python scripts/bench_rollout.py --out bench_rollout.json            # batches 1, 16, 64 (+ bench_rollout.md)
    python scripts/bench_rollout.py --out /tmp/b.json --quick           # smoke-test sizes
    python scripts/bench_rollout.py --out b.json --gpu-8b               # + llama3.1-8b bf16 decode on a GPU

Both engines compute the same function: random weights from `models.init` are written with
`models.save_hf` and loaded by `transformers` (sdpa attention, its CPU default), float32. Each row
generates exactly `--new-tokens` greedy tokens (HF: `min_new_tokens`, no EOS) for `batch` prompts of
`--prompt-len` tokens; throughput = batch * new_tokens / wall time, prefill included for both. Both are
warmed up once on the same shapes; our compile time (first run minus steady run) is reported apart.
The timed runs alternate ours / theirs and the best of `--repeats` is kept for each.
Our engine gets a fixed page pool sized to fit the batch and `max_seq_len` = prompt + new tokens (what
`engine.max_seq_len` is for: it bounds the page-table widths the decode step gathers). torch uses one thread per core; XLA's CPU
backend uses its own pool over all cores.

On the CPU only the *ratio* measured in one run means anything (ARCHITECTURE.md, "Testing and
measuring"). With `--gpu-8b` and a GPU backend present, the JSON also gets decode ms/token at batch 1
for a random llama3.1-8b-shaped model in bfloat16 against the weight-bytes / memory-bandwidth floor;
without a GPU it records `"gpu": null` and the reason.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_harness import interleaved, write_result  # noqa: E402

# Published HBM bandwidths (bytes/s) for the floor; a measured device-copy bandwidth is reported beside it.
NOMINAL_BW = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12, "L4": 3.0e11, "A10": 6.0e11}

OUTPUTS = ("bench_rollout*.json", "bench_rollout*.md")  # its files in scripts/results/ (tests/test_docs.py): the
# latest run, and earlier ones on other CPUs kept as bench_rollout_<machine>.json (docs/rollout.md shows them all)


def bench_config(quick: bool):
    from models import ModelConfig

    if quick:
        return ModelConfig(architecture="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=8, num_kv_heads=4, head_dim=16, rope_theta=1_000_000.0,
                           max_position_embeddings=2048, qk_norm=True, tie_embeddings=True)
    return ModelConfig(architecture="qwen3", vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=8,
                       num_heads=8, num_kv_heads=4, head_dim=64, rope_theta=1_000_000.0,
                       max_position_embeddings=4096, qk_norm=True, tie_embeddings=True)


def _pages(batch: int, prompt_len: int, new_tokens: int, page_size: int) -> int:
    """A fixed pool: every sequence's full length fits, plus the scratch page."""
    return batch * -(-(prompt_len + new_tokens) // page_size) + 1


def run_ours(cfg, weights, prompts, new_tokens: int, page_size: int, devices=None):
    from jaxrl.rollout import RolloutService, SamplingParams

    svc = RolloutService(cfg, weights, devices=devices, page_size=page_size, max_batch=len(prompts),
                         max_seq_len=len(prompts[0]) + new_tokens,
                         num_pages=_pages(len(prompts), len(prompts[0]), new_tokens, page_size))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    for p in prompts:
        svc.add(p, params)
    t0 = time.perf_counter()
    steps, outs = [], []
    while svc.has_work():
        s0 = time.perf_counter()
        outs += svc.step()
        steps.append(time.perf_counter() - s0)
    wall = time.perf_counter() - t0
    outs.sort(key=lambda c: c.request_id)
    return wall, steps, [c.tokens for c in outs]


def run_hf(model, prompts, new_tokens: int):
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def decode_flops(cfg, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Model FLOPs of generating `new_tokens` for `batch` rows: 2 per matmul weight per token (layers and
    lm_head) plus attention's 4·heads·head_dim per layer per context key (context grows from prompt_len)."""
    h, d = cfg.hidden_size, cfg.head_dim
    layer = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * cfg.intermediate_size
    dense = 2 * (cfg.num_layers * layer + h * cfg.vocab_size)
    mean_context = prompt_len + (new_tokens - 1) / 2
    attention = 4 * cfg.num_layers * cfg.num_heads * d * mean_context
    return batch * new_tokens * (dense + attention)


def _bench_peak():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_peak", Path(__file__).resolve().parent / "bench_peak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def machine_limits(quick: bool) -> dict:
    """This machine's float32 matmul rate and read bandwidth, measured now (bench_peak.py's square 2048³ dot and
    its `sum` over 512 MiB, best of 3): the peak the GFLOP/s are a fraction of, and the bandwidth that bounds a
    decode step whose weights do not stay in cache. --quick: smaller and shorter (smoke test)."""
    bp = _bench_peak()
    n = 512 if quick else 2048
    g = dict(name=f"square {n}", model=None, op="square", phase="reference", m=n, k=n, n=n)
    peak = bp.gemm(g, "float32", "native", min_seconds=0.1 if quick else 1.0, repeats=3)
    read = bp.bandwidth(16 if quick else 512, min_seconds=0.1 if quick else 1.0, repeats=3)["read"]
    return {"peak": peak, "read_gb_s": read}


def _layer_loop(cfg, weights, b, put, kv, step, state, own_pools: bool = False):
    """A prototype of the decode step without the layer scan: the same computation as `model_step.decode_step`
    (its embedding, `models.decoder_layer` with its paged-attention hook, final norm, logits and sampler) as
    programs the host runs in turn: the embedding, one layer program run once per layer over that layer's own
    weight buffers (one compilation for every layer), then the head and sampler. The KV pool: the engine's
    stacked [layers, pages, ...] one donated through each layer program, which writes and reads it at the layer
    index (an input), or with `own_pools` one pool per layer ([1, pages, ...], index 0: no dynamic slice).
    Returns (the step as a callable, a maker of its arguments, whether its tokens equal the engine step's)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.rollout import model_step
    from jaxrl.rollout.executor import decode_inputs
    from kernels import normalize, paged_decode_attention
    from models import decoder_layer
    from models.layers import rms_norm

    layers = [put(jax.tree.map(lambda a, i=i: np.asarray(a[i]), weights.layers)) for i in range(cfg.num_layers)]
    w = put(weights)

    def embed(weights, inputs):
        src, tokens, positions, table, sampling = inputs.unpack()
        return weights.embed[tokens[:, None]]

    def layer_step(layer, x, k_pages, v_pages, l, inputs):
        _, _, positions, page_table, _ = inputs.unpack()
        ps = k_pages.shape[3]
        page = jnp.take_along_axis(page_table, (positions // ps)[:, None], axis=1)[:, 0]
        slot = positions % ps

        def attend(l, q, k, v, pages, _):               # model_step.decode_step's hook
            k_pages, v_pages = pages
            k_pages = k_pages.at[l, page, :, slot].set(k[:, 0].astype(k_pages.dtype))
            v_pages = v_pages.at[l, page, :, slot].set(v[:, 0].astype(v_pages.dtype))
            o, lse_l, _ = paged_decode_attention(q[:, 0], k_pages[l], v_pages[l], page_table, positions + 1,
                                                 window=cfg.sliding_window, implementation="xla")
            return normalize(o, lse_l, dtype=q.dtype)[:, None], (k_pages, v_pages), None

        x, (k_pages, v_pages), _ = decoder_layer(layer, cfg, x, positions[:, None], attend, l, (k_pages, v_pages))
        return x, k_pages, v_pages

    def head(weights, x, inputs):
        sampling = inputs.unpack()[4]
        h = rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
        return model_step.sample(model_step._logits(weights, h[:, 0], cfg.vocab_size), sampling)[0]

    embed, head = jax.jit(embed), jax.jit(head)
    if own_pools:
        layer_step = jax.jit(layer_step, donate_argnums=(2, 3), static_argnums=(4,))
        pools = [[put(jnp.zeros((1,) + a.shape[1:], a.dtype)) for a in kv] for _ in range(cfg.num_layers)]
        ids = [0] * cfg.num_layers
    else:
        layer_step = jax.jit(layer_step, donate_argnums=(2, 3))
        pools = [[put(jnp.zeros_like(a)) for a in kv]]
        ids = [put(np.int32(i)) for i in range(cfg.num_layers)]

    def run(*inputs):
        inputs = inputs[4]
        x = embed(w, inputs)
        for i, (layer, l) in enumerate(zip(layers, ids)):
            pool = pools[i if own_pools else 0]
            x, pool[0], pool[1] = layer_step(layer, x, pool[0], pool[1], l, inputs)
        return head(w, x, inputs)

    prev = put(np.zeros(len(b.tokens), np.int32))
    make_args = lambda: decode_inputs(w, None, None, prev, b, put)  # noqa: E731
    tok, _, *state["kv"] = step(*decode_inputs(w, *state["kv"], prev, b, put))
    got = np.asarray(run(*make_args()))
    return run, make_args, bool((got == np.asarray(tok)[:len(b.tokens)]).all())


def _greedy_batch(batch: int, width: int, context: int):
    """A decode step's batch of `batch` greedy rows, each at `context` tokens over its own `width` pages
    (pages 1.., page 0 the scratch one), as the scheduler would hand it to the engine."""
    import numpy as np

    from jaxrl.rollout.params import SamplingParams
    from jaxrl.rollout.scheduler import DecodeBatch

    greedy = [(SamplingParams(temperature=0.0), 0, 0)] * batch
    return DecodeBatch([], np.ones(batch, np.int32), np.full(batch, context - 1, np.int32),
                       np.full(batch, -1, np.int32),
                       (1 + np.arange(batch * width, dtype=np.int32)).reshape(batch, width), greedy)


def _in_turn(parts: dict, steps: int, warm: int) -> dict:
    """ms per call of each of `parts` (name -> (fn, make_args)): every round calls each part once, so drifts of
    the machine hit all alike; the median of `steps` rounds after `warm` warm-up rounds."""
    import jax

    rounds = interleaved({name: fn for name, (fn, _) in parts.items()}, steps, warmup=warm, sync=jax.block_until_ready,
                         prepare={name: make_args for name, (_, make_args) in parts.items()})
    return {name: 1e3 * statistics.median(ts) for name, ts in rounds.seconds.items()}


def decode_parts(cfg, weights, batch: int, context: int, page_size: int, device, steps: int = 20) -> dict:
    """ms per decode step at `batch` rows over `context` tokens, each part compiled as its own program and
    timed alone, the parts in turn (median of `steps` rounds after 3 warm-up rounds): the engine's step
    (`model_step.decode_step`, greedy rows, as the benchmark runs it), its dense part (the same `decoder_stack` and LM head with
    attention replaced by its query: no KV written, gathered or attended; an argmax for the sampler) and the
    sampler (`sampling.sample` on [batch, vocab] logits). attention_kv_ms = step - dense - sampler: what the
    paged attention and the KV writes add. matmuls_ms: the dense part's matmuls alone over separate per-layer
    buffers (an unrolled chain): what they cost when no layer's weights are copied out of the stacked arrays
    first (the layer scan's dynamic slices are: XLA:CPU has no dot that reads a dynamic slice in place).
    `weight_bytes`: the float32 weights a step reads once."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxrl.rollout import model_step
    from jaxrl.rollout.executor import decode_inputs
    from jaxrl.rollout.sampling import SamplingBatch, sample
    from models import decoder_stack, lm_head

    rep = NamedSharding(jax.sharding.Mesh(np.array([device]), ("tp",)), PartitionSpec())
    put = lambda x: jax.device_put(x, rep)  # noqa: E731
    w = put(weights)
    width = -(-context // page_size)
    shape = (cfg.num_layers, batch * width + 1, cfg.num_kv_heads, page_size, cfg.head_dim)
    k, v = put(jnp.zeros(shape, jnp.float32)), put(jnp.zeros(shape, jnp.float32))
    b = _greedy_batch(batch, width, context)
    prev = put(np.zeros(batch, np.int32))

    def dense(weights, tokens, positions):
        h, _, _ = decoder_stack(weights, cfg, weights.embed[tokens[:, None]], positions[:, None],
                                lambda l, q, k_, v_, carry, xs: (q, carry, None))
        logits = jnp.einsum("be,ev->bv", h[:, 0], lm_head(weights))
        return jnp.argmax(logits, axis=-1)


    step = jax.jit(functools.partial(model_step.decode_step, cfg=cfg), donate_argnums=(1, 2))
    state = {"kv": (k, v)}

    def run_step(*args):
        tok, logp, kk, vv = step(*args)
        state["kv"] = (kk, vv)
        return tok, logp

    parts = {"step_ms": (run_step, lambda: decode_inputs(w, *state["kv"], prev, b, put))}
    tokens, positions = put(b.tokens), put(b.positions)
    parts["dense_ms"] = (jax.jit(dense), lambda: (w, tokens, positions))
    # the same matmuls (q, k, v, o, gate, up, down per layer, then the LM head) over separate per-layer
    # buffers, chained in an unrolled loop: each dot reads its weights where they lie (no norms or RoPE)
    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    per_layer = [{n: put(np.asarray(getattr(weights.layers, n)[i]).reshape(
        (cfg.hidden_size, -1) if n != "wo" and n != "w_down" else (-1, cfg.hidden_size))) for n in names}
        for i in range(cfg.num_layers)]
    head = put(lm_head(weights))

    def matmuls(x, per_layer, head):
        for m in per_layer:
            qkv = jnp.concatenate([x @ m["wq"], x @ m["wk"], x @ m["wv"]], axis=-1)
            x = x + qkv[:, :m["wo"].shape[0]] @ m["wo"]
            x = x + (jax.nn.silu(x @ m["w_gate"]) * (x @ m["w_up"])) @ m["w_down"]
        return jnp.argmax(x @ head, axis=-1)

    x0 = put(np.full((batch, cfg.hidden_size), 0.01, np.float32))
    parts["matmuls_ms"] = (jax.jit(matmuls), lambda: (x0, per_layer, head))
    *parts["layer_loop_ms"], same_tokens = _layer_loop(cfg, weights, b, put, state["kv"], step, state)
    *parts["layer_loop_own_pools_ms"], own_same = _layer_loop(cfg, weights, b, put, state["kv"], step, state,
                                                             own_pools=True)
    logits = put(jax.random.normal(jax.random.key(0), (batch, cfg.vocab_size), jnp.float32))
    sb = SamplingBatch.build(b.sampling, batch)
    sb = put(sb)
    parts["sampler_ms"] = (jax.jit(sample), lambda: (logits, sb))
    ms = _in_turn(parts, steps, warm=3)
    step_ms, dense_ms, matmuls_ms, sampler_ms = ms["step_ms"], ms["dense_ms"], ms["matmuls_ms"], ms["sampler_ms"]
    layer_loop_ms, own_pools_ms = ms["layer_loop_ms"], ms["layer_loop_own_pools_ms"]
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(weights))
    return {"batch": batch, "context": context, "step_ms": step_ms, "dense_ms": dense_ms, "matmuls_ms": matmuls_ms,
            "layer_loop_ms": layer_loop_ms, "layer_loop_same_tokens": same_tokens,
            "layer_loop_own_pools_ms": own_pools_ms, "layer_loop_own_pools_same_tokens": own_same,
            "sampler_ms": sampler_ms,
            "attention_kv_ms": step_ms - dense_ms - sampler_ms, "weight_bytes": nbytes,
            "dense_gb_s": nbytes / dense_ms / 1e6}


def decode_widths(cfg, weights, batch: int, max_seq_len: int, page_size: int, device, steps: int = 15) -> dict:
    """ms of the engine's decode step (`model_step.decode_step`, greedy) at `batch` rows by page-table width, each
    width's rows at a context filling its table, the widths timed in turn (medians of `steps` rounds after 2
    warm-up rounds): what a step costs as sequences grow, and so what each of the run's page buckets (`buckets`,
    `ShapeBuckets.build` for this `max_seq_len`) costs. Widths: every even one up to the table's, and the buckets."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxrl.rollout import model_step
    from jaxrl.rollout.executor import decode_inputs
    from jaxrl.rollout.shapes import ShapeBuckets

    buckets = ShapeBuckets.build(max_batch=batch, max_seq_len=max_seq_len, page_size=page_size).pages
    widths = sorted(set(range(2, buckets[-1] + 1, 2)) | set(buckets))
    rep = NamedSharding(jax.sharding.Mesh(np.array([device]), ("tp",)), PartitionSpec())
    put = lambda x: jax.device_put(x, rep)  # noqa: E731
    w = put(weights)
    shape = (cfg.num_layers, batch * buckets[-1] + 1, cfg.num_kv_heads, page_size, cfg.head_dim)
    state = {"kv": (put(jnp.zeros(shape, jnp.float32)), put(jnp.zeros(shape, jnp.float32)))}
    step = jax.jit(functools.partial(model_step.decode_step, cfg=cfg), donate_argnums=(1, 2))
    prev = put(np.zeros(batch, np.int32))

    def run(b):                       # (the host's input packing timed with the step, as the engine runs it)
        tok, _, *state["kv"] = step(*decode_inputs(w, *state["kv"], prev, b, put))
        return tok

    def part(width):
        b = _greedy_batch(batch, width, width * page_size)
        return run, lambda: (b,)

    return {"batch": batch, "buckets": list(buckets),
            "step_ms": _in_turn({str(width): part(width) for width in widths}, steps, warm=2)}


def bench_cpu(args) -> dict:
    import jax
    import numpy as np
    import torch
    import transformers

    import models

    torch.set_num_threads(os.cpu_count())
    cfg = bench_config(args.quick)
    cpu = jax.devices("cpu")[:1]
    weights = jax.device_put(models.init(jax.random.key(0), cfg), cpu[0])
    with tempfile.TemporaryDirectory() as tmp:
        models.save_hf(tmp, cfg, weights)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    rows = []
    limits = machine_limits(args.quick)
    peak = limits["peak"].get("gflops")
    for B in args.batches:
        prompts = rng.integers(1, cfg.vocab_size, (B, args.prompt_len)).tolist()
        first, _, _ = run_ours(cfg, weights, prompts, args.new_tokens, args.page_size, cpu)     # compiles
        run_hf(hf, prompts, min(8, args.new_tokens))                                           # warm-up
        # interleaved, so slow drifts of the machine hit both alike; each run times its own decoding (not the setup)
        got = interleaved({"ours": lambda: run_ours(cfg, weights, prompts, args.new_tokens, args.page_size, cpu),
                           "hf": lambda: run_hf(hf, prompts, args.new_tokens)}, args.repeats).results
        ours, theirs = got["ours"], got["hf"]
        t_ours, t_hf = min(r[0] for r in ours), min(r[0] for r in theirs)
        agree = float(np.mean(np.array(ours[0][2]) == np.array(theirs[0][1])))
        n = B * args.new_tokens
        row = {"batch": B, "ours_tok_s": n / t_ours, "hf_tok_s": n / t_hf, "ratio": t_hf / t_ours,
               "ours_s": t_ours, "hf_s": t_hf, "ours_compile_s": max(0.0, first - t_ours),
               "ours_decode_ms_per_step": 1e3 * statistics.median(ours[0][1][1:]) if len(ours[0][1]) > 1 else None,
               "greedy_token_agreement": agree}
        row["ours_gflops"] = decode_flops(cfg, B, args.prompt_len, args.new_tokens) / t_ours / 1e9
        row["peak_fraction"] = row["ours_gflops"] / peak if peak else None
        # the parts of one decode step at the run's mean context (prompt + half the new tokens)
        row["parts"] = decode_parts(cfg, weights, B, args.prompt_len + args.new_tokens // 2, args.page_size, cpu[0])
        row["parts"]["read_floor_ms"] = row["parts"]["weight_bytes"] / limits["read_gb_s"] / 1e6
        rows.append(row)
        pt = row["parts"]
        print(f"batch {B}: ours {row['ours_tok_s']:.1f} tok/s, hf {row['hf_tok_s']:.1f} tok/s, "
              f"ratio {row['ratio']:.2f} (compile {row['ours_compile_s']:.1f}s, agreement {agree:.3f}); step "
              f"{pt['step_ms']:.1f} ms = dense {pt['dense_ms']:.1f} + sampler {pt['sampler_ms']:.1f} + attention/KV "
              f"{pt['attention_kv_ms']:.1f}", flush=True)
    widths = decode_widths(cfg, weights, max(args.batches), args.prompt_len + args.new_tokens, args.page_size,
                           cpu[0])
    print(f"batch {widths['batch']}: decode step ms by page-table width {widths['step_ms']} (buckets "
          f"{widths['buckets']})", flush=True)
    from jaxrl.train.summary import machine

    return {"rows": rows, "widths": widths, "machine": machine(), "peak": limits["peak"],
            "read_gb_s": limits["read_gb_s"],
            "loadavg": list(os.getloadavg()), "model": {k: getattr(cfg, k) for k in (
                "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "tie_embeddings")} | {"dtype": "float32"},
            "environment": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                            "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "platform": platform.platform(), "jax_backend": jax.default_backend(),
                            "xla_flags": os.environ.get("XLA_FLAGS", "")},
            "settings": {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "page_size": args.page_size,
                         "repeats": args.repeats, "hf_attention": hf.config._attn_implementation}}


def bench_gpu_8b(args) -> dict:
    """Decode ms/token at batch 1, llama3.1-8b shapes, bfloat16, vs the weight-bytes / bandwidth floor."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import models

    gpus = [d for d in jax.devices() if d.platform == "gpu"] if _has_gpu() else []
    if not gpus:
        return {"gpu": None, "gpu_reason": f"no GPU backend (jax backends: {jax.default_backend()})"}
    dev = gpus[0]
    cfg = models.PRESETS["llama3.1-8b"]
    with jax.default_device(dev):
        weights = models.init(jax.random.key(0), cfg, dtype=jnp.bfloat16)
        weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(weights))
        # Bytes one decode step must read: all weights except the embedding table (only one row is read).
        step_bytes = weight_bytes - weights.embed.size * weights.embed.dtype.itemsize
        x = jnp.ones((1 << 30,), jnp.bfloat16)                   # 2 GiB device copy: read + write
        copy = jax.jit(lambda a: a + 1)
        copy(x).block_until_ready()
        t = min(_timed(lambda: copy(x).block_until_ready()) for _ in range(5))
        measured_bw = 2 * x.size * x.dtype.itemsize / t
        del x
        prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (1, args.prompt_len)).tolist()
        run_ours(cfg, weights, prompts, args.new_tokens, args.page_size, [dev])          # compile
        _, steps, _ = run_ours(cfg, weights, prompts, args.new_tokens, args.page_size, [dev])
    ms = 1e3 * statistics.median(steps[1:])
    nominal = next((bw for k, bw in NOMINAL_BW.items() if k in dev.device_kind), None)
    floor = lambda bw: 1e3 * step_bytes / bw if bw else None  # noqa: E731
    return {"gpu": {"device": dev.device_kind, "model": "llama3.1-8b (random)", "dtype": "bfloat16", "batch": 1,
                    "decode_ms_per_token": ms, "weight_bytes": weight_bytes, "bytes_read_per_step": step_bytes,
                    "nominal_bw_bytes_s": nominal, "floor_ms_nominal": floor(nominal),
                    "measured_copy_bw_bytes_s": measured_bw, "floor_ms_measured": floor(measured_bw),
                    "fraction_of_floor": floor(measured_bw) / ms}}


def _has_gpu() -> bool:
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def markdown(result: dict) -> str:
    lines = ["| batch | ours tok/s | transformers tok/s | ratio | ours GFLOP/s | of peak |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        frac = f"{100 * r['peak_fraction']:.0f}%" if r.get("peak_fraction") else "-"
        lines.append(f"| {r['batch']} | {r['ours_tok_s']:.1f} | {r['hf_tok_s']:.1f} | {r['ratio']:.2f} | "
                     f"{r.get('ours_gflops', 0):.1f} | {frac} |")
    g = result.get("gpu")
    if g:
        lines.append(f"\nGPU ({g['device']}), llama3.1-8b bf16, batch 1: {g['decode_ms_per_token']:.2f} ms/token, "
                     f"floor {g['floor_ms_measured']:.2f} ms (measured bandwidth), "
                     f"{100 * g['fraction_of_floor']:.0f}% of floor")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine and batch (best is kept)")
    ap.add_argument("--quick", action="store_true", help="tiny model and sizes (smoke test)")
    ap.add_argument("--gpu-8b", action="store_true", help="also time llama3.1-8b bf16 decode when a GPU is present")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.new_tokens, args.prompt_len, args.repeats = [1, 4], 8, 8, 1
    for name in ("new_tokens", "prompt_len", "page_size", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.batches) < 1:
        ap.error("--batches must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from jaxrl.runtime import cpu_compile_level

    cpu_compile_level()             # the LLVM level a user's CPU process compiles at (no-op once JAX has started)
    result = bench_cpu(args)
    if args.gpu_8b:
        result.update(bench_gpu_8b(args))
    out = write_result(args.out, result, indent=2)
    out.with_suffix(".md").write_text(markdown(result) + "\n")     # the README table
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
