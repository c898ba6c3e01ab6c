"""`scripts/gpu_check.py` section "kernels": each kernel compiled for the device against its reference, forward
and `jax.grad`, with the max error per case judged at the tolerance the CPU tests use (imported from them, so
there is one number per dtype).

  flash   `kernels.attention(implementation="pallas", interpret=False)` (Triton on the GPU) vs
          `attention_reference`: tests/test_attention_kernel.py's cases (causal, GQA, q_offset > 0, ragged,
          windows, packed segments; 16-wide tiles) and two qwen3-0.6b-shaped cases with the default tiles
          (1024 causal rows; 256 queries at offset 768), float32 and bfloat16. Tolerances: `ATOL` (forward
          in both dtypes, gradients in float32; bf16 gradient errors are recorded, not judged: the CPU tests
          set no bound for them).
  paged   `paged_decode_attention(implementation="pallas")` vs `paged_decode_attention_reference` on
          tests/test_paged_attention.py's garbage-filled page pools (page size 16: Triton wants
          page_size x pages_per_compute_block >= 16) and one qwen3-0.6b decode shape (64 sequences of up to
          1024 keys, default BlockSizes), judged like `assert_partials_close` with its `TOL`.
  logprob `kernels.logprobs.token_logprobs` (chunked projection, custom VJP) vs the full-logits reference,
          tests/test_logprobs.py's `outputs_and_grads` and `TOL` (atol relative to max(|expected|, 1)), and
          one 151936-entry vocabulary case.
  pairs   `kernels.attention_pairs` (XLA flash for a traced offset) vs the reference, float32.

float32 cases run under `jax.default_matmul_precision("highest")` (kernel and reference alike): the CPU's
float32 dots are exact, and TF32 (the GPU's default for float32 dots) would measure the precision mode, not
the kernel. With `--smoke` (the CPU) the Pallas kernels run in interpret mode on a few small cases.
Cases run in priority order (the GPU-sized ones first); once the section's budget is spent the rest are
recorded as skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses

from gpu_check_common import Section, allclose, judged, max_abs


def _precision(dtype):
    import jax
    import jax.numpy as jnp

    return jax.default_matmul_precision("highest") if dtype == jnp.float32 else contextlib.nullcontext()


def _name(dtype) -> str:
    import jax.numpy as jnp

    return jnp.dtype(dtype).name


def flash(c, dtype, interpret: bool) -> dict:
    import jax
    import numpy as np

    from kernels.attention import attention, attention_reference
    from kernels.testing.attention_cases import ATOL, make_inputs

    args, cot, kw = make_inputs(c, dtype)

    def out_and_grads(fwd):
        def f(q, k, v):
            out, vjp = jax.vjp(fwd, q, k, v)
            return out, vjp(cot)
        return jax.jit(f)(*args)

    with _precision(dtype):
        out, grads = out_and_grads(lambda q, k, v: attention(q, k, v, **kw, implementation="pallas",
                                                             interpret=interpret, block_sizes=c.blocks))
        ref, ref_grads = out_and_grads(lambda q, k, v: attention_reference(q, k, v, **kw))
    tol = ATOL[dtype]
    finite = bool(np.all(np.isfinite(np.asarray(out, np.float32)))
                  and all(np.all(np.isfinite(np.asarray(g, np.float32))) for g in grads))
    return {"kernel": "flash_attention", "dtype": _name(dtype), "finite": finite,
            "shape": {"B": c.B, "T": c.T, "S": c.S, "H": c.H, "K": c.K, "D": c.D, "q_offset": c.q_offset,
                      "causal": c.causal, "window": c.window, "segments": c.segments,
                      "blocks": "default" if c.blocks is None else c.blocks.block_q},
            "checks": {"forward": judged(max_abs(out, ref), tol["fwd"]),
                       "grad": judged(max(max_abs(g, r) for g, r in zip(grads, ref_grads)), tol.get("grad"))}}


def _paged_big(dtype, seed: int = 0, B: int = 64, H: int = 16, K: int = 8, D: int = 128, page: int = 16,
               max_pages: int = 64):
    """A qwen3-0.6b decode shape: B sequences of 1..max_pages*page keys in a shuffled pool whose unused pages
    hold large values (a masking or page-table mistake would show)."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    num_pages = B * max_pages + 3
    lengths = rng.integers(1, max_pages * page + 1, B).astype(np.int32)
    k_pages = np.full((num_pages, K, page, D), 40.0, np.float32)
    v_pages = np.full((num_pages, K, page, D), -1e3, np.float32)
    ids = rng.permutation(num_pages)
    table = ids[:B * max_pages].reshape(B, max_pages).astype(np.int32)
    for b in range(B):
        used = table[b, :-(-lengths[b] // page)]
        k_pages[used] = rng.normal(size=(len(used), K, page, D))
        v_pages[used] = rng.normal(size=(len(used), K, page, D))
    q = rng.normal(size=(B, H, D))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(q), cast(k_pages), cast(v_pages), jnp.asarray(table), jnp.asarray(lengths)


def paged(ratio: int, dtype, interpret: bool, big: bool = False) -> dict:
    import numpy as np

    from kernels.paged_attention import (BlockSizes, normalize, paged_decode_attention,
                                         paged_decode_attention_reference)
    from kernels.testing.paged_cases import PALLAS_BLOCKS, TOL, make_case

    if big:
        q, kp, vp, table, lengths = _paged_big(dtype)
        blocks = BlockSizes()
    else:
        q, kp, vp, table, lengths, _, _ = make_case(ratio, 16, dtype)
        blocks = PALLAS_BLOCKS
    with _precision(dtype):
        o, l, m = paged_decode_attention(q, kp, vp, table, lengths, implementation="pallas", interpret=interpret,
                                         block_sizes=blocks)
        o_r, l_r, m_r = paged_decode_attention_reference(q, kp, vp, table, lengths)
    tol = TOL[dtype]
    nonempty = np.asarray(lengths) > 0
    checks = {}
    for what, a, b in (("l", l, l_r), ("m", np.asarray(m)[nonempty], np.asarray(m_r)[nonempty]),
                       ("output", normalize(o, l), normalize(o_r, l_r))):
        err, ok = allclose(a, b, **tol)
        checks[what] = judged(err, tol["atol"], ok) | {"rtol": tol["rtol"]}
    return {"kernel": "paged_decode_attention", "dtype": _name(dtype), "checks": checks,
            "shape": {"B": int(q.shape[0]), "H": int(q.shape[1]), "K": int(kp.shape[1]), "D": int(q.shape[2]),
                      "page_size": int(kp.shape[2]), "max_pages": int(table.shape[1]),
                      "blocks": dataclasses.asdict(blocks)}}


def logprob(n: int, v: int, temperature: float, dtype, e: int | None = None) -> dict:
    import numpy as np

    from kernels.testing.logprob_cases import E, TOL, cotangents, f32, make_case, outputs_and_grads

    e = e or E
    hidden, w, targets = make_case(n, v, dtype, e=e)
    g_logp, g_ent = cotangents(n)
    with _precision(dtype):
        got = outputs_and_grads(hidden, w, targets, g_logp, g_ent, "chunked", temperature)
        ref = outputs_and_grads(*f32(hidden, w), targets, g_logp, g_ent, "ref", temperature)
    tol = TOL[dtype]
    checks = {}
    pairs = {"logp": (got[0], ref[0]), "entropy": (got[1], ref[1]), "d_hidden": (got[2][0], ref[2][0]),
             "d_w": (got[2][1], ref[2][1]), "d_hidden_logp_only": (got[3][0], ref[3][0]),
             "d_w_logp_only": (got[3][1], ref[3][1])}
    for what, (a, b) in pairs.items():
        scale = max(float(np.max(np.abs(np.asarray(b, np.float32)))), 1.0)
        err, ok = allclose(a, b, atol=tol["atol"] * scale, rtol=tol["rtol"])
        checks[what] = judged(err, tol["atol"] * scale, ok) | {"rtol": tol["rtol"]}
    return {"kernel": "token_logprobs", "dtype": _name(dtype), "checks": checks,
            "shape": {"tokens": n, "vocab": v, "hidden": e, "temperature": temperature}}


def pairs(c) -> dict:
    import jax
    import jax.numpy as jnp

    from kernels.attention import attention_reference
    from kernels.attention_pairs import attention_pairs
    from kernels.testing.attention_cases import ATOL, make_inputs

    args, cot, kw = make_inputs(c, jnp.float32)
    off = kw.pop("q_offset")

    def out_and_grads(fwd):
        out, vjp = jax.vjp(fwd, *args)
        return out, vjp(cot)

    @jax.jit
    def both(off):
        return (out_and_grads(lambda q, k, v: attention_pairs(q, k, v, q_offset=off, **kw, block_q=16, block_k=16)),
                out_and_grads(lambda q, k, v: attention_reference(q, k, v, q_offset=off, **kw)))

    with _precision(jnp.float32):
        (out, grads), (ref, ref_grads) = both(jnp.asarray(off, jnp.int32))
    tol = ATOL[jnp.float32]
    return {"kernel": "attention_pairs", "dtype": "float32",
            "shape": {"B": c.B, "T": c.T, "S": c.S, "H": c.H, "K": c.K, "D": c.D, "q_offset": c.q_offset},
            "checks": {"forward": judged(max_abs(out, ref), tol["fwd"]),
                       "grad": judged(max(max_abs(g, r) for g, r in zip(grads, ref_grads)), tol["grad"])}}


def plan(smoke: bool) -> list[tuple[str, object, tuple]]:
    """(case name, function, args) in priority order."""
    import jax.numpy as jnp

    from kernels.testing.attention_cases import CASES, Case

    f32, bf16 = jnp.float32, jnp.bfloat16
    interpret = smoke
    if smoke:           # GQA 2, causal, queries at offset 35 of 40 keys: the smallest case that has all three
        c = CASES["default_blocks"]
        return [("flash/default_blocks/float32", flash, (c, f32, True)),
                ("flash/default_blocks/bfloat16", flash, (c, bf16, True)),
                ("paged/gqa2/float32", paged, (2, f32, True)),
                ("logprob/37x100/bfloat16", logprob, (37, 100, 1.0, bf16)),
                ("pairs/default_blocks", pairs, (c,))]
    big = {"train_1024": Case(T=1024, S=1024, H=16, K=8, D=128, B=2, blocks=None),
           "prefill_offset_768": Case(T=256, S=1024, H=16, K=8, D=128, B=2, q_offset=768, blocks=None)}
    out = []
    for dt, dn in ((bf16, "bfloat16"), (f32, "float32")):
        out += [(f"flash/{n}/{dn}", flash, (c, dt, interpret)) for n, c in big.items()]
    out += [("paged/qwen3-0.6b_decode/bfloat16", paged, (2, bf16, interpret, True)),
            ("logprob/2048x151936/bfloat16", logprob, (2048, 151936, 1.0, bf16, 1024))]
    for name in ("prefill_chunk_gqa4", "train_gqa2_packed", "prefill_ragged_offsets", "window_offset_ragged"):
        out += [(f"pairs/{name}", pairs, (CASES[name],))]
    for ratio in (1, 2, 4):
        out += [(f"paged/gqa{ratio}/float32", paged, (ratio, f32, interpret))]
    out += [("paged/gqa2/bfloat16", paged, (2, bf16, interpret))]
    for n, v in ((37, 100), (300, 5000)):
        for t in (1.0, 0.7):
            out += [(f"logprob/{n}x{v}/t{t}/{dn}", logprob, (n, v, t, dt)) for dt, dn in ((f32, "float32"),
                                                                                          (bf16, "bfloat16"))]
    for name in sorted(CASES):
        out += [(f"flash/{name}/{dn}", flash, (CASES[name], dt, interpret))
                for dt, dn in ((f32, "float32"), (bf16, "bfloat16"))]
    return out


def run_kernels(s: Section) -> None:
    import jax

    s.info["interpret"] = s.smoke
    s.info["backend"] = jax.default_backend()
    s.info["float32_matmul_precision"] = "highest"
    for name, fn, args in plan(s.smoke):
        s.case(name, fn, *args)
