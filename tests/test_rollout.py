"""Rollout engine correctness: parity with transformers, identical outputs across layouts, paging."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import PRESETS, forward, init, load_hf, logical_axes
from jaxrl.rollout import RolloutService, SamplingParams, generate
from sharding import Layout, ShardingRules, shardings_for
from tests.hf_util import hf_model

from jaxrl.testing import LOGPROB_ATOL_F32, PROMPT_LENS, ROLLOUT_CFG as CFG  # noqa: E402 (shared with scripts/)


@pytest.fixture(scope="module")
def weights():
    return init(jax.random.key(0), CFG)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(weights, prompts):
    """Static layout, no sharing, big pool: the unoptimised twin every variant must equal."""
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    return generate(CFG, weights, prompts, params, page_size=8, num_pages=64, prefix_sharing=False, overlap=False)


GENERATE_CASES = {"tiny-qwen3": PRESETS["tiny-qwen3"], "tiny-llama": PRESETS["tiny-llama"],
                  # a window shorter than the prompts: prefill chunks and paged decode both cut keys
                  "tiny-qwen3-window": dataclasses.replace(PRESETS["tiny-qwen3"], sliding_window=6)}


@pytest.mark.parametrize("name", sorted(GENERATE_CASES))
def test_greedy_matches_transformers_generate(name, tmp_path):
    import torch

    cfg = GENERATE_CASES[name]
    model = hf_model(cfg, seed=1)
    model.save_pretrained(tmp_path)
    _, w = load_hf(tmp_path)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (4, 11, 23)]
    outs = generate(cfg, w, prompts, SamplingParams(max_new_tokens=16, temperature=0.0), page_size=8, num_pages=32)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                                 pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
        assert o.tokens == ref


@pytest.mark.parametrize("tp,instances", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4), (2, 4)])
def test_same_tokens_across_layouts(weights, prompts, reference, tp, instances):
    outs = generate(CFG, weights, prompts, SamplingParams(max_new_tokens=10, temperature=0.0), tp=tp,
                    instances=instances, page_size=8, num_pages=64)
    assert [o.tokens for o in outs] == [r.tokens for r in reference]
    np.testing.assert_allclose([o.logprobs for o in outs], [r.logprobs for r in reference], atol=LOGPROB_ATOL_F32)


def test_prefill_budget_and_chunks_keep_outputs(weights, prompts, reference):
    """Admitted prompts prefill together; a small token budget splits them over calls and chunks."""
    outs = generate(CFG, weights, prompts, SamplingParams(max_new_tokens=10, temperature=0.0), page_size=8,
                    num_pages=64, prefill_chunk=8, prefill_tokens=16)
    assert [o.tokens for o in outs] == [r.tokens for r in reference]


def test_preemption_keeps_outputs(weights, prompts, reference):
    """A pool too small for all sequences at once forces preemption by recomputation."""
    svc = RolloutService(CFG, weights, page_size=8, num_pages=9)
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    for p in prompts:
        svc.add(p, params)
    outs = svc.run()
    assert svc.stats()[0]["preemptions"] > 0
    assert [o.tokens for o in outs] == [r.tokens for r in reference]


def test_prefix_sharing_equals_independent_samples(weights, prompts):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=50, top_p=0.9, n=4, seed=7)
    shared = generate(CFG, weights, prompts[:3], params, page_size=8, num_pages=64, prefix_sharing=True)
    alone = generate(CFG, weights, prompts[:3], params, page_size=8, num_pages=64, prefix_sharing=False)
    assert [o.tokens for o in shared] == [o.tokens for o in alone]
    assert len({tuple(o.tokens) for o in shared[:4]}) > 1          # the n samples differ


def test_prefix_pages_are_shared(weights):
    prompt = list(range(1, 40))                                     # 39 tokens = 4 full pages of 8 + 7
    svc = RolloutService(CFG, weights, page_size=8, num_pages=64)
    svc.add(prompt, SamplingParams(max_new_tokens=1, temperature=1.0, n=4))
    svc.instances[0].launch()                                       # admitted + prefilled, not collected
    used = svc.instances[0].pool.used
    assert used == 5 + 3 * 1                                        # 4 shared full pages + one own page each


def test_update_weights_from_training_layout(weights, prompts, reference):
    other = init(jax.random.key(1), CFG)
    svc = RolloutService(CFG, other, tp=2, instances=2, page_size=8, num_pages=64)
    layout = Layout(fsdp=4, tp=2)
    train_w = jax.device_put(weights, shardings_for(logical_axes(CFG), layout.make_mesh(jax.devices()),
                                                    ShardingRules.train(CFG, layout)))
    svc.update_weights(train_w)
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    for p in prompts:
        svc.add(p, params)
    assert [o.tokens for o in svc.run()] == [r.tokens for r in reference]


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_frees_pages(weights, prompts, overlap):
    svc = RolloutService(CFG, weights, page_size=8, num_pages=64, overlap=overlap)
    ids = [svc.add(p, SamplingParams(max_new_tokens=50, temperature=0.0))[0] for p in prompts]
    svc.step()
    if overlap:        # step 1 is read only after step 2 is dispatched, which reserved position 16's page
        assert svc.stats()[0]["generated_tokens"] == 0
        svc.step()
    before = svc.stats()[0]["pages_used"]
    partial = svc.abort(ids[2])             # with overlap, its in-flight token is discarded
    assert partial.finish_reason == "abort" and len(partial.tokens) == 1
    # 16 prompt tokens on pages of 8; with overlap the page of position 16 is already held
    assert svc.stats()[0]["pages_used"] == before - (3 if overlap else 2)
    assert svc.abort(ids[2]) is None
    assert ids[2] not in {c.request_id for c in svc.stream()}
    assert svc.stats()[0]["pages_used"] == 0


def test_seed_determinism(weights, prompts):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
    a = generate(CFG, weights, prompts, params, page_size=8, num_pages=64)
    b = generate(CFG, weights, prompts[::-1], params, page_size=8, num_pages=64, tp=2)  # other batch order/layout
    assert [o.tokens for o in a] == [o.tokens for o in b[::-1]]
    c = generate(CFG, weights, prompts, dataclasses.replace(params, seed=4), page_size=8, num_pages=64)
    assert [o.tokens for o in a] != [o.tokens for o in c]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_match_teacher_forcing(weights, prompts, temperature):
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=5)
    for p, o in zip(prompts, generate(CFG, weights, prompts, params, page_size=8, num_pages=64)):
        seq = jnp.asarray([p + o.tokens])
        logits = forward(weights, CFG, seq)[0, len(p) - 1:-1] / (temperature or 1.0)
        ref = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.asarray(o.tokens)[:, None], -1)[:, 0]
        np.testing.assert_allclose(o.logprobs, np.asarray(ref), atol=LOGPROB_ATOL_F32)


def test_stop_tokens_and_kv_export(weights, prompts, reference):
    stop = reference[1].tokens[4]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(stop,), return_kv=True)
    out = generate(CFG, weights, [prompts[1]], params, page_size=8, num_pages=64)[0]
    first = reference[1].tokens.index(stop)
    assert out.finish_reason == "stop" and out.tokens == reference[1].tokens[:first + 1]
    n = len(prompts[1]) + len(out.tokens) - 1
    assert out.kv.length == n and isinstance(out.kv.k, jax.Array)         # exported on the devices
    assert out.kv.k.shape[1] >= n and out.kv.k.shape[1] % 8 == 0            # whole pages, bucketed count
    k, v = out.kv.numpy()
    assert k.shape == (CFG.num_layers, n, CFG.num_kv_heads, CFG.head_dim) and v.shape == k.shape


def test_overlap_equals_step_by_step(weights, prompts):
    """Dispatching step n+1 before reading step n changes nothing: stops mid-flight, preemption (which
    drains), shared prompts, sampling, KV export."""
    def run(overlap):
        svc = RolloutService(CFG, weights, page_size=8, num_pages=12, overlap=overlap)
        probe = generate(CFG, weights, prompts[:1], SamplingParams(max_new_tokens=12, temperature=1.0, seed=5),
                         page_size=8, num_pages=64, overlap=False)[0].tokens
        params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, n=2, stop_token_ids=tuple(probe[3:5]),
                                return_kv=True)
        for p in prompts:
            svc.add(p, params)
        return svc.run(), svc.stats()[0]

    (plain, plain_stats), (fast, fast_stats) = run(False), run(True)
    assert fast_stats["preemptions"] > 0 and fast_stats["overlapped_steps"] > 0
    assert plain_stats["overlapped_steps"] == 0
    assert {o.finish_reason for o in fast} == {"stop", "length"}
    for a, b in zip(plain, fast):
        assert (a.request_id, a.tokens, a.finish_reason) == (b.request_id, b.tokens, b.finish_reason)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_ATOL_F32)
        for x, y in zip(a.kv.numpy(), b.kv.numpy()):
            np.testing.assert_allclose(x, y, atol=1e-5)
    assert fast_stats["pages_used"] == 0


def test_bad_requests(weights):
    svc = RolloutService(CFG, weights, page_size=8, num_pages=8)
    with pytest.raises(ValueError, match="needs 13 pages; the pool has 7"):
        svc.add([1] * 4, SamplingParams(max_new_tokens=100))
    with pytest.raises(ValueError, match="token ids"):
        svc.add([CFG.vocab_size], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_persistent_compilation_cache_on_by_default(weights, monkeypatch, tmp_path):
    import jax

    from jaxrl.runtime import enable_compilation_cache

    monkeypatch.delenv("JAXRL_COMPILATION_CACHE", raising=False)
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv("JAXRL_COMPILATION_CACHE_DIR", str(tmp_path / "xla"))
        RolloutService(CFG, weights, page_size=8, num_pages=8)
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
        monkeypatch.setenv("JAXRL_COMPILATION_CACHE", "0")
        jax.config.update("jax_compilation_cache_dir", None)
        assert enable_compilation_cache() is None and not jax.config.jax_compilation_cache_dir
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_pallas_kernels_in_the_engine_match_xla(weights, prompts):
    """The engine on the Pallas attention kernels (interpret mode on the CPU) == the XLA path."""
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    few = [prompts[0], prompts[3]]
    xla = generate(CFG, weights, few, params, page_size=8, num_pages=16, prefill_chunk=16)
    pallas = generate(CFG, weights, few, params, page_size=8, num_pages=16, prefill_chunk=16, attention_impl="pallas")
    assert [o.tokens for o in pallas] == [o.tokens for o in xla]
    np.testing.assert_allclose([o.logprobs for o in pallas], [o.logprobs for o in xla], atol=LOGPROB_ATOL_F32)
