"""Stream trainer (RollPacker §4.4, Algorithm 1): the streamed update equals the synchronous one for every
aggregation with KL and entropy on; a real rollout whose pool shrinks at a milestone generates the same
tokens as one without, with gradients computed early on the freed devices; the milestone / projected-KV
rule on hand-made numbers; the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl import algos
from jaxrl.config.base import ConfigError
from jaxrl.config.stream import StreamSection, check_stream
from jaxrl.config.train_rollout import TailBatchingSection, TrainEngineSection, TrainSamplingSection
from jaxrl.config.train import AlgoSection, TrainConfig, TrainerSection
from jaxrl.rollout import RolloutService, SamplingParams
from jaxrl.runtime import CompileCounter
from jaxrl.train import rl
from jaxrl.train.batch import Sample
from jaxrl.train.blockwise import BlockwiseUpdater
from jaxrl.train.grad_stream import GradientStream
from jaxrl.train.pipeline import TrainWorker
from jaxrl.train.step import LossSpec
from jaxrl.train.shrink import freed_instances, milestone_due, peak_pages, plan_shrink, projected_lengths
from jaxrl.train.stream import StreamTrainer
from jaxrl.train.update import Updater
from models import PRESETS, init, logical_axes
from sharding import Layout, ShardingRules, shardings_for

CFG = PRESETS["tiny-qwen3"]
GRAD_RTOL = 1e-6                   # the bound: streamed vs synchronous gradient, relative (global norm);
                                   # or, on a CPU whose float32 floor is above it, that floor (`_floor`)
PACK_LEN, MAX_NEW, G = 48, 16, 4
LAYOUT = Layout(fsdp=8)
# SGD (with the trainer's global-norm clip): Adam's first step g / (|g| + eps) turns a rounding-level
# difference in a nearly cancelled gradient element into a whole step, which says nothing about streaming.
TX = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))


def _cfg(agg="token-mean", **algo):
    return TrainConfig(algo=AlgoSection(agg=agg, group_size=G, kl_coef=0.05, entropy_coef=0.01, **algo),
                       rollout=TrainSamplingSection(max_new_tokens=MAX_NEW),
                       trainer=TrainerSection(micro_batch_tokens=8 * PACK_LEN),
                       engine=TrainEngineSection(tp=2, instances=4, max_seq_len=128))


@pytest.fixture(scope="module")
def mesh():
    return LAYOUT.make_mesh(jax.devices())


@pytest.fixture(scope="module")
def model(mesh):
    sh = shardings_for(logical_axes(CFG), mesh, ShardingRules.train(CFG, LAYOUT))
    params = init(jax.random.key(0), CFG, shardings=sh)
    ref = jax.tree.map(lambda x: x + 0.01 * jnp.sign(x), params)       # a reference that differs: KL != 0
    cfg = _cfg()
    spec = LossSpec.from_config(cfg.algo, temperature=1.0, trainer=cfg.trainer)
    return params, ref, spec, Updater(CFG, spec, TX)


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _groups(rng, cfg, n):
    """n scored groups of G samples: random prompts/responses, rewards -> the configured advantages."""
    out = []
    for _ in range(n):
        prompt = rng.integers(0, CFG.vocab_size, rng.integers(3, 13)).tolist()
        resp = [rng.integers(0, CFG.vocab_size, rng.integers(1, MAX_NEW + 1)).tolist() for _ in range(G)]
        out.append(_scored(cfg, prompt, resp, rng.random(G).astype(np.float32)))
    return out


def _scored(cfg, prompt, responses, rewards):
    adv = rl.advantages(cfg, np.asarray(rewards, np.float32), [len(r) for r in responses])
    return [Sample(list(prompt), list(r), a) for r, a in zip(responses, adv)]


def _sync(cfg, mesh, updater, params, ref, opt, samples):
    """The synchronous path (trainer._update): folded weights, fixed micro-batches, Updater.update. Returns
    the summed gradient (denominator folded in) and the updated params."""
    mb_rows = rl.micro_batch_rows(cfg, mesh, PACK_LEN)
    mbs = rl.micro_batches(samples, cfg, mesh, PACK_LEN, MAX_NEW, mb_rows)
    for mb in mbs:
        mb["ref_logp"] = updater.logprobs(ref, mb)
    acc = None
    for mb in mbs:
        acc = updater.cache("grad", updater.grad, params, mb) if acc is None else \
            updater.cache("grad", updater.grad, params, mb, acc)
    grads = jax.device_get(acc[0])
    new, _, m = updater.update(_copy(params), _copy(opt), mbs)
    return grads, new, jax.device_get(m)


def _rel(a, b) -> float:
    """||a - b|| / ||b|| over every leaf (float64)."""
    da = [np.asarray(x, np.float64) for x in jax.tree.leaves(a)]
    db = [np.asarray(x, np.float64) for x in jax.tree.leaves(b)]
    return float(np.sqrt(sum(np.sum((x - y) ** 2) for x, y in zip(da, db))) /
                 np.sqrt(sum(np.sum(y ** 2) for y in db)))


def _floor(cfg, updater, params, ref, samples, g_sync, devices=None) -> float:
    """The synchronous gradient on the freed devices' sub-mesh (fsdp 4, devices 4-7) against the one on the whole
    mesh (relative, global norm): float32's summation-order floor for the two meshes a streamed step computes on.
    GRAD_RTOL sits at that floor on the CPUs that set it (0.8-1.2e-6 between fsdp 1-8, docs/rollpacker.md); on an
    AMD EPYC (family 25 model 1) it is 0.95-1.12e-6 by aggregation and the streamed gradient 0.90-1.08e-6, so
    a streamed gradient no further from the synchronous one than this floor is as exact as float32 allows."""
    devices = jax.devices()[4:] if devices is None else devices
    sub = Layout(fsdp=len(devices))
    mesh = sub.make_mesh(devices)
    sh = shardings_for(logical_axes(CFG), mesh, ShardingRules.train(CFG, sub))
    p, r = jax.device_put(params, sh), jax.device_put(ref, sh)
    g, _, _ = _sync(cfg, mesh, updater, p, r, TX.init(p), samples)
    return _rel(g, g_sync)


def _assert_same_update(p_stream, p_sync, params):
    for s, y, p in zip(jax.tree.leaves(p_stream), jax.tree.leaves(p_sync), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(s), np.asarray(y), rtol=1e-6, atol=1e-7)
    step_s = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), p_stream, params)
    step_y = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), p_sync, params)
    assert _rel(step_s, step_y) <= 1e-5


# ---------------------------------------------------------------------------------------------- (1)
@pytest.mark.parametrize("agg", list(algos.AGGREGATIONS))
def test_streamed_update_equals_synchronous(mesh, model, agg):
    """Groups before the shrink are held, then computed on devices 4-7 as micro-batches fill; the rest on
    the whole mesh at the end; one update with the global denominator == the synchronous update."""
    params, ref, spec, updater = model
    cfg = _cfg(agg)
    groups = _groups(np.random.default_rng(1), cfg, 9)
    samples = [s for g in groups for s in g]
    opt = TX.init(params)
    g_sync, p_sync, m_sync = _sync(cfg, mesh, updater, params, ref, opt, samples)

    mb_rows = rl.micro_batch_rows(cfg, mesh, PACK_LEN)
    st = StreamTrainer(cfg, StreamSection(enabled=True), CFG, spec, updater, mesh, pack_len=PACK_LEN, mb_rows=mb_rows)
    st.warm(params, opt, ref, devices=jax.devices()[4:])
    p0, o0 = _copy(params), _copy(opt)
    jax.block_until_ready((p0, o0))
    counter = CompileCounter()
    st.begin(p0, ref)
    for g in groups[:2]:
        st.add_group(g)                                  # held: no devices freed yet
    st.repurpose(jax.devices()[4:])
    for g in groups[2:]:
        st.add_group(g)
    grads, stats, denominator = st.combine(p0)
    rel = _rel(jax.tree.map(lambda g: np.asarray(g, np.float64) / denominator, jax.device_get(grads)), g_sync)
    new, _, m = st.finish(p0, o0)
    assert counter.take()["compiles"] == 0                # warm() compiled everything the streamed step runs
    assert rel <= GRAD_RTOL or rel <= _floor(cfg, updater, params, ref, samples, g_sync), rel
    assert 0 < m["stream/samples_early"] < len(samples) and m["stream/groups_early"] > 0
    assert m["stream/groups_early"] + m["stream/groups_late"] == len(groups) and m["stream/freed_devices"] == 4
    for key in ("loss", "kl", "entropy"):
        assert m[key] == pytest.approx(m_sync[key], rel=1e-5, abs=1e-7), key
    assert abs(float(m_sync["kl"])) > 0
    _assert_same_update(new, p_sync, params)


def test_freed_devices_join_the_train_pools_stream(model):
    """StreamRL's disaggregated pools with RollPacker's stream trainer: the train pool (devices 0-3, a mesh of
    its own) streams from the rollout's start on the train worker's thread; a shrink adds the freed rollout
    devices 6-7 as a second target, and each micro-batch goes to the target that would finish it first. Both
    take work; one update with the global denominator == the synchronous update on the train pool, within
    GRAD_RTOL or float32's floor between the two meshes; nothing compiles after warm()."""
    params, ref, spec, updater = model
    cfg = _cfg()
    pool = Layout(fsdp=4).make_mesh(jax.devices()[:4])
    sh = shardings_for(logical_axes(CFG), pool, ShardingRules.train(CFG, Layout(fsdp=4)))
    params, ref = jax.device_put(params, sh), jax.device_put(ref, sh)
    groups = _groups(np.random.default_rng(3), cfg, 18)       # ~5 per micro-batch: 3 streamed, 2 on the pool
    samples = [s for g in groups for s in g]
    opt = TX.init(params)
    g_sync, p_sync, m_sync = _sync(cfg, pool, updater, params, ref, opt, samples)
    mb_rows, freed = rl.micro_batch_rows(cfg, pool, PACK_LEN), jax.devices()[6:]
    worker = TrainWorker()
    gs = GradientStream(cfg, spec, updater, pool, pack_len=PACK_LEN, mb_rows=mb_rows, executor=worker)
    st = StreamTrainer(cfg, StreamSection(enabled=True), CFG, spec, updater, pool, pack_len=PACK_LEN,
                       mb_rows=mb_rows, gs=gs)
    st.warm(params, opt, ref, devices=freed)
    p0, o0 = _copy(params), _copy(opt)
    jax.block_until_ready((p0, o0))
    counter = CompileCounter()
    st.begin(p0, ref)
    gs.target(p0, ref, gs.train_rows)                    # the train pool, from the rollout's start
    for g in groups[:3]:
        st.add_group(g)
    st.repurpose(freed)                                  # the shrink: devices 6-7 join
    for g in groups[3:]:
        st.add_group(g)
    grads, _, denominator = st.combine(p0)
    rel = _rel(jax.tree.map(lambda g: np.asarray(g, np.float64) / denominator, jax.device_get(grads)), g_sync)
    new, _, m = worker.submit("update", st.finish, p0, o0).result()
    worker.close()
    assert counter.take()["compiles"] == 0
    assert rel <= GRAD_RTOL or rel <= _floor(cfg, updater, params, ref, samples, g_sync, freed), rel
    assert [t.devices for t in gs.targets] == [4, 2]
    on_pool, on_freed = gs.counts(gs.train_rows), gs.counts(gs.targets[1].rows)
    assert on_pool[0] > 0 and on_freed[0] > 0 and m["stream/groups_early"] == on_freed[0], (on_pool, on_freed)
    assert gs.groups == len(groups) and m["stream/freed_devices"] == 2
    for key in ("loss", "kl", "entropy"):
        assert m[key] == pytest.approx(m_sync[key], rel=1e-5, abs=1e-7), key
    _assert_same_update(new, p_sync, params)


def test_streamed_blockwise_update_equals_synchronous_full(mesh, model):
    """MetroRLHF's blockwise backward as the stream trainer's gradient (`BlockwiseUpdater.accumulate`, the
    gradient-only entry point): groups computed on the freed devices 4-7 (a 4-device sub-mesh) and the rest on
    the whole mesh, one update == the synchronous full-backward update, within the blockwise tolerance
    (tests/test_blockwise.py: 1e-5 float32); its block counts reach the step's metrics; nothing compiles
    after warm()."""
    params, ref, spec, updater = model
    cfg = _cfg()
    groups = _groups(np.random.default_rng(2), cfg, 6)
    samples = [s for g in groups for s in g]
    opt = TX.init(params)
    g_sync, p_sync, m_sync = _sync(cfg, mesh, updater, params, ref, opt, samples)
    blockwise = BlockwiseUpdater(CFG, spec, TX, block_size=20)       # 48 -> 60: padded rows, 3 blocks
    mb_rows = rl.micro_batch_rows(cfg, mesh, PACK_LEN)
    st = StreamTrainer(cfg, StreamSection(enabled=True), CFG, spec, blockwise, mesh, pack_len=PACK_LEN, mb_rows=mb_rows)
    st.warm(params, opt, ref, devices=jax.devices()[4:])
    p0, o0 = _copy(params), _copy(opt)
    counter = CompileCounter()
    st.begin(p0, ref)
    st.add_group(groups[0])
    st.repurpose(jax.devices()[4:])
    for g in groups[1:]:
        st.add_group(g)
    grads, _, denominator = st.combine(p0)
    assert _rel(jax.tree.map(lambda g: np.asarray(g, np.float64) / denominator, jax.device_get(grads)), g_sync) <= 1e-5
    new, _, m = st.finish(p0, o0)
    assert counter.take()["compiles"] == 0 and m["stream/groups_early"] > 0
    n = m["blockwise/blocks"] + m["blockwise/skipped"]            # 3 blocks per micro-batch, early and late
    assert m["blockwise/blocks"] > 0 and n % 3 == 0 and n // 3 >= 2 and m["stream/samples_early"] > 0
    for key in ("loss", "kl", "entropy"):
        assert m[key] == pytest.approx(m_sync[key], rel=1e-5, abs=1e-7), key
    for s, y in zip(jax.tree.leaves(new), jax.tree.leaves(p_sync)):
        np.testing.assert_allclose(np.asarray(s), np.asarray(y), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- (2)
def _drive(svc, cfg, prompts, sampling, st=None):
    """The rollout loop a trainer runs: add every prompt, step, score each group as its last sample
    finishes and hand it to the stream trainer, report progress after every step."""
    rids = [svc.add(p, sp) for p, sp in zip(prompts, sampling)]
    group_of = {r: g for g, ids in enumerate(rids) for r in ids}
    total, done, plans = sum(map(len, rids)), {}, []
    while svc.has_work():
        for c in svc.step():
            done[c.request_id] = c
            g = group_of[c.request_id]
            if st is not None and all(r in done for r in rids[g]):
                outs = [done[r].tokens for r in rids[g]]
                st.add_group(_scored(cfg, prompts[g], outs, [np.mean(np.asarray(t) % 2 == 0) for t in outs]))
        if st is not None:
            plans.append(st.on_progress(svc, len(done), total))
    return [[done[r] for r in ids] for ids in rids], [p for p in plans if p is not None]


def test_pool_shrink_keeps_tokens_and_trains_early(mesh, model):
    params, ref, spec, updater = model
    cfg = _cfg()
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, CFG.vocab_size, rng.integers(3, 13)).tolist() for _ in range(8)]
    sampling = [SamplingParams(max_new_tokens=n, temperature=1.0, n=G, seed=7 + i)
                for i, n in enumerate((4, 6, 8, 10, 12, 14, 16, 16))]
    service = dict(tp=2, instances=4, page_size=8, num_pages=64, max_batch=8, max_seq_len=64, page_buckets=1,
                   batch_buckets_per_octave=1)          # few step shapes: few compiles
    plain, _ = _drive(RolloutService(CFG, params, **service), cfg, prompts, sampling)

    svc = RolloutService(CFG, params, **service)
    mb_rows = rl.micro_batch_rows(cfg, mesh, PACK_LEN)
    st = StreamTrainer(cfg, StreamSection(enabled=True), CFG, spec, updater, mesh, pack_len=PACK_LEN, mb_rows=mb_rows)
    p0, o0 = _copy(params), TX.init(params)
    st.warm(p0, o0, ref, svc=svc)                       # the trailing half: instances 2, 3 = devices 4-7
    st.begin(p0, ref)
    outs, plans = _drive(svc, cfg, prompts, sampling, st)
    assert [[c.tokens for c in g] for g in outs] == [[c.tokens for c in g] for g in plain]
    for a, b in zip(sum(outs, []), sum(plain, [])):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert plans and plans[-1].ok and plans[-1].freed == (2, 3)
    new, _, m = st.finish(p0, o0)
    assert m["stream/shrunk"] == 1 and 0.2 <= m["stream/shrunk_at"] <= 0.5 and m["stream/freed_devices"] == 4
    assert m["stream/groups_early"] > 0 and m["stream/moved"] > 0
    assert m["stream/groups_early"] + m["stream/groups_late"] == len(prompts)

    samples = [s for g, p in zip(outs, prompts)
               for s in _scored(cfg, p, [c.tokens for c in g], [np.mean(np.asarray(c.tokens) % 2 == 0) for c in g])]
    _, p_sync, _ = _sync(cfg, mesh, updater, params, ref, TX.init(params), samples)
    _assert_same_update(new, p_sync, params)

    # The freed instances hold nothing and serve the next step (after the weight sync).
    assert all(svc.instances[k].pool.used == 0 and not svc.instances[k].live_rids() for k in (2, 3))
    svc.update_weights(new)
    svc.add(prompts[0], SamplingParams(max_new_tokens=3, temperature=0.0), instance=3)
    assert [c.instance for c in svc.run()] == [3]


# ---------------------------------------------------------------------------------------------- (3)
def test_milestones_follow_algorithm_1():
    s = StreamSection()
    last, checks = 0, []
    for finished in (0, 4, 7, 8, 9, 10, 11, 12, 15, 19, 20, 21, 22, 40):
        if milestone_due(finished, 40, last, start=s.start, stop=s.stop, step=s.step):
            last = finished
            checks.append(finished)
    assert checks == [8, 10, 12, 15, 19]                 # 20% first, then every further 5%, none past 50%
    assert not milestone_due(3, 0, 0, start=0.2, stop=0.5, step=0.05)


def test_freed_instances_keep_tp_groups_whole():
    assert freed_instances([2, 2, 2, 2]) == (2, 3)
    assert freed_instances([4, 2, 2]) == (1, 2)
    assert freed_instances([1, 1]) == (1,)
    assert freed_instances([2, 4, 2]) is None            # half would split the TP4 group
    assert freed_instances([8]) is None


def test_projected_lengths_and_peak_pages():
    rows = [dict(prompt_len=5, generated=4, max_new_tokens=20), dict(prompt_len=5, generated=12, max_new_tokens=20),
            dict(prompt_len=2, generated=1, max_new_tokens=8)]
    history = [3, 5, 9, 12]
    assert projected_lengths(rows, projection="max").tolist() == [25, 25, 10]
    assert projected_lengths(rows, [], projection="history").tolist() == [25, 25, 10]     # no history: the cap
    # gen 4 -> median of (5, 9, 12) = 9; gen 12 -> nothing longer: the cap; gen 1 -> p50 of all = 7, <= cap 8
    assert projected_lengths(rows, history, projection="history", quantile=0.5).tolist() == [14, 25, 9]
    assert projected_lengths(rows, history, projection="history", quantile=1.0).tolist() == [17, 25, 10]
    # page 4: (ctx 4 -> 8) and (ctx 6 -> 7): after 1 step 2 + 2 pages, then the second ends: 2 pages.
    assert peak_pages([4, 6], [8, 7], 4) == 4
    assert peak_pages([4, 4], [16, 16], 4) == 8 and peak_pages([], [], 4) == 0
    assert peak_pages([9], [9], 4) == 3                  # a request about to end still holds its pages


def _rows(spec):
    """Live requests from (instance, context_len) pairs; prompt 4, cap 12 new tokens."""
    return [dict(request_id=k, instance=i, context_len=c, prompt_len=4, generated=c - 4, max_new_tokens=12)
            for k, (i, c) in enumerate(spec)]


def test_plan_shrink_rule():
    instances = [(0, 2, 12), (1, 2, 12), (2, 2, 12), (3, 2, 12)]         # (index, tp, pages)
    rows = _rows([(0, 6), (1, 6), (2, 6), (3, 6), (3, 8)])
    final = np.full(len(rows), 16)                                        # 4 pages each at the end
    plan = plan_shrink(rows, final, instances, page_size=4, kv_fraction=0.5)
    assert plan.ok and plan.freed == (2, 3) and plan.peak_pages == 20 and plan.budget_pages == 24
    assert sorted(r for rids in plan.moves.values() for r in rids) == [2, 3, 4]
    assert {i: len(r) for i, r in plan.moves.items()} == {0: 2, 1: 1}     # the least filled instance first
    seven = _rows([(k % 4, 6) for k in range(7)])
    big = plan_shrink(seven, np.full(7, 16), instances, page_size=4, kv_fraction=0.5)
    assert not big.ok and "projected peak 28 pages > 24" in big.reason
    # The pool fits the total (kv_fraction 1) but the two remaining instances cannot hold it.
    tight = plan_shrink(seven, np.full(7, 16), instances, page_size=4, kv_fraction=1.0)
    assert not tight.ok and "instance 0: projected peak 16 pages > its 12" in tight.reason and not tight.moves
    odd = plan_shrink(rows, final, [(0, 2, 12), (1, 4, 12), (2, 2, 12)], page_size=4, kv_fraction=0.5)
    assert not odd.ok and "half of the rollout devices" in odd.reason
    # StreamRL's classes (instance 0 long, the rest regular): the freed regular instances' requests all go to
    # instance 1, the one kept regular instance, though instance 0 is less filled; with instance 3 long too,
    # its requests go to instance 0, the kept long one.
    roomy = [(k, 2, 24) for k in range(4)]
    classes = {0: "long", 1: "regular", 2: "regular", 3: "regular"}
    kept = plan_shrink(rows, final, roomy, page_size=4, kv_fraction=1.0, classes=classes)
    assert kept.ok and kept.moves == {1: [2, 3, 4]}
    assert plan_shrink(rows, final, roomy, page_size=4, kv_fraction=1.0).moves == {0: [2, 4], 1: [3]}
    classes[3] = "long"
    mixed = plan_shrink(rows, final, roomy, page_size=4, kv_fraction=1.0, classes=classes)
    assert mixed.ok and mixed.moves == {1: [2], 0: [3, 4]}


# ---------------------------------------------------------------------------------------------- (4)
@pytest.mark.parametrize("key,cfg", [
    ("algo.mini_batches", dict(algo=AlgoSection(mini_batches=2))),
    ("algo.advantage", dict(algo=AlgoSection(advantage="reinforce_pp"))),
    ("trainer.micro_batch_tokens", dict(trainer=TrainerSection(micro_batch_tokens=None))),
    ("engine.instances", dict(engine=TrainEngineSection(instances=3))),
    ("engine.instances", dict(engine=TrainEngineSection(instances=1))),
])
def test_refusals_name_the_key(key, cfg):
    cfg = TrainConfig(**{"engine": TrainEngineSection(instances=2), **cfg})
    with pytest.raises(ConfigError) as e:
        check_stream(StreamSection(enabled=True), cfg)
    assert e.value.key == key
    check_stream(StreamSection(enabled=False), cfg)                       # off: nothing to refuse


def test_stream_section_validation():
    for kw, key in ((dict(start=0.6, stop=0.5), "start"), (dict(step=0.0), "step"),
                    (dict(kv_fraction=1.5), "kv_fraction"), (dict(projection="mean"), "projection"),
                    (dict(history=0), "history"), (dict(enabled=1), "enabled")):
        with pytest.raises(ConfigError) as e:
            StreamSection(**kw)
        assert e.value.key == key
    with pytest.raises(ConfigError, match="algo.mini_batches"):
        StreamTrainer(TrainConfig(algo=AlgoSection(mini_batches=2), engine=TrainEngineSection(instances=2)),
                      StreamSection(enabled=True), CFG, None, None, None, pack_len=PACK_LEN, mb_rows=8)
