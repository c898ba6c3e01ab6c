"""`scripts/gpu_check.py` section "engine": the rollout engine on the device.

  pallas_equals_xla  the engine on the Pallas kernels (flash prefill, paged decode; Triton on the GPU, interpret
                     mode on the CPU) against the XLA path: greedy tokens identical and log-probs within
                     tests/test_rollout.py's `LOGPROB_ATOL_F32`, on the tiny random qwen3 model of that test
                     (float32, `jax.default_matmul_precision("highest")` as in the kernels section).
  decode/IMPL/bB     greedy decode of B prompts at the qwen3-0.6b shape, random bfloat16 weights (a tiny model with
                     --smoke), IMPL = pallas then xla: tokens/s from the median decode step, and the HBM bytes a
                     step must read (every weight matrix the step multiplies: the tied embedding as the lm_head;
                     plus the K/V of the valid context) over that step time, as a fraction of the copy bandwidth
                     the env section measured. A fixed page pool sized to the batch and max_seq_len = prompt + new
                     tokens (one page-table width), as scripts/bench_rollout.py sets it; compile excluded (a warm
                     run of the same shapes first).
  hf/bB              `transformers.generate` (sdpa, bfloat16, CUDA) of the same shape and batch, random weights of
                     its own, through bench_rollout's `run_hf`; wall-clock tokens/s beside ours (prefill included on
                     both sides). Recorded as skipped with the reason where torch has no CUDA.
"""

from __future__ import annotations

import statistics
import time

from gpu_check_common import Section, allclose, judged

BATCHES = (1, 16, 64, 256)
PROMPT, NEW, PAGE = 64, 64, 16          # max_seq_len 128: 8 pages, one page-table width (ShapeBuckets)
TORCH_DEVICE = "cuda"                   # where transformers / torch run (a CPU check of this code sets "cpu")
SMOKE = dict(batches=(2,), prompt=8, new=8, impls=("xla",))


def pallas_equals_xla(smoke: bool) -> dict:
    import jax
    import numpy as np

    from jaxrl.rollout import SamplingParams, generate
    from models import init
    from jaxrl.testing import LOGPROB_ATOL_F32, PROMPT_LENS, ROLLOUT_CFG as CFG

    weights = init(jax.random.key(0), CFG)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in PROMPT_LENS]
    if smoke:
        prompts = [prompts[0], prompts[3]]
    params = SamplingParams(max_new_tokens=4 if smoke else 16, temperature=0.0)
    kw = dict(page_size=PAGE, num_pages=32, prefill_chunk=16, devices=jax.devices()[:1])
    with jax.default_matmul_precision("highest"):
        xla = generate(CFG, weights, prompts, params, **kw)
        pallas = generate(CFG, weights, prompts, params, **kw, attention_impl="pallas")
    same = [o.tokens for o in pallas] == [o.tokens for o in xla]
    agree = float(np.mean([a == b for p, x in zip(pallas, xla) for a, b in zip(p.tokens, x.tokens)]))
    err, ok = (allclose([o.logprobs for o in pallas], [o.logprobs for o in xla], atol=LOGPROB_ATOL_F32)
               if same else (float("nan"), False))
    return {"model": "tiny-qwen3 (random, float32)", "prompts": len(prompts), "new_tokens": params.max_new_tokens,
            "token_agreement": agree,
            "checks": {"tokens_identical": {"max_err": 0.0 if same else 1.0 - agree, "tolerance": 0.0,
                                            "passed": same},
                       "logprobs": judged(err, LOGPROB_ATOL_F32, ok)}}


def step_bytes(cfg, weights, batch: int, context: float) -> int:
    """HBM bytes one decode step must read: every matrix it multiplies (the embedding only as a tied lm_head; a
    lookup of `batch` rows otherwise, left out) and the K/V of `context` keys per sequence."""
    import jax
    import numpy as np

    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(weights))
    if not cfg.tie_embeddings:
        total -= weights.embed.size * weights.embed.dtype.itemsize
    itemsize = np.dtype(jax.tree.leaves(weights)[0].dtype).itemsize
    kv = batch * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize * context
    return int(total + kv)


def generation(cfg, weights, prompts, new: int, impl: str):
    """(wall seconds, per-step seconds, tokens) of one greedy generation on a fresh service (bench_rollout's
    `run_ours` with the attention implementation chosen)."""
    import jax

    import bench_rollout
    from jaxrl.rollout import RolloutService, SamplingParams

    svc = RolloutService(cfg, weights, devices=jax.devices()[:1], page_size=PAGE, max_batch=len(prompts),
                         max_seq_len=len(prompts[0]) + new, attention_impl=impl,
                         num_pages=bench_rollout._pages(len(prompts), len(prompts[0]), new, PAGE))
    for p in prompts:
        svc.add(p, SamplingParams(max_new_tokens=new, temperature=0.0))
    steps, outs, t0 = [], [], time.perf_counter()
    while svc.has_work():
        s0 = time.perf_counter()
        outs += svc.step()
        steps.append(time.perf_counter() - s0)
    return time.perf_counter() - t0, steps, [c.tokens for c in sorted(outs, key=lambda c: c.request_id)]


def decode_row(s: Section, cfg, weights, batch: int, prompt: int, new: int, impl: str) -> dict:
    import numpy as np

    prompts = np.random.default_rng(batch).integers(1, cfg.vocab_size, (batch, prompt)).tolist()
    first, _, _ = generation(cfg, weights, prompts, new, impl)                 # compiles
    wall, steps, tokens = generation(cfg, weights, prompts, new, impl)
    step_s = statistics.median(steps[1:]) if len(steps) > 1 else steps[0]
    nbytes = step_bytes(cfg, weights, batch, prompt + (new - 1) / 2)
    copy = s.env().get("copy_gbs")
    achieved = nbytes / step_s / 1e9
    return {"batch": batch, "impl": impl, "prompt": prompt, "new_tokens": new, "decode_step_s": step_s,
            "decode_tok_s": batch / step_s, "wall_s": wall, "wall_tok_s": batch * new / wall,
            "compile_s": max(0.0, first - wall), "step_bytes": nbytes, "achieved_gbs": achieved,
            "copy_gbs": copy, "hbm_fraction": achieved / copy if copy else None,
            "generated": sum(len(t) for t in tokens)}


def hf_row(model, batch: int, prompt: int, new: int, vocab: int) -> dict:
    import numpy as np
    import torch

    import bench_rollout

    prompts = np.random.default_rng(batch).integers(1, vocab, (batch, prompt)).tolist()
    with torch.device(TORCH_DEVICE):                # run_hf makes its tensors on the default device
        bench_rollout.run_hf(model, prompts, min(8, new))                       # warm-up
        torch_sync()
        wall, out = bench_rollout.run_hf(model, prompts, new)
    return {"batch": batch, "wall_s": wall, "wall_tok_s": batch * new / wall,
            "generated": sum(len(t) for t in out), "attention": model.config._attn_implementation}


def hf_model(cfg):
    import numpy as np
    import torch
    import transformers

    from models import config_to_hf

    hf_cfg = transformers.AutoConfig.for_model(**config_to_hf(cfg, np.float32))
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(TORCH_DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    return model.eval()


def torch_sync(*_) -> None:
    import torch

    if TORCH_DEVICE == "cuda":
        torch.cuda.synchronize()


def torch_cuda_reason() -> str | None:
    """None when torch can run on CUDA here, else why not."""
    try:
        import torch
    except ImportError as e:
        return f"torch not importable: {e}"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def run_engine(s: Section) -> None:
    import jax
    import jax.numpy as jnp

    import bench_rollout
    from models import PRESETS, init

    s.case("pallas_equals_xla", pallas_equals_xla, s.smoke)
    if s.smoke:
        cfg, dtype = bench_rollout.bench_config(True), jnp.float32
        batches, prompt, new, impls = SMOKE["batches"], SMOKE["prompt"], SMOKE["new"], SMOKE["impls"]
        s.info["model"] = "bench_rollout --quick model (float32)"
    else:
        cfg, dtype = PRESETS["qwen3-0.6b"], jnp.bfloat16
        batches, prompt, new, impls = BATCHES, PROMPT, NEW, ("pallas", "xla")
        s.info["model"] = "qwen3-0.6b shape, random weights, bfloat16"
    s.info.update(prompt=prompt, new_tokens=new, page_size=PAGE, batches=list(batches), impls=list(impls))
    weights = init(jax.random.key(0), cfg, dtype)
    for impl in impls:
        for b in batches:
            s.case(f"decode/{impl}/b{b}", decode_row, s, cfg, weights, b, prompt, new, impl)
    reason = "smoke runs on the CPU" if s.smoke else torch_cuda_reason()
    if reason:
        for b in batches:
            s.skip(f"hf/b{b}", f"transformers.generate skipped: {reason}")
        return
    held = {}

    def load():
        held["model"] = hf_model(cfg)
        return {"dtype": "bfloat16", "attention": "sdpa", "weights": "random (transformers' own init)"}

    s.case("hf/load", load)
    for b in batches:
        if "model" not in held:
            s.skip(f"hf/b{b}", "transformers model did not load (see hf/load)")
        else:
            s.case(f"hf/b{b}", hf_row, held["model"], b, prompt, new, cfg.vocab_size)
