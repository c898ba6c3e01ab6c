"""Bounded shapes: every step a rollout (and a training update) runs has a shape from a fixed set that
`warm()` compiles up front, so a ragged, long-tailed workload compiles nothing afterwards."""

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest

from jaxrl.rollout import CACHE, RolloutService, SamplingParams, Scheduler
from jaxrl.rollout.params import prompt_seed
from jaxrl.rollout.scheduler import Sequence
from jaxrl.rollout.shapes import ShapeBuckets, ladder, up
from jaxrl.runtime import CompileCounter
from jaxrl.train.background import BackgroundCompile
from models import PRESETS, init

CFG = PRESETS["tiny-qwen3"]


def test_ladder():
    assert ladder(64, 1) == (1, 2, 4, 8, 16, 32, 64)
    assert ladder(64, 2) == (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
    assert ladder(100, 4)[-1] == 100 and all(b > a for a, b in zip(ladder(100, 4), ladder(100, 4)[1:]))
    lad = ladder(256, 4)
    for n in range(8, 257):      # 4 steps per octave: at most 25% padding from 8 up
        assert n <= up(lad, n) <= n * 1.25
    with pytest.raises(ValueError, match="exceeds"):
        up(lad, 257)


def _ragged(rng, n, max_prompt, max_new):
    """Prompt lengths uniform, completion lengths roughly geometric (mean max_new/4), some shared groups."""
    out = []
    for i in range(n):
        p = SamplingParams(max_new_tokens=int(min(max_new, 1 + rng.geometric(4 / max_new))),
                           n=int(rng.choice([1, 2, 3])), temperature=1.0)
        out.append((rng.integers(0, CFG.vocab_size, int(rng.integers(1, max_prompt + 1))).tolist(), p))
    return out


@pytest.mark.parametrize("coarse", [False, True], ids=["exact", "coarse"])
@pytest.mark.parametrize("per_octave", [1, 2, 4])
def test_scheduler_shapes_stay_in_the_declared_set(per_octave, coarse):
    """A host-only run of the scheduler (no device): ragged prompts, geometric lengths, a pool small enough
    to preempt (recompute prefills of prompt + generated tokens, chunked past prefill_chunk). coarse: every
    step rounds up to the cover shapes (a cold start's first rollout), which are members of the exact set."""
    rng = np.random.default_rng(per_octave)
    max_seq_len, ps = 120, 8
    sh = ShapeBuckets.build(max_batch=12, max_seq_len=max_seq_len, page_size=ps, prefill_chunk=64,
                            prefill_tokens=256, per_octave=per_octave)
    assert set(sh.cover_decode_shapes()) <= set(sh.decode_shapes())
    assert set(sh.cover_prefill_shapes()) <= set(sh.prefill_shapes())
    if coarse:
        sh = dataclasses.replace(sh, coarse=True)
    sched = Scheduler(40, ps, max_batch=12, prefill_chunk=64, prefill_tokens=256, shapes=sh)
    rid = 0
    for g, (prompt, p) in enumerate(_ragged(rng, 30, 40, 80)):
        seqs = [Sequence(rid + k, prompt, p, prompt_seed(0, rid + k), group=g) for k in range(p.n)]
        rid += p.n
        sched.add(seqs)
    decode, prefill = set(sh.decode_shapes()), set(sh.prefill_shapes())
    if coarse:
        decode, prefill = set(sh.cover_decode_shapes()), set(sh.cover_prefill_shapes())
    seen_d, seen_p, steps = set(), set(), 0
    while sched.waiting or sched.running:
        groups = sched.admit()
        for b in sched.prefill_batches([g[0] for g in groups]):
            seen_p.add((*b.tokens.shape, b.table.shape[1]))
        for g in groups:
            if len(g) > 1:
                sched.fork(g)
        sched.start(groups)
        sched.ensure_pages()
        b = sched.decode_batch()
        if b is None:
            continue
        seen_d.add(b.table.shape)
        tok = rng.integers(0, CFG.vocab_size, len(b.seqs))
        for s, _ in sched.take_tokens(b.seqs, tok, np.zeros(len(b.seqs))):
            sched.retire(s)
        steps += 1
    assert sched.preemptions > 0 and steps > 50
    assert seen_d <= decode, seen_d - decode
    assert seen_p <= prefill, seen_p - prefill
    assert any(w == 64 for _, w, _ in seen_p)      # a chunked (recompute) prefill happened
    assert not coarse or (seen_d == decode and len(seen_p) > 1)


def test_warm_then_ragged_rollout_compiles_nothing():
    """warm() compiles the instance's whole set; a ragged, preempting, overlapped rollout with shared
    prompts and stop tokens then triggers no XLA compilation at all (JAX's own monitoring events)."""
    weights = init(jax.random.key(0), CFG)
    svc = RolloutService(CFG, weights, devices=jax.devices()[:1], page_size=8, num_pages=12, max_batch=8,
                         max_seq_len=64, prefill_chunk=32, prefill_tokens=128)
    sampled = SamplingParams(temperature=1.0, top_p=0.9)
    n = svc.warm([sampled])
    sh = svc.instances[0].shapes
    assert n >= len(sh.decode_shapes()) + len(sh.prefill_shapes())
    assert svc.warm([sampled]) == 0                      # everything is cached now
    counter = CompileCounter()
    before = CACHE.compiles
    rng = np.random.default_rng(0)
    for prompt, p in _ragged(rng, 10, 30, 34):
        svc.add(prompt, SamplingParams(max_new_tokens=p.max_new_tokens, n=p.n, temperature=1.0, top_p=0.9,
                                       stop_token_ids=(5, 7, 11), seed=3))
    outs = svc.run()
    got = counter.take()
    assert len(outs) > 10 and len({len(c.tokens) for c in outs}) > 4
    assert svc.stats()[0]["preemptions"] > 0
    assert CACHE.compiles == before and got["compiles"] == 0, counter.names()


def test_cover_shapes_first_then_the_exact_buckets_compiled_on_a_thread():
    """A cold start (trainer.background_compile): `warm(cover=True)` compiles only the cover shapes (one decode
    shape, one prefill shape per chunk width) and a ragged, preempting rollout then compiles nothing more, every
    step rounded up to them; meanwhile a thread compiles the exact buckets (counted apart:
    `compiles_background`), after which a rollout on them compiles nothing. Same requests, same seeds: the
    cover's tokens equal the exact buckets' and its float32 log-probs differ by rounding only (measured
    9.5e-7 at most; XLA:CPU sums in another order for another batch or table width)."""
    weights = init(jax.random.key(1), CFG)
    sampled = SamplingParams(temperature=1.0)

    def rollout(svc):
        for prompt, p in _ragged(np.random.default_rng(1), 10, 30, 34):
            svc.add(prompt, SamplingParams(max_new_tokens=p.max_new_tokens, n=p.n, temperature=1.0, seed=5))
        outs = sorted(svc.run(), key=lambda c: c.request_id)
        return [c.tokens for c in outs], np.concatenate([np.asarray(c.logprobs, np.float32) for c in outs])

    svc = RolloutService(CFG, weights, devices=jax.devices()[:1], page_size=8, num_pages=10, max_batch=6,
                         max_seq_len=56, prefill_chunk=32, prefill_tokens=96)
    inst, counter = svc.instances[0], CompileCounter()
    sh = inst.shapes
    assert svc.warm([sampled], cover=True) == 1 + len(sh.widths) == len(sh.cover_decode_shapes() + sh.cover_prefill_shapes())
    assert inst.sched.shapes.coarse and counter.take()["compiles"] > 0
    background = []

    def compile_exact():
        with CompileCounter.background():      # (a per-thread flag: the rollout's thread still counts as foreground)
            background.append(inst.compile_exact((False,)))

    thread = threading.Thread(target=compile_exact)
    thread.start()
    cover_tokens, cover_logp = rollout(svc)
    got = counter.take()
    thread.join()
    assert svc.stats()[0]["preemptions"] > 0
    assert got["compiles"] == 0, counter.names()          # the cover shapes served every step
    inst.use_exact()
    late = counter.take()
    assert background[0] == len(sh.decode_shapes()) + len(sh.prefill_shapes()) - 1 - len(sh.widths)
    assert late["compiles"] == 0 and got.get("compiles_background", 0) + late.get("compiles_background", 0) == background[0]
    exact_tokens, exact_logp = rollout(svc)
    assert counter.take()["compiles"] == 0, counter.names()   # every exact bucket was compiled on the thread
    assert cover_tokens == exact_tokens
    np.testing.assert_allclose(cover_logp, exact_logp, rtol=0, atol=1e-5)


def test_background_compile_runs_step_0s_shapes_first_and_the_exact_buckets_once_released():
    """`BackgroundCompile` (a cold start's thread, `warm_up.start_early`): its first jobs (the cover shapes, from
    `Instance.compile_jobs(cover=True)`) compile at once and the exact buckets not before `finish` (step 1's
    rollout): compiling them beside the warm start and step 0 only slowed those on 2 cores. `warm(cover=True)`
    after the first phase compiles no step shape (it runs what the thread compiled); `finish` compiles the rest on
    the thread's workers, every one counted as a background compilation, and then a rollout compiles nothing.
    `close` before `finish` never starts the exact buckets."""
    weights = init(jax.random.key(2), CFG)
    sampled = SamplingParams(temperature=1.0)

    def service():    # (shapes no other test here compiles: the executable cache is the process's)
        return RolloutService(CFG, weights, devices=jax.devices()[:1], page_size=8, num_pages=10, max_batch=5,
                              max_seq_len=48, prefill_chunk=16, prefill_tokens=80)

    svc, counter = service(), CompileCounter()
    inst = svc.instances[0]
    sh = inst.shapes
    first, later = inst.compile_jobs((False,), cover=True), inst.compile_jobs((False,))
    cover = len(sh.cover_decode_shapes() + sh.cover_prefill_shapes())
    exact = len(sh.decode_shapes() + sh.prefill_shapes())
    assert len(first) == cover and len(later) == exact > cover
    before = CACHE.compiles
    bg = BackgroundCompile.start(first, later)
    deadline = time.monotonic() + 120
    while bg.compiled < cover and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    assert bg.compiled == cover and bg.thread.is_alive()      # the exact buckets wait for finish()
    assert svc.warm([sampled], cover=True) == 0 and inst.sched.shapes.coarse
    waited = bg.finish(svc)
    assert waited > 0 and bg.compiled == exact and not inst.sched.shapes.coarse     # (the cover is among them)
    assert CACHE.compiles - before == exact           # each step shape once, all of them on the thread
    assert counter.take().get("compiles_background") == exact     # (the page copies warm() ran: plain jit, foreground)
    for prompt, p in _ragged(np.random.default_rng(2), 8, 24, 30):
        svc.add(prompt, SamplingParams(max_new_tokens=p.max_new_tokens, n=p.n, temperature=1.0, seed=7))
    assert len(svc.run()) > 8 and counter.take()["compiles"] == 0, counter.names()
    other = service().instances[0]
    bg = BackgroundCompile.start([], other.compile_jobs((False,)))
    bg.close()
    assert bg.compiled == 0


def test_fixed_micro_batch_update_equals_whole_batch_step_and_compiles_once():
    """The trainer's update over fixed-shape micro-batches (rl.micro_batches + Updater) equals the fused
    whole-batch step (rl.global_batch + make_train_step, its unoptimised twin) within float32 rounding, on
    an FSDP2 mesh; after `warm()` updates on batches of other sizes compile nothing."""

    from jaxrl.config.loading import from_yaml_file
    from jaxrl.config.train import TrainConfig
    from jaxrl.train import rl
    from jaxrl.train.batch import FIELDS, INT_FIELDS, Sample
    from jaxrl.train.optim import init_state, make_optimizer
    from jaxrl.train.step import LossSpec, make_train_step
    from jaxrl.train.update import CACHE as UPDATE_CACHE, Updater
    from models import logical_axes
    from sharding import Layout, ShardingRules, shardings_for

    cfg = from_yaml_file(TrainConfig, "configs/quickstart.yaml")
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, micro_batch_tokens=96))
    mcfg = dataclasses.replace(PRESETS["tiny-char"], num_layers=2, hidden_size=64, intermediate_size=128)
    layout = Layout(fsdp=2)
    mesh = layout.make_mesh(jax.devices()[:2])
    sh = shardings_for(logical_axes(mcfg), mesh, ShardingRules.train(mcfg, layout))
    spec = LossSpec.from_config(cfg.algo, temperature=1.0, trainer=cfg.trainer)
    tx, _ = make_optimizer(cfg.optim, 10)
    pack_len, rows = 48, rl.micro_batch_rows(cfg, mesh, 48)
    assert rows == 2
    rng = np.random.default_rng(0)

    def samples(n):
        return [Sample(rng.integers(3, 100, rng.integers(3, 12)).tolist(),
                       rng.integers(3, 100, rng.integers(1, 30)).tolist(), float(rng.normal())) for _ in range(n)]

    def fresh():
        p = init(jax.random.key(0), mcfg, shardings=sh)
        return p, init_state(tx, p, sh, mesh)

    upd = Updater(mcfg, spec, tx)
    p, o = fresh()
    mb_abs = {k: jax.ShapeDtypeStruct((rows, pack_len), np.int32 if k in INT_FIELDS else np.float32,
                                      sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("dp", "fsdp"), None)))
              for k in FIELDS}
    upd.warm(p, o, mb_abs)
    fused = make_train_step(mcfg, spec, tx, 1)
    counter, before = CompileCounter(), UPDATE_CACHE.compiles
    for n in (9, 16, 5):                             # 4+, 7+ and 2+ micro-batches: the same executables
        batch = samples(n)
        mbs = rl.micro_batches(batch, cfg, mesh, pack_len, cfg.rollout.max_new_tokens, rows)
        assert all(mb["tokens"].shape == (rows, pack_len) for mb in mbs)
        p, o = fresh()
        counter.take()
        p, o, m = upd.update(p, o, mbs)
        got = counter.take()["compiles"]
        assert UPDATE_CACHE.compiles == before and got == 0
        q, s = fresh()
        q, s, m2 = fused(q, s, rl.global_batch(batch, cfg, mesh, pack_len, cfg.rollout.max_new_tokens), 1.0)
        counter.take()
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
        np.testing.assert_allclose(float(m["loss"]), float(m2["loss"]), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(float(m["grad_norm"]), float(m2["grad_norm"]), rtol=1e-5)
    grads = [k for k in UPDATE_CACHE._table if k[0] == "grad" and k[1] is upd.grad]
    assert len(grads) == 1, grads                    # one gradient program: the first micro-batch adds to zeros


@pytest.mark.parametrize("fused", [True, False], ids=["fused_loss", "autodiff_loss"])
def test_warm_start_shares_the_rl_gradient_program_at_advantage_1(fused):
    """The warm start runs the RL update's gradient program (`warm_start.loss_spec`: one compilation for both)
    where that is the NLL's gradient bit for bit: demonstrations at advantage 1, on-policy ratio 1. Checked against
    the NLL spec's gradient, compiled as runs compile; the specs it must not share: temperature, KL, entropy."""
    from jaxrl.config.loading import from_yaml_file
    from jaxrl.config.train import TrainConfig
    from jaxrl.train.batch import Sample, pack
    from jaxrl.train.step import LossSpec, make_grad_step
    from jaxrl.train.warm_start import loss_spec

    cfg = from_yaml_file(TrainConfig, "configs/quickstart.yaml")
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, fused_loss=fused))
    rl_spec = LossSpec.from_config(cfg.algo, temperature=1.0, trainer=cfg.trainer)
    assert loss_spec(cfg, rl_spec) is rl_spec and loss_spec(cfg, None).kind == "sft"
    for other in ({"temperature": 0.7}, {"kl_coef": 0.05}, {"entropy_coef": 0.01}, {"dual_clip": 3.0}):
        assert loss_spec(cfg, dataclasses.replace(rl_spec, **other)).kind == "sft", other
    mcfg = dataclasses.replace(PRESETS["tiny-char"], num_layers=1, hidden_size=64, intermediate_size=128)
    params = init(jax.random.key(0), mcfg)
    rng = np.random.default_rng(2)
    samples = [Sample(rng.integers(3, 100, rng.integers(3, 30)).tolist(), rng.integers(3, 100, rng.integers(1, 30)).tolist(),
                      1.0) for _ in range(12)]
    mb = {k: jax.numpy.asarray(v) for k, v in pack(samples, np.full(12, 0.05, np.float32), 64, n_rows=8).items()}
    optimized = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        nll = make_grad_step(mcfg, loss_spec(cfg, None))(params, mb)
        shared = make_grad_step(mcfg, loss_spec(cfg, rl_spec))(params, mb)
    finally:
        jax.config.update("jax_disable_most_optimizations", optimized)
    for a, b in zip(jax.tree.leaves(shared[0]), jax.tree.leaves(nll[0])):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert {k: float(v) for k, v in shared[1].items() if k != "loss"} == {k: float(v) for k, v in nll[1].items() if k != "loss"}
    assert make_grad_step(mcfg, rl_spec) is make_grad_step(mcfg, dataclasses.replace(rl_spec))   # one program


def test_first_micro_batch_onto_zeros_is_the_gradient_bit_for_bit():
    """`Updater.accumulate` without an accumulator adds the micro-batch's sums to `zero_sums` in the one
    gradient program with an accumulator: bit for bit the sums of the gradient program without one (its
    unoptimised twin), with the zeros and sums in the weights' shardings, on FSDP2 x TP2.
    Compiled as runs compile (the session's jax_disable_most_optimizations off: at XLA's level 0 the two
    programs differ in rounding, each leaf by ~1e-7 relative, zeros or not)."""
    from jaxrl.config.train import TrainConfig
    from jaxrl.train.batch import Sample, pack
    from jaxrl.train.step import LossSpec
    from jaxrl.train.update import Updater
    from models import logical_axes
    from sharding import Layout, ShardingRules, shardings_for

    cfg = TrainConfig()
    mcfg = dataclasses.replace(PRESETS["tiny-char"], num_layers=1, hidden_size=64, intermediate_size=128)
    lay = Layout(fsdp=2, tp=2)
    mesh = lay.make_mesh(jax.devices()[:lay.size])
    sh = shardings_for(logical_axes(mcfg), mesh, ShardingRules.train(mcfg, lay))
    params = init(jax.random.key(0), mcfg, shardings=sh)
    upd = Updater(mcfg, LossSpec.from_config(cfg.algo, temperature=1.0, trainer=cfg.trainer), None)
    rng = np.random.default_rng(1)
    samples = [Sample(rng.integers(3, 100, rng.integers(3, 30)).tolist(), rng.integers(3, 100, rng.integers(1, 30)).tolist(),
                      float(rng.normal())) for _ in range(12)]
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("dp", "fsdp"), None))
    mb = {k: jax.device_put(v, rows) for k, v in pack(samples, np.full(12, 0.05, np.float32), 64, n_rows=8).items()}
    optimized = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        onto_zeros, alone = upd.accumulate(params, mb), upd.grad(params, mb)
    finally:
        jax.config.update("jax_disable_most_optimizations", optimized)
    assert jax.tree.structure(onto_zeros) == jax.tree.structure(alone)
    for a, b, p in zip(jax.tree.leaves(onto_zeros[0]), jax.tree.leaves(alone[0]), jax.tree.leaves(params)):
        assert a.sharding.is_equivalent_to(p.sharding, a.ndim)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    for k in onto_zeros[1]:
        assert np.asarray(onto_zeros[1][k]).tobytes() == np.asarray(alone[1][k]).tobytes(), k


def test_step_shapes_only_up_to_the_requests_a_rollout_holds():
    """engine.max_batch is capped by the most requests one rollout holds on a process (prompts x samples; tail
    batching's speculative launch), so the decode/prefill shapes above it are never compiled."""
    from jaxrl.config import load_config
    from jaxrl.config.train import TrainConfig
    from jaxrl.train.rollout_side import requests_in_flight

    cfg = load_config(TrainConfig, ["algo.prompts_per_step=4", "algo.group_size=8", "engine.max_batch=256"])
    assert requests_in_flight(cfg, 1) == 32 and requests_in_flight(cfg, 2) == 16
    tail = load_config(TrainConfig, ["algo.prompts_per_step=8", "algo.group_size=4", "rollout.tail_batching.enabled=true",
                                     "rollout.tail_batching.eta_prompts=1.5"])
    assert requests_in_flight(tail, 1) == 12 * 5 and requests_in_flight(tail, 2) == 6 * 5
    weights = init(jax.random.key(0), CFG)
    svc = RolloutService.from_config(cfg.engine, CFG, weights, max_requests=32)
    sh = svc.instances[0].shapes
    assert svc.instances[0].max_batch == 32 and max(sh.batch) == 32 and max(sh.prefill_rows) <= 32
    uncapped = RolloutService.from_config(cfg.engine, CFG, weights)
    assert uncapped.instances[0].max_batch == 256
    # The KV pool and the decode step's token vector are still sized by engine.max_batch: runs with other caps
    # share the executables of their common shapes.
    assert svc.instances[0].kv.k.shape == uncapped.instances[0].kv.k.shape
    assert svc.instances[0].executor.max_batch == uncapped.instances[0].executor.max_batch == 256
    full = ShapeBuckets.build(max_batch=256, max_seq_len=cfg.engine.max_seq_len, page_size=cfg.engine.page_size,
                              per_octave=cfg.engine.batch_buckets_per_octave, page_buckets=cfg.engine.page_buckets)
    assert len(sh.decode_shapes()) < len(full.decode_shapes())
