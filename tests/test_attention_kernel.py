"""Pallas flash attention (interpret mode on the CPU) against `attention_reference`: forward and jax.grad.

Every case runs the kernel with 16-wide tiles, so T and S (never multiples of 16 here) span several
padded blocks. The GPU lowering is checked by exporting the same functions for CUDA (Pallas -> Triton IR).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.attention import BlockSizes, attention, attention_reference

from kernels.testing.attention_cases import ATOL, BLOCKS, CASES, Case, make_inputs  # noqa: F401 (shared with scripts/)


def run(c: Case, implementation: str, args, cot, kw):
    """Output and the gradient of sum(out * cot) w.r.t. q, k, v (one jitted forward + VJP)."""
    extra = dict(implementation="pallas", interpret=True, block_sizes=c.blocks) if implementation == "pallas" else {}

    def fwd(q, k, v):
        if implementation == "reference":
            return attention_reference(q, k, v, **kw)
        return attention(q, k, v, **kw, **extra)

    def out_and_grads(q, k, v):  # jax.grad of sum(out * cot), sharing one forward with the output
        out, vjp = jax.vjp(fwd, q, k, v)
        return out, vjp(cot)

    return jax.jit(out_and_grads)(*args)


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_grads_match_reference_f32(name):
    c = CASES[name]
    args, cot, kw = make_inputs(c, jnp.float32)
    out, grads = run(c, "pallas", args, cot, kw)
    ref_out, ref_grads = run(c, "reference", args, cot, kw)
    tol = ATOL[jnp.float32]
    np.testing.assert_allclose(out, ref_out, atol=tol["fwd"], rtol=0, err_msg=f"{name}: forward")
    for what, g, rg in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, rg, atol=tol["grad"], rtol=0, err_msg=f"{name}: d{what}")
    assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)
    if name == "prefill_chunk_gqa4":  # the history keys (before q_offset) receive gradient
        assert np.abs(grads[1][:, : c.q_offset]).max() > 1e-2 and np.abs(grads[2][:, : c.q_offset]).max() > 1e-2
    if name == "empty_rows":  # batch 1 has no visible key at all: zeros out, zero gradient
        assert np.all(out[1] == 0) and np.all(grads[0][1] == 0) and np.all(grads[1][1] == 0)


@pytest.mark.parametrize("name", ["prefill_ragged_offsets", "train_gqa2_packed"])
def test_forward_matches_reference_bf16(name):
    c = CASES[name]
    args, cot, kw = make_inputs(c, jnp.bfloat16)
    pallas = lambda *a: attention(*a, **kw, implementation="pallas", interpret=True, block_sizes=c.blocks)  # noqa: E731
    out = jax.jit(pallas)(*args)
    ref = attention_reference(*args, **kw)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=ATOL[jnp.bfloat16]["fwd"], rtol=0)


def test_default_implementation_is_xla_reference():
    c = CASES["prefill_ragged_offsets"]     # T <= block_q_xla: one chunk, the reference itself
    args, _, kw = make_inputs(c, jnp.float32)
    np.testing.assert_array_equal(attention(*args, **kw), attention_reference(*args, **kw))


@pytest.mark.parametrize("name", sorted(CASES))
def test_xla_query_chunks_match_reference_f32(name):
    """The "xla" path in 16-row query chunks (each over only the keys its causal/window bounds reach)
    against the full masked square: forward and gradients, including empty chunks and history keys."""
    c = CASES[name]
    args, cot, kw = make_inputs(c, jnp.float32)
    chunked = lambda q, k, v: attention(q, k, v, **kw, block_sizes=BlockSizes(block_q_xla=16))  # noqa: E731

    def out_and_grads(fwd):
        out, vjp = jax.vjp(fwd, *args)
        return out, vjp(cot)

    out, grads = jax.jit(lambda *a: out_and_grads(chunked))()
    ref_out, ref_grads = jax.jit(lambda *a: out_and_grads(lambda q, k, v: attention_reference(q, k, v, **kw)))()
    tol = ATOL[jnp.float32]
    np.testing.assert_allclose(out, ref_out, atol=tol["fwd"], rtol=0, err_msg=f"{name}: forward")
    for what, g, rg in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, rg, atol=tol["grad"], rtol=0, err_msg=f"{name}: d{what}")


def test_xla_query_chunks_skip_masked_keys():
    """Causal rows of 64 in chunks of 16 compute 16·(16+32+48+64) = 2560 of the 4096 scores per head (0.625),
    and a window of 8 a band of 16·(16+23+23+23) = 1360 (0.53 of causal): the compiled program's FLOPs
    (dots and the elementwise softmax) shrink accordingly, so the skipping is real."""
    q = jnp.ones((1, 64, 2, 16))
    k = v = jnp.ones((1, 64, 1, 16))

    def flops(**kw):
        fn = jax.jit(lambda q, k, v: attention(q, k, v, **kw))
        return fn.lower(q, k, v).compile().cost_analysis()["flops"]

    full = flops(block_sizes=BlockSizes(block_q_xla=64))
    causal = flops(block_sizes=BlockSizes(block_q_xla=16))
    band = flops(window=8, block_sizes=BlockSizes(block_q_xla=16))
    assert causal < 0.7 * full and band < 0.6 * causal


@pytest.mark.parametrize("dtype,window,segments,causal",
                         [(jnp.bfloat16, 64, True, True), (jnp.float32, None, False, False)])
def test_pallas_lowers_to_triton_for_cuda(monkeypatch, dtype, window, segments, causal):
    """Forward and both backward kernels lower through Pallas' Triton path (GQA 5, D=80 padded, T,S ragged)."""
    B, T, S, H, K, D = 2, 100, 300, 10, 2, 80
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the CUDA lowering is cross-platform

    def f(q, k, v, offset, kv_len, q_seg, kv_seg):
        seg = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg) if segments else {}
        def fn(q, k, v):
            return attention(q, k, v, q_offset=offset, kv_lengths=kv_len, window=window, causal=causal,
                             implementation="pallas", interpret=False, **seg)

        o, vjp = jax.vjp(fn, q, k, v)
        return o, vjp(o)

    sds = jax.ShapeDtypeStruct
    args = (sds((B, T, H, D), dtype), sds((B, S, K, D), dtype), sds((B, S, K, D), dtype), sds((B,), jnp.int32),
            sds((B,), jnp.int32), sds((B, T), jnp.int32), sds((B, S), jnp.int32))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(*args)
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 3  # fwd, dq, dk/dv


def test_bad_arguments_fail_loudly_with_shapes():
    q, k = jnp.zeros((2, 8, 4, 16)), jnp.zeros((2, 12, 3, 16))
    with pytest.raises(ValueError, match=r"q\(2, 8, 4, 16\) k\(2, 12, 3, 16\)"):
        attention(q, k, k, implementation="pallas")
    k = jnp.zeros((2, 12, 2, 16))
    with pytest.raises(ValueError, match="valid: \\('xla', 'pallas'\\)"):
        attention(q, k, k, implementation="triton")
    with pytest.raises(ValueError, match=r"kv_lengths must have shape \(2,\); got \(3,\)"):
        attention(q, k, k, kv_lengths=jnp.zeros(3, jnp.int32), implementation="pallas")
    with pytest.raises(ValueError, match=r"segment ids want q \(2, 8\) and kv \(2, 12\)"):
        attention(q, k, k, q_segment_ids=jnp.zeros((2, 8), jnp.int32), kv_segment_ids=jnp.zeros((2, 8), jnp.int32))
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(block_q=24)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="interpret=True"):
            attention(q, k, k, implementation="pallas", interpret=False)
