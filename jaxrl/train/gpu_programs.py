"""The programs a GPU run compiles, from abstract inputs only: one list for CI and for the first GPU.

CI lowers every program here for CUDA (`export`: `jax.export(..., platforms=["cuda"])`, Pallas -> Triton IR,
no device needed; tests/test_cuda_export.py) and `scripts/gpu_check.py`'s `programs` section compiles the same
list on the device, so a GPU run compiles exactly what CI lowered. Nothing is allocated: weights, KV pools
and batches are `jax.ShapeDtypeStruct`s with their shardings (`models.abstract`, `sharding.shardings_for`).

Kernels (`kernel_programs`): one program per (GQA ratio, head dim) of the presets with a GPU head dim (64, 128:
`gqa_head_dims`: 2/128 qwen3-0.6b, 4/128, 5/128, 7/128, 4/64 llama-3.2-1b, 3/64 SmolLM2's 9/3 heads) and dtype,
calling the kernel once per shape of its grid, so a family of shapes shares one trace and one export:
  paged decode  `paged_decode_attention(implementation="pallas")`, bfloat16 pages, at every page-table width
                of the default `ShapeBuckets` (engine defaults: 64 rows, 1024 tokens, 16-token pages: 8-64
                pages) and every width 1-8 (a table of at most 8 pages keeps its own width: 3, 5, 6, 7
                included), each at the largest batch bucket, and at every batch bucket over the widest table
                (a batch bucket changes only the kernel's grid, not its tiles: `paged_grid`)
  flash         `attention(implementation="pallas")`, float32 and bfloat16: the forward at every (chunk
                width, page-table width) of the default buckets' prefill shapes with q_offset and kv_lengths
                per row, as `prefill_step` calls it (the largest row count of each: `prefill_grid`); forward +
                both backward kernels over packed training rows (`PACK_LENS`, segment ids) and over
                MetroRLHF's block at a traced offset into its buffer (`BLOCKS`)
Steps (`step_programs`), Pallas on, for `model_runs()` (qwen3-0.6b and llama-3.2-1b at TP1 and TP2 with the
engine's and trainer's defaults, SmolLM2-135M at TP1 with its recipe's: its 9/3 heads do not split over 2):
the engine's decode and prefill steps at the cover shapes a run starts with (the largest batch over the
widest table; the widest chunk's rows cap), with the weights and KV pool sharded as `RolloutService` places
them; the update's log-prob pass, its gradient step (fused loss, full backward: `make_grad_step`) and
MetroRLHF's blockwise backward (`BlockwiseUpdater`'s K/V pass and block step) on the train mesh, with the
trainer's micro-batch (micro_batch_tokens // pack_len rows).

Not here (stated): the optimizer update (`make_apply_update`: no Pallas, nothing Triton lowers), the sampler's
variants beyond greedy (`truncate=True` changes XLA code, not a kernel), PPO's critic (`jaxrl.train.critic`, GAE
runs only: the gradient step's decoder and flash kernels under a value head) and the other batch buckets of
the steps themselves (the kernel grid has their kernels). llama-3.2-1b and SmolLM2 are
not presets in `models` (SmolLM2 is loaded from its checkpoint): their shapes come from their published
config.json through `models.hf.config_from_hf`, as a checkpoint's would.

Tracing as a GPU run does: every backend decision of ours (the kernels' interpret default and refusals,
`cpu_upcast`, `history_attention.stored_history`) reads `jax.default_backend()` at trace time, so `as_gpu`
makes it answer "gpu" while a program is traced for export; on a GPU nothing is changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import models
from jaxrl.config import CONFIGS_DIR, EngineSection, TrainConfig, from_yaml_file
from jaxrl.config.train import AlgoSection, TrainerSection
from jaxrl.rollout import model_step
from jaxrl.rollout.executor import canonical, decode_inputs, padding_batch
from jaxrl.rollout.shapes import ShapeBuckets
from kernels import attention, paged_decode_attention
from models import ModelConfig, kv_cache_spec, logical_axes, lora
from models.hf import config_from_hf
from sharding import Layout, ShardingRules, padded_vocab_for, shardings_for

from .batch import FIELDS, INT_FIELDS
from .blockwise import BlockwiseUpdater, history_sharding
from .step import STATS, LossSpec, make_grad_step, make_logprob_fn

TRITON = "__gpu$xla.gpu.triton"          # the custom call a Pallas kernel lowers to for CUDA
PACK_LENS = (96, 1024)                   # SmolLM2's recipe; the engine's default max_seq_len
BLOCKS = ((256, 256), (256, 1024))       # (block T, buffer P): SmolLM2's 96-token rows padded to one block; 1024
PAGED_KV_HEADS = 2                       # kv heads of the kernel grid's calls (they only set its grid)

# Published config.json of the two models that are not `models.PRESETS` (the fields `config_from_hf` reads).
LLAMA_3_2_1B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                "tie_word_embeddings": True,
                "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
SMOLLM2_135M = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
                "tie_word_embeddings": True}


@dataclasses.dataclass(frozen=True)
class Program:
    """One program: `build(devices) -> (fn, args, kwargs)`, `fn` jitted, `args` abstract (with shardings on a mesh
    of the first `devices` devices); `kernels`: the Pallas kernels (pallas_call names) its lowering holds;
    `shape`: an engine step's bucket ((rows, pages) decode, (rows, width, pages) prefill), () otherwise."""

    name: str
    devices: int
    kernels: tuple[str, ...]
    build: Callable
    shape: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ModelRun:
    """A model with the engine and trainer settings of a run of it (what fixes its programs' shapes)."""

    name: str
    cfg: ModelConfig
    tps: tuple[int, ...]
    engine: EngineSection
    trainer: TrainerSection
    algo: AlgoSection
    pack_len: int
    dtype: str


def _smollm2_recipe() -> TrainConfig:
    return from_yaml_file(TrainConfig, CONFIGS_DIR / "smollm2_arith.yaml")


@functools.cache
def model_runs() -> tuple[ModelRun, ...]:
    """qwen3-0.6b and llama-3.2-1b with the engine's and trainer's defaults (rows of the default max_seq_len),
    bfloat16; SmolLM2-135M with its recipe's settings (configs/smollm2_arith.yaml), float32 as it trains."""
    engine, trainer, algo = EngineSection(), TrainerSection(), AlgoSection()
    smol = _smollm2_recipe()
    smol_pack = smol.pack_len or -(-(smol.data.max_prompt_len + smol.rollout.max_new_tokens) // 32) * 32
    return (ModelRun("qwen3-0.6b", models.PRESETS["qwen3-0.6b"], (1, 2), engine, trainer, algo, engine.max_seq_len,
                     "bfloat16"),
            ModelRun("llama-3.2-1b", config_from_hf(LLAMA_3_2_1B), (1, 2), engine, trainer, algo, engine.max_seq_len,
                     "bfloat16"),
            ModelRun("smollm2-135m", config_from_hf(SMOLLM2_135M), (1,), smol.engine, smol.trainer, smol.algo,
                     smol_pack, smol.model.dtype))


def engine_buckets(engine: EngineSection) -> ShapeBuckets:
    """The instance's bounded shape set, as `rollout.Instance` builds it from the engine section."""
    return ShapeBuckets.build(max_batch=engine.max_batch, max_seq_len=engine.max_seq_len, page_size=engine.page_size,
                              prefill_chunk=engine.prefill_chunk, prefill_tokens=engine.prefill_tokens,
                              per_octave=engine.batch_buckets_per_octave, page_buckets=engine.page_buckets)


# ------------------------------------------------------------------------------------------ tracing

@contextlib.contextmanager
def as_gpu():
    """Trace with `jax.default_backend()` answering "gpu" (module docstring); restored on exit."""
    real = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        yield
    finally:
        jax.default_backend = real


def export(program: Program, devices=None) -> jax.export.Exported:
    """`program` lowered for CUDA (StableHLO with its Triton kernels), on a CPU host or anywhere."""
    fn, args, kw = program.build(list(devices or jax.devices()))
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON)]
    with as_gpu():
        return jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(*args, **kw)


def compile_here(program: Program, devices=None):
    """`program` compiled for this process's backend (a GPU: Triton compiles the kernels); nothing runs."""
    fn, args, kw = program.build(list(devices or jax.devices()))
    return fn.lower(*args, **kw).compile()


def _sds(shape, dtype, sharding=None):
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), jnp.dtype(dtype), sharding=sharding)


# ------------------------------------------------------------------------------------------ kernels

def paged_grid() -> list[tuple[int, int]]:
    """(rows, page-table width) of the paged decode calls of one (GQA ratio, head dim): every width (the default
    buckets' and 1-8) at the largest batch bucket, and every batch bucket at the widest table."""
    b = engine_buckets(EngineSection())
    widths = sorted(set(b.pages) | set(range(1, 9)))
    return [(b.batch[-1], p) for p in widths] + [(r, b.max_pages) for r in b.batch[:-1]]


def prefill_grid() -> list[tuple[int, int, int]]:
    """(rows, chunk width, key length) of the flash forward calls of prefill: per (width, pages) of the default
    buckets' prefill shapes, the largest row count."""
    b = engine_buckets(EngineSection())
    rows: dict[tuple[int, int], int] = {}
    for r, w, p in b.prefill_shapes():
        rows[w, p] = max(r, rows.get((w, p), 0))
    return [(r, w, p * b.page_size) for (w, p), r in sorted(rows.items())]


def gqa_head_dims() -> list[tuple[int, int]]:
    """(query heads per kv head, head dim) of every preset with a GPU head dim (64 or 128) and of `model_runs`."""
    cfgs = [c for c in models.PRESETS.values() if c.head_dim in (64, 128)] + [r.cfg for r in model_runs()]
    return sorted({(c.num_heads // c.num_kv_heads, c.head_dim) for c in cfgs})


def _paged_kernel(ratio: int, head_dim: int, dtype: str, devices=None):
    grid = paged_grid()
    page_size = EngineSection().page_size
    K = PAGED_KV_HEADS
    num_pages = max(b * p for b, p in grid) + 1
    pool = _sds((num_pages, K, page_size, head_dim), dtype)

    def fn(k_pages, v_pages, calls):
        return [paged_decode_attention(q, k_pages, v_pages, table, lengths, implementation="pallas", interpret=False)
                for q, table, lengths in calls]

    calls = [(_sds((b, ratio * K, head_dim), dtype), _sds((b, p), jnp.int32), _sds((b,), jnp.int32)) for b, p in grid]
    return jax.jit(fn), (pool, pool, calls), {}


def _flash_kernel(ratio: int, head_dim: int, dtype: str, devices=None):
    K = 1

    def fwd(q, k, v, **kw):
        return attention(q, k, v, causal=True, implementation="pallas", interpret=False, **kw)

    def fwd_bwd(q, k, v, **kw):
        o, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, **kw), q, k, v)
        return o, vjp(o)

    def fn(prefill, train, blocks):
        out = [fwd(q, k, v, q_offset=off, kv_lengths=kl) for q, k, v, off, kl in prefill]
        out += [fwd_bwd(q, k, v, q_segment_ids=seg, kv_segment_ids=seg) for q, k, v, seg in train]
        out += [fwd_bwd(q, k, v, q_offset=off, q_segment_ids=qs, kv_segment_ids=ks) for q, k, v, off, qs, ks in blocks]
        return out

    def qkv(B, T, S):
        return _sds((B, T, ratio * K, head_dim), dtype), _sds((B, S, K, head_dim), dtype), _sds((B, S, K, head_dim), dtype)

    i32 = jnp.int32
    prefill = [(*qkv(r, w, s), _sds((r,), i32), _sds((r,), i32)) for r, w, s in prefill_grid()]
    train = [(*qkv(2, L, L), _sds((2, L), i32)) for L in PACK_LENS]
    blocks = [(*qkv(2, T, S), _sds((2,), i32), _sds((2, T), i32), _sds((2, S), i32)) for T, S in BLOCKS]
    return jax.jit(fn), (prefill, train, blocks), {}


PAGED_KERNEL = ("paged_decode_attention",)
FLASH_FWD = ("flash_attention_fwd",)
FLASH = ("flash_attention_fwd", "flash_attention_bwd_dq", "flash_attention_bwd_dkdv")


def kernel_programs() -> list[Program]:
    out = []
    for ratio, d in gqa_head_dims():
        out.append(Program(f"kernel/paged/g{ratio}/d{d}/bfloat16", 1, PAGED_KERNEL,
                           functools.partial(_paged_kernel, ratio, d, "bfloat16")))
        out += [Program(f"kernel/flash/g{ratio}/d{d}/{dtype}", 1, FLASH, functools.partial(_flash_kernel, ratio, d, dtype))
                for dtype in ("float32", "bfloat16")]
    return out


# -------------------------------------------------------------------------------------------- engine

def _rollout(run: ModelRun, tp: int, devices):
    """(mesh, abstract weights, abstract KV pool) of one TP-`tp` instance, as `RolloutService` places them."""
    cfg, layout = run.cfg, Layout(tp=tp)
    mesh = layout.make_mesh(devices[:tp])
    rules = ShardingRules.rollout(cfg, layout)
    vocab = padded_vocab_for(cfg, layout)
    sh = shardings_for(logical_axes(cfg, vocab_size=vocab), mesh, rules)
    weights = jax.tree.map(lambda a, s: _sds(a.shape, a.dtype, s), models.abstract(cfg, run.dtype, vocab_size=vocab), sh)
    b = engine_buckets(run.engine)
    pages = run.engine.max_batch * b.max_pages + 1     # every slot at max_seq_len, and the scratch page
    spec = kv_cache_spec(cfg, pages, run.engine.page_size, run.dtype)
    kv = _sds(spec.shape, run.dtype, shardings_for(spec, mesh, rules))
    return mesh, weights, kv


def _decode(run: ModelRun, tp: int, rows: int, pages: int, devices):
    mesh, weights, kv = _rollout(run, tp, devices)
    rep = NamedSharding(mesh, P())
    put = lambda x: _sds(np.shape(x), np.asarray(x).dtype, rep)    # noqa: E731
    prev = _sds((run.engine.max_batch,), jnp.int32, rep)
    args = decode_inputs(weights, kv, kv, prev, padding_batch(rows, pages, False), put)
    return model_step.decode_step, args, {"cfg": run.cfg, "impl": "pallas"}


def _prefill(run: ModelRun, tp: int, rows: int, width: int, pages: int, devices):
    mesh, weights, kv = _rollout(run, tp, devices)
    rep = NamedSharding(mesh, P())
    i32 = lambda *shape: _sds(shape, jnp.int32, rep)    # noqa: E731
    args = (weights, kv, kv, i32(rows, width), i32(rows), i32(rows), i32(rows, pages))
    return model_step.prefill_step, args, {"cfg": run.cfg, "impl": "pallas"}


def engine_shapes(run: ModelRun) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(decode, prefill) shape exported for `run`: the cover shapes a run starts with (`ShapeBuckets.coarse`),
    the largest batch over the widest table and the widest chunk's rows cap over it; the kernel grid has the
    other buckets."""
    b = engine_buckets(run.engine)
    return b.cover_decode_shapes()[0], b.cover_prefill_shapes()[-1]


# --------------------------------------------------------------------------------------------- train

def loss_spec(run: ModelRun) -> LossSpec:
    """The run's RL loss (its algo section's) with Pallas attention and its trainer section's remat and fused loss."""
    trainer = dataclasses.replace(run.trainer, attention_impl="pallas")
    return LossSpec.from_config(run.algo, temperature=1.0, trainer=trainer)


def _train(run: ModelRun, tp: int, devices, rows_len: int | None = None):
    """(mesh, abstract params, abstract micro-batch, accumulator) on a TP-`tp` train mesh, as the trainer
    places them (`micro_batch_abstract`, `update.zero_sums`)."""
    cfg, layout = run.cfg, Layout(tp=tp)
    mesh = layout.make_mesh(devices[:tp])
    vocab = padded_vocab_for(cfg, layout)
    sh = shardings_for(logical_axes(cfg, vocab_size=vocab), mesh, ShardingRules.train(cfg, layout))
    params = jax.tree.map(lambda a, s: _sds(a.shape, a.dtype, s), models.abstract(cfg, run.dtype, vocab_size=vocab), sh)
    rows = max(1, run.trainer.micro_batch_tokens // run.pack_len)
    length = rows_len or run.pack_len
    mb_sh = NamedSharding(mesh, P(("dp", "fsdp"), None))
    spec = loss_spec(run)
    keys = list(FIELDS) + ["ref_logp"] * bool(spec.kl_coef)
    mb = {k: _sds((rows, length), jnp.int32 if k in INT_FIELDS else jnp.float32, mb_sh) for k in keys}
    trainable = lora.split(params)[0]
    acc = (jax.tree.map(lambda p: _sds(p.shape, p.dtype, canonical(p.sharding)), trainable),
           {k: _sds((), jnp.float32, NamedSharding(mesh, P())) for k in STATS})
    return mesh, params, mb, acc


def _logprobs(run: ModelRun, tp: int, devices):
    _, params, mb, _ = _train(run, tp, devices)
    return make_logprob_fn(run.cfg, loss_spec(run)), (params, {k: mb[k] for k in FIELDS}), {}


def _grad(run: ModelRun, tp: int, devices):
    _, params, mb, acc = _train(run, tp, devices)
    return make_grad_step(run.cfg, loss_spec(run)), (params, mb, acc), {}


def _blockwise_updater(run: ModelRun) -> BlockwiseUpdater:
    # (the optimizer only enters `apply`, which is not exported)
    return BlockwiseUpdater(run.cfg, loss_spec(run), optax.identity(), block_size=run.trainer.block_size)


def _blockwise_kv(run: ModelRun, tp: int, devices):
    up = _blockwise_updater(run)
    _, params, mb, _ = _train(run, tp, devices, up.padded_len(run.pack_len))
    return up.kv_fn, (params, mb), {"sharding": history_sharding(mb["tokens"].sharding)}


def _blockwise_block(run: ModelRun, tp: int, devices):
    up = _blockwise_updater(run)
    _, params, mb, acc = _train(run, tp, devices, up.padded_len(run.pack_len))
    at = history_sharding(mb["tokens"].sharding)
    cfg, (R, length) = run.cfg, mb["tokens"].shape
    hist = _sds((cfg.num_layers, R, length, cfg.num_kv_heads, cfg.head_dim), run.dtype, at)   # a GPU's stored form
    grad = _sds(hist.shape, jnp.float32, at)
    return up.step_fn, (params, mb, hist, hist, grad, grad, acc, _sds((), jnp.int32)), {"sharding": at}


def step_programs() -> list[Program]:
    out = []
    for run in model_runs():
        (r, p), (pr, w, pp) = engine_shapes(run)
        for tp in run.tps:
            at = f"{run.name}/tp{tp}"
            out += [Program(f"engine/decode/{at}/b{r}xp{p}", tp, PAGED_KERNEL, functools.partial(_decode, run, tp, r, p),
                            (r, p)),
                    Program(f"engine/prefill/{at}/r{pr}xw{w}xp{pp}", tp, FLASH_FWD,
                            functools.partial(_prefill, run, tp, pr, w, pp), (pr, w, pp))]
            out += [Program(f"train/{kind}/{at}", tp, kernels, functools.partial(make, run, tp))
                    for kind, make, kernels in (("logprobs", _logprobs, FLASH_FWD), ("grad", _grad, FLASH),
                                                ("blockwise_kv", _blockwise_kv, FLASH_FWD),
                                                ("blockwise_block", _blockwise_block, FLASH))]
    return out


def programs() -> list[Program]:
    """Every program of the list: the kernel grid, then the steps."""
    return kernel_programs() + step_programs()
