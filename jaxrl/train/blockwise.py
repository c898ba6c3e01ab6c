"""MetroRLHF's blockwise backward (paper 004, §3.1 Algorithm 1, §3.2): each micro-batch's RL gradient computed
block by block, from the last block of its rows to the first, with the earlier positions' K/V taken from a
cache, so activations are held for one block of T tokens instead of the whole row. The gradient is that of
full-sequence training (tests/test_blockwise.py).

For one fixed-shape micro-batch of R packed rows x P tokens (P padded up to a multiple of T), every row's
block i (tokens [iT, (i+1)T)) is processed together ("batched over sequences that share a block index"):

    C = K/V of every layer at every position          [L, R, P, K, D]   the cache (`kv_source`)
    ∇C = 0                                            [L, R, P, K, D]   history-gradient accumulator (float32)
    for i in plan (last block first, Algorithm 1 lines 7-20):
        (loss_i, K_i, V_i), vjp = jax.vjp(block_forward_i, θ, C)
        g_θ, g_C = vjp(1 for loss_i, ∇C[:, :, iT:(i+1)T] for the block's own K_i, V_i)
        ∇C += g_C;  grads += g_θ;  stats += the block's stats
    one `apply_update` (normalise once, clip, optax) after the micro-batches (`grad_step`'s contract)

`block_forward_i` runs the one decoder layer (`models.decoder_stack`) on the block's tokens with RoPE at
their absolute positions (the packed rows' restarted positions), and in every layer writes the block's
fresh K/V into the cache buffer at iT (`dynamic_update_slice`) and attends with queries at offset iT
(`kernels.attention`: causal, the model's sliding window, the rows' segment ids), so keys are
[history from C; the block's own; later positions masked]. The history is a fixed-size buffer masked by
position, so one compiled block step serves every block (the start is a traced scalar); it donates ∇C and
the gradient/stats accumulators. The gradient reaching the cached history (positions < iT; the
overwritten and the masked positions get exactly zero) is added into ∇C in place, layer by layer, inside
the backward (`history_attention`: no per-layer copy of C, no stacked history cotangent; written as
`∇C += g_C` above). The loss of a block is
`step.hidden_loss` on the block's hidden states (the fused or chunked log-prob path, every RL loss, KL
to the reference and the entropy bonus: all per-token terms, so block sums add up).

KV source (`trainer.kv_source`):
  "recompute"  one forward-only pass per micro-batch that keeps each layer's K/V and nothing else
               (`recompute_kv`); the blockwise step then reuses them.
  "rollout"    the K/V the rollout engine computed while generating (exported on the devices,
               `jaxrl.train.rollout_kv`); valid on-policy only (one update per rollout batch).

Zero-reward shortcut (§3.2, Algorithm 1 lines 5, 9, 18): a block runs iff it holds a loss token or lies in
the receptive field of a later one; the others' vjp is exactly zero, so skipping them changes nothing.
Blocks are visited last first with L_ctx = +inf; block i runs iff it has loss tokens or (i + 1)T > L_ctx,
and a block with loss tokens starting at iT sets L_ctx = min(L_ctx, iT - L·(W - 1)) (L layers, window W;
no window: -inf). Why L·(W - 1): a query at q sees keys q - W + 1 .. q (HF's q - s < W), so after L windowed
layers the loss at q depends on positions q - L·(W - 1) .. q and on nothing earlier.

That differs from the paper's Algorithm 1 in two ways, both measured in tests/test_blockwise.py:
  - the paper sets L_ctx = shift - W after *every* processed block, so once a block runs every earlier one
    does ((i)T > iT - W): exact, but the shortcut then only ever skips trailing loss-free blocks;
  - its reach W is one layer's: for L > 1 the prompt positions between L·(W - 1) and W before an answer
    still carry gradient, and skipping them (what a loss-driven L_ctx = shift - W does) changes the
    gradient (the negative-control test). The quoted saving ((Ctx + min(2T, Ctx)) / (2 Ctx) at W = 1024)
    needs that inexact reach; with the exact one a model of L layers skips prompt blocks more than
    L·(W - 1) positions before the first answer token (for Qwen3-32B's 64 layers at W = 1024, 65K).
With W = 1 only blocks with loss tokens run; without a window, every block up to the last one with loss tokens.

Attention over the buffer: with `attention_impl="xla"` the block's queries run in (query, key) chunk
pairs of PAIR_BLOCK, the pairs after the block (or before the window) skipped at run time by `lax.cond`,
with a flash backward that keeps no probability tiles (`kernels.attention_pairs`): a row's blocks
together do about the full step's causal work, not the ~2x that attending to the whole masked P-key
buffer costs; the Pallas kernel skips the same key blocks from the traced offset on GPU.

Simplified / left out (said, not pretended done): the plan is per block index over all rows of a micro-batch (a row without loss tokens in block i still
runs when another row has them); the reference and old-policy log-probs are computed by the ordinary
forward (`Updater.logprobs`), not blockwise.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl.rollout.executor import abstract, canonical, out_abstract
from kernels import attention
from models import ModelConfig, decoder_stack, lora

from .batch import FIELDS
from .distributed import allgather
from .history_attention import Attn, history_attention, stored_history
from .step import LossSpec, hidden_loss
from .update import ZERO_SUMS, Updater, sums_shardings

from jaxrl.config.train import BACKWARDS, KV_SOURCES  # noqa: E402,F401  (re-exported)

PAIR_BLOCK = 512    # query and key chunk of the XLA block attention (`kernels.attention_pairs`)


# ------------------------------------------------------------------------------------------- the plan

def plan_blocks(has_loss, block: int, window: int | None, layers: int) -> list[int]:
    """Block indices to process, last first (Algorithm 1 with the zero-reward shortcut; module docstring).
    `has_loss[i]`: block i holds a loss token in some row; `layers`: the model's layer count (the reach of
    the gradient is layers · (window - 1) positions)."""
    run, ctx = [], math.inf
    for i in reversed(range(len(has_loss))):
        if has_loss[i] or (i + 1) * block > ctx:
            run.append(i)
            if has_loss[i]:
                ctx = min(ctx, -math.inf if window is None else i * block - layers * (window - 1))
    return run


def blocks_with_loss(loss_mask, block: int) -> np.ndarray:
    """[n_blocks] bool: which blocks hold a loss token in any row, over every process's rows (the plan
    must be the same in every process: they all run the same program). A micro-batch on this process's own
    devices (the stream trainer's, several processes) is planned alone: no other process runs it."""
    P = loss_mask.shape[1]
    n = -(-P // block)
    local = np.zeros(n, bool)
    for shard in loss_mask.addressable_shards:
        m = np.asarray(shard.data).astype(bool)
        cols = range(P)[shard.index[1]] if shard.index[1] != slice(None) else range(P)
        start = cols[0] if len(cols) else 0
        for i in range(n):
            lo, hi = max(i * block - start, 0), max((i + 1) * block - start, 0)
            local[i] |= bool(m[:, lo:hi].any())
    if jax.process_count() > 1 and not loss_mask.is_fully_addressable:   # (the update's own stream of agreements:
                                                                          # it may run on the train pool's thread)
        local = allgather(local, tag="update").any(axis=0)
    return local


# ------------------------------------------------------------------------------------- device steps

def _constrain(x, sharding):
    return x if sharding is None else lax.with_sharding_constraint(x, sharding)


def history_sharding(rows_sharding):
    """Where the cache C and the accumulator ∇C [L, R, P, K, D] live: their rows on the micro-batch's row
    axes (the train mesh's data axes), the rest replicated, as `rollout_kv.KVStager` gathers them. None
    (left to XLA) for a micro-batch that is not on a mesh (one device)."""
    if not isinstance(rows_sharding, NamedSharding):
        return None
    rows = rows_sharding.spec[0] if len(rows_sharding.spec) else None
    return canonical(NamedSharding(rows_sharding.mesh, P(None, rows)))


def _pad_rows(mb, *, length: int):
    """Every [R, P] field padded with zeros to [R, length] (segment 0 and loss mask 0: inert padding)."""
    return {k: jnp.pad(v, ((0, 0), (0, length - v.shape[1]))) for k, v in mb.items()}


def recompute_kv(params, mb, *, cfg: ModelConfig, spec: LossSpec, stored: bool = False, sharding=None):
    """K, V [L, R, P, K, D] of every layer for the micro-batch's rows (a forward pass that keeps only them);
    `stored`: in the form the block step takes them (`history_attention.stored_history`); `sharding`: where
    they are put (`history_sharding`; None: where XLA propagates them)."""
    seg = mb["segment_ids"]

    def attend(l, q, k, v, carry, xs_l):
        o = attention(q, k, v, causal=True, window=cfg.sliding_window, q_segment_ids=seg, kv_segment_ids=seg,
                      implementation=spec.attention_impl)
        return o, carry, (k, v)

    _, _, (k, v) = decoder_stack(params, cfg, params.embed[mb["tokens"]], mb["positions"], attend)
    kv = stored_history((k, v)) if stored else (k, v)
    return tuple(_constrain(x, sharding) for x in kv)


def _store(kv, *, sharding=None):
    return tuple(_constrain(x, sharding) for x in stored_history(kv))


def _zeros_like_kv(hist_k, *, sharding=None):
    """∇C = 0 in float32, in the cache's sharding (a constant has no input to take one from: left to XLA it
    lands on one device, which a sharded train mesh then refuses)."""
    z = _constrain(jnp.zeros(hist_k.shape, jnp.float32), sharding)
    return z, z


def block_step(params, mb, hist_k, hist_v, grad_k, grad_v, acc, start, *, cfg: ModelConfig, spec: LossSpec,
               block: int, sharding=None):
    """One block (rows' tokens [start, start + block)): its loss's vjp, with the history gradient added into
    ∇C = (grad_k, grad_v) in place and ∇C[block] as the cotangent of the block's own K/V
    (`history_attention`); returns (∇C_k, ∇C_v, (grad_sums, stats_sums)) with this block's contributions added.
    `sharding`: ∇C's (`history_sharding`), kept on the way out so that the donated buffers are reused and
    the step's outputs feed it again unchanged."""
    cut = lambda x: lax.dynamic_slice_in_dim(x, start, block, axis=1)     # noqa: E731
    blk = {k: cut(v) for k, v in mb.items()}
    a = Attn(spec.attention_impl, cfg.sliding_window, PAIR_BLOCK)

    trainable, frozen = lora.split(params)       # differentiate the trainable leaves only (LoRA: the adapters)

    def forward(trainable, gk, gv):
        params = lora.join(trainable, frozen)

        def attend(l, q, k, v, carry, xs_l):
            o, gk, gv = history_attention(a, q, k, v, *carry, *xs_l, l, start, blk["segment_ids"],
                                          mb["segment_ids"])
            return o, (gk, gv), (k, v)

        h, g, kv = decoder_stack(params, cfg, params.embed[blk["tokens"]], blk["positions"], attend,
                                carry=(gk, gv), xs=(hist_k, hist_v), remat=spec.remat)
        loss, sums = hidden_loss(params, cfg, spec, h, blk)
        return (loss, g, kv), sums

    own = lambda g: lax.dynamic_slice_in_dim(g, start, block, axis=2)     # noqa: E731  ∇C[block], read first
    own_k, own_v = own(grad_k), own(grad_v)
    (loss, g, (kb, vb)), vjp, sums = jax.vjp(forward, trainable, grad_k, grad_v, has_aux=True)
    # ∇C's cotangent in = ∇C itself: out comes ∇C with every layer's history gradient added in place
    g_params, grad_k, grad_v = vjp((jnp.ones_like(loss), g, (own_k.astype(kb.dtype), own_v.astype(vb.dtype))))
    grads, stats = acc
    acc = (jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads, g_params), jax.tree.map(jnp.add, stats, sums))
    return _constrain(grad_k, sharding), _constrain(grad_v, sharding), acc


# ---------------------------------------------------------------------------------------- the updater

class BlockwiseUpdater(Updater):
    """`Updater` whose gradient sums come from `block_step` over each micro-batch (module docstring).

    update(params, opt_state, mbs, denominator=1.0, kv=None) -> (params, opt_state, metrics); `kv` is one
    (K, V) [L, R, P, K, D] per micro-batch for kv_source="rollout" (None: recomputed). After an update,
    `last` holds the blockwise metrics of it: blocks run and skipped. `accumulate` is the gradient-only
    entry point (one micro-batch's sums; streamed and disaggregated updates), `counts` the blocks since
    `reset_counts`."""

    def __init__(self, cfg: ModelConfig, spec: LossSpec, tx, *, block_size: int, kv_source: str = "recompute",
                 **kw):
        super().__init__(cfg, spec, tx, **kw)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int; got {block_size!r}")
        if kv_source not in KV_SOURCES:
            raise ValueError(f"kv_source={kv_source!r}; valid choices: {', '.join(KV_SOURCES)}")
        self.cfg, self.block, self.kv_source = cfg, block_size, kv_source
        # every buffer is placed explicitly (`history_sharding`, `update.sums_shardings`): on a sharded train mesh
        # a constant left to XLA lands on one device
        self.kv_fn = jax.jit(functools.partial(recompute_kv, cfg=cfg, spec=spec, stored=True),
                             static_argnames=("sharding",))
        self.store = jax.jit(_store, static_argnames=("sharding",))
        self.step_fn = jax.jit(functools.partial(block_step, cfg=cfg, spec=spec, block=block_size),
                               donate_argnums=(4, 5, 6), static_argnames=("sharding",))
        self.zero_kv = jax.jit(_zeros_like_kv, static_argnames=("sharding",))
        self.pad = jax.jit(_pad_rows, static_argnames=("length",))
        self.last = {"blocks": 0, "skipped": 0}         # of the last `gradients` call
        self.reset_counts()                             # since the step began (`counts`)

    def padded_len(self, P: int) -> int:
        return -(-P // self.block) * self.block

    def _prepare(self, mb):
        P = self.padded_len(mb["tokens"].shape[1])
        return mb if P == mb["tokens"].shape[1] else self.cache("pad", self.pad, mb, length=P)

    def update(self, params, opt_state, mbs: list[dict], denominator: float = 1.0, kv=None):
        grads, stats = self.gradients(params, mbs, kv)
        return self.cache("apply", self.apply, params, opt_state, grads, float(denominator), stats)

    def gradients(self, params, mbs: list[dict], kv=None):
        """(grad_sums, stats_sums) over the micro-batches: `grad_step`'s contract, computed blockwise; `last`
        holds this call's block counts."""
        if kv is None and self.kv_source == "rollout":
            raise ValueError("kv_source='rollout' needs the rollout's K/V for every micro-batch")
        self.last = {"blocks": 0, "skipped": 0}
        acc = None
        for j, mb in enumerate(mbs):
            acc = self.accumulate(params, mb, acc, None if kv is None else kv[j])
        return acc

    def accumulate(self, params, raw: dict, acc=None, kv=None):
        """One micro-batch's gradient sums, block by block, added to `acc` (None: fresh sums in the weights'
        shardings): the gradient-only entry point (`Updater.accumulate`) of streamed, disaggregated and
        asynchronous updates. `kv`: this micro-batch's rollout (K, V) (kv_source="rollout")."""
        if kv is None and self.kv_source == "rollout":
            raise ValueError("kv_source='rollout' needs the rollout's K/V for every micro-batch")
        if acc is None:
            acc = self.cache("zeros", ZERO_SUMS, params, **sums_shardings(params))
        plan = plan_blocks(blocks_with_loss(raw["loss_mask"], self.block), self.block, self.cfg.sliding_window,
                           self.cfg.num_layers)
        n = -(-raw["tokens"].shape[1] // self.block)
        for c in (self.last, self._counts):
            c["blocks"], c["skipped"] = c["blocks"] + len(plan), c["skipped"] + n - len(plan)
        if not plan:
            return acc
        # One micro-batch's programs at a time: the next one's K/V pass depends only on the weights, so without
        # this wait it runs beside the current block chain, two programs with all-gathers in flight at once.
        # On XLA:CPU each device's part of a program holds a pool thread while it waits in a collective, and
        # with the next rollout busy beside the update (one-step-async, fsdp=2) a part found no thread: 3 of 3
        # runs deadlocked in an all-gather by their 4th step; with the wait, 8 of 8 steps ran. One host sync
        # per micro-batch (blocks_with_loss above already reads its mask).
        jax.block_until_ready(acc)
        mb = self._prepare(raw)
        at = history_sharding(raw["tokens"].sharding)
        hk, hv = (self.cache("kv", self.kv_fn, params, mb, sharding=at) if kv is None
                  else self.cache("store", self.store, kv, sharding=at))
        gk, gv = self.cache("zero_kv", self.zero_kv, hk, sharding=at)
        for i in plan:
            gk, gv, acc = self.cache("block", self.step_fn, params, mb, hk, hv, gk, gv, acc, np.int32(i * self.block),
                                     sharding=at)
        return acc

    def reset_counts(self):
        self._counts = {"blocks": 0, "skipped": 0}

    def counts(self) -> dict:
        return {"blockwise/blocks": self._counts["blocks"], "blockwise/skipped": self._counts["skipped"]}

    def warm_accumulate(self, params, mb: dict, kv=None):
        """Compile every executable `accumulate` runs for these (abstract) params and micro-batch (`kv`: the
        abstract rollout (K, V)), following the block step's outputs until they repeat; nothing runs.
        Returns the abstract sums."""
        p, mb = abstract(params), abstract(mb)
        at = history_sharding(mb["tokens"].sharding)
        P = self.padded_len(mb["tokens"].shape[1])
        if P != mb["tokens"].shape[1]:
            mb = out_abstract(self.cache.compile("pad", self.pad, mb, length=P))
        acc = out_abstract(self.cache.compile("zeros", ZERO_SUMS, p, **sums_shardings(p)))
        hk, hv = (out_abstract(self.cache.compile("store", self.store, abstract(kv), sharding=at))
                  if kv is not None else out_abstract(self.cache.compile("kv", self.kv_fn, p, mb, sharding=at)))
        gk, gv = out_abstract(self.cache.compile("zero_kv", self.zero_kv, hk, sharding=at))
        start = np.int32(0)
        for _ in range(3):      # the step's outputs feed it again: follow them until they repeat
            out = out_abstract(self.cache.compile("block", self.step_fn, p, mb, hk, hv, gk, gv, acc, start,
                                                   sharding=at))
            if self.cache.key("x", out) == self.cache.key("x", (gk, gv, acc)):
                break
            gk, gv, acc = out
        return acc

    def warm(self, params, opt_state, mb: dict, logp_params=(), kv=None, own_logp: bool = True) -> int:
        """Compile every executable `update`/`logprobs` runs on micro-batches shaped like `mb` (arrays or
        ShapeDtypeStructs with shardings), following output shardings to a fixed point; nothing runs.
        `kv`: abstract (K, V) of the rollout's cache (kv_source="rollout"). Returns new compilations."""
        before = self.cache.compiles
        p, o, mb = abstract(params), abstract(opt_state), abstract(mb)
        logp_mb = {k: mb[k] for k in FIELDS}
        for extra in logp_params:
            self.cache.compile("logp", self.logp, abstract(extra), logp_mb)
        for _ in range(3):
            if own_logp:
                self.cache.compile("logp", self.logp, p, logp_mb)
            acc = self.warm_accumulate(p, mb, kv)
            new_p, new_o, _ = out_abstract(self.cache.compile("apply", self.apply, p, o, acc[0], 1.0, acc[1]))
            if self.cache.key("x", (new_p, new_o)) == self.cache.key("x", (p, o)):
                break
            p, o = new_p, new_o
        return self.cache.compiles - before
