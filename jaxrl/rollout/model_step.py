"""Prefill and decode steps over a paged KV cache, built on `models.decoder_stack` (the one decoder layer).

Cache layout (one instance): `k_pages`, `v_pages` [layers, num_pages, kv_heads, page_size, head_dim]:
head-major inside a page, so each kv head's keys of a sequence are contiguous once its pages are
gathered, and decode attention runs as batched matrix-vector products with no transpose.
Page 0 is a scratch page: padding rows of a batch bucket write there and read nothing, so buckets
need no special-casing inside the compiled step.

Both steps sample on the device (`sampling.sample`) and return only the sampled tokens and their
log-probs, so no [batch, vocab] logits cross to the host. They are jitted with the cache donated and
their static arguments keyword-only; `executor.ExecutableCache` compiles them ahead of time per
(instance layout, batch bucket, shapes).
Attention: prefill chunks use `kernels.attention` with `q_offset` over the gathered pages; decode
uses `kernels.paged_decode_attention` (its XLA path gathers the pages; its Pallas kernel, for GPU,
reads the pool in place).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels import attention, normalize, paged_decode_attention
from kernels.attention import cpu_upcast
from kernels.paged_attention import gather_pages
from models import ModelConfig, decoder_stack, lm_head

from .sampling import SamplingBatch, sample


def _gather_pages(pages, layer, page_table):
    """[B, max_pages] page ids -> contiguous keys [B, max_pages * page_size, K, D] of one layer."""
    return gather_pages(pages[layer], page_table).swapaxes(1, 2)


def _logits(weights, h, vocab_size: int):
    """float32 logits [B, V'] over the weights' (possibly padded) vocabulary V' >= vocab_size. Padded
    columns are float32's lowest finite value, so `sampling.sample` never picks them: they are never the
    argmax, and exp(x - max) puts them below its -80 cut-off (exactly zero weight; at temperature < 1 they
    become -inf, which the cut-off also zeroes), and they add nothing to the log-partition."""
    logits = jnp.einsum("be,ev->bv", *cpu_upcast(h, lm_head(weights)), preferred_element_type=jnp.float32)
    if logits.shape[-1] == vocab_size:
        return logits
    real = jnp.arange(logits.shape[-1], dtype=jnp.int32) < vocab_size
    return jnp.where(real[None, :], logits, jnp.finfo(jnp.float32).min)


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("k_pages", "v_pages"))
def prefill_step(weights, k_pages, v_pages, tokens, start, n_valid, page_table, *, cfg: ModelConfig,
                 impl: str = "xla"):
    """Process one chunk of C prompt tokens for each of B sequences.

    tokens [B, C] (row b holds positions start[b] .. start[b]+C-1, the first n_valid[b] real);
    page_table [B, MP]. Writes the chunk's K/V into the pages, attends causally over everything
    before it (`q_offset=start`), and samples from the last real token's logits (used only when the
    chunk ends the prompt). Returns (tokens [B], logprobs [B], k_pages, v_pages).
    """
    B, C = tokens.shape
    ps = k_pages.shape[3]
    pos = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None, :]            # [B, C]
    real = jnp.arange(C)[None, :] < n_valid[:, None]
    page = jnp.where(real, jnp.take_along_axis(page_table, pos // ps, axis=1, mode="clip"), 0)
    slot = jnp.where(real, pos % ps, 0)
    kv_len = start + n_valid

    def attend(l, q, k, v, pages, _):
        k_pages, v_pages = pages
        k_pages = k_pages.at[l, page, :, slot].set(k.astype(k_pages.dtype))
        v_pages = v_pages.at[l, page, :, slot].set(v.astype(v_pages.dtype))
        kk, vv = _gather_pages(k_pages, l, page_table), _gather_pages(v_pages, l, page_table)
        o = attention(q, kk, vv, q_offset=start, kv_lengths=kv_len, causal=True, window=cfg.sliding_window,
                      implementation=impl)
        return o, (k_pages, v_pages), None

    _, (k_pages, v_pages), _ = decoder_stack(weights, cfg, weights.embed[tokens], pos, attend,
                                             carry=(k_pages, v_pages))
    return k_pages, v_pages


@functools.partial(jax.tree_util.register_dataclass, data_fields=["packed"], meta_fields=["truncate"])
@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """A decode step's per-row host inputs packed into one int32 array [B, 8 + MP]: the columns `COLUMNS`
    (float32 and uint32 ones by their bits), then the page table. One host-to-device transfer a step instead
    of nine: each costs ~0.1 ms of host time, about half of a batch-1 step of the tiny model on the CPU
    (tests/test_sampling.py checks the round trip). `truncate` is static, as in `SamplingBatch`."""

    packed: jax.Array
    truncate: bool = False

    COLUMNS = ("src", "tokens", "positions", "top_k", "step", "seed", "temperature", "top_p")

    @staticmethod
    def pack(src, tokens, positions, table, sb: SamplingBatch) -> "DecodeInputs":
        """Host arrays ([B] each, table [B, MP]) and a host `SamplingBatch` -> numpy-packed inputs."""
        cols = [src, tokens, positions, sb.top_k, sb.step, np.asarray(sb.seed, np.uint32).view(np.int32),
                np.asarray(sb.temperature, np.float32).view(np.int32), np.asarray(sb.top_p, np.float32).view(np.int32)]
        packed = np.concatenate([np.stack(cols, axis=1).astype(np.int32, copy=False), table], axis=1)
        return DecodeInputs(packed, sb.truncate)

    def unpack(self):
        """(src, tokens, positions, page_table, SamplingBatch), inside the compiled step."""
        c = {name: self.packed[:, i] for i, name in enumerate(self.COLUMNS)}
        bits = lambda x, dt: jax.lax.bitcast_convert_type(x, dt)  # noqa: E731
        sb = SamplingBatch(temperature=bits(c["temperature"], jnp.float32), top_k=c["top_k"],
                           top_p=bits(c["top_p"], jnp.float32), seed=bits(c["seed"], jnp.uint32), step=c["step"],
                           truncate=self.truncate)
        return c["src"], c["tokens"], c["positions"], self.packed[:, len(self.COLUMNS):], sb


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("k_pages", "v_pages"))
def decode_step(weights, k_pages, v_pages, prev_tokens, inputs: DecodeInputs, *, cfg: ModelConfig,
                impl: str = "xla"):
    """One token for each of B sequences at positions [B]; page table [B, MP] (both in `inputs`).
    Input tokens: row i takes `prev_tokens[src[i]]` (the previous step's output, still on the device:
    overlapped steps) where src[i] >= 0, else `tokens[i]` (known on the host). `prev_tokens` has a fixed
    length M >= B (the instance's max_batch) and so does the returned token vector (rows >= B are 0), so
    one executable per (B, MP) serves whatever bucket the previous step had.
    Padding rows point their page table at the scratch page 0. `impl` picks `paged_decode_attention`'s
    implementation: "xla" (the CPU default) or "pallas" (GPU; interpret mode on the CPU). Returns
    (tokens [M], logprobs [B], k_pages, v_pages).
    """
    src, tokens, positions, page_table, sampling = inputs.unpack()
    B = tokens.shape[0]
    prev = prev_tokens[jnp.clip(src, 0, prev_tokens.shape[0] - 1)]
    tokens = jnp.where(src >= 0, prev, tokens)
    ps = k_pages.shape[3]
    page = jnp.take_along_axis(page_table, (positions // ps)[:, None], axis=1)[:, 0]
    slot = positions % ps

    def attend(l, q, k, v, pages, _):
        k_pages, v_pages = pages
        k_pages = k_pages.at[l, page, :, slot].set(k[:, 0].astype(k_pages.dtype))
        v_pages = v_pages.at[l, page, :, slot].set(v[:, 0].astype(v_pages.dtype))
        o, lse_l, _ = paged_decode_attention(q[:, 0], k_pages[l], v_pages[l], page_table, positions + 1,
                                             window=cfg.sliding_window, implementation=impl)
        return normalize(o, lse_l, dtype=q.dtype)[:, None], (k_pages, v_pages), None

    h, (k_pages, v_pages), _ = decoder_stack(weights, cfg, weights.embed[tokens[:, None]], positions[:, None],
                                             attend, carry=(k_pages, v_pages))
    tok, logp = sample(_logits(weights, h[:, 0], cfg.vocab_size), sampling)
    return jnp.zeros_like(prev_tokens).at[:B].set(tok), logp, k_pages, v_pages

