"""StreamRL disaggregation pieces: device pools, the train worker, streamed gradients on it (equal to the
inline stream), the one-step-async buffer and staleness, stage balancing and the dynamic scale-up."""

import dataclasses
import json
import time

import jax
import numpy as np
import pytest

from jaxrl.config.placement import StageBalanceSection
from jaxrl.rollout import Completion, RolloutService, SamplingParams
from jaxrl.rollout.tail_batching import RoundPlan
from jaxrl.train.balance import ScaleUp, best_split, scale_up_due, scaled, searched_split
from jaxrl.train.pipeline import Prefetched, Timeline, TrainWorker, check_staleness, split_devices
from models import PRESETS, init


def test_split_devices_gives_disjoint_pools():
    train, gen, spare = split_devices(train_size=4, gen_per_process=2, spare_per_process=2)
    ids = [d.id for d in train + gen + spare]
    assert len(set(ids)) == 8 and [d.id for d in train] == [0, 1, 2, 3] and [d.id for d in gen] == [4, 5]
    with pytest.raises(ValueError, match="needs 4 for training"):
        split_devices(train_size=4, gen_per_process=4, spare_per_process=1)


def test_train_worker_runs_in_order_and_records_spans():
    """Tasks run one at a time in submission order; each span covers its task (here a 10 ms sleep); the
    worker's busy seconds and the timeline's spans, kept apart, add up to the same, within the wall time."""
    nap = 0.01
    tl = Timeline()
    w = TrainWorker(tl)
    order = []
    t0 = time.perf_counter()
    futs = [w.submit("grad", lambda k=k: order.append(k) or time.sleep(nap) or jax.numpy.ones(3) * k)
            for k in range(5)]
    w.barrier()
    assert order == list(range(5)) and all(f.done() for f in futs)
    inner = w.submit("update", lambda: w.barrier() or 7)      # a barrier inside a task does not deadlock
    assert inner.result(timeout=30) == 7
    busy = w.take_busy()
    wall = time.perf_counter() - t0
    spans = tl.spans
    assert [s.kind for s in spans] == ["grad"] * 5 + ["update"]
    assert all(s.end - s.start >= nap for s in spans[:5])                      # each span holds its task
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))              # one at a time, in order
    assert t0 - tl.t0 <= spans[0].start and spans[-1].end <= t0 - tl.t0 + wall
    assert busy == pytest.approx(tl.busy("train"), rel=1e-9) and 5 * nap <= busy <= wall
    assert tl.busy("gen") == 0 and w.busy_s == 0 and w.take_busy() == 0         # read and reset
    w.close()


def test_staleness_is_checked():
    assert check_staleness(3, [3, 3], 1) == 0 and check_staleness(3, [2], 1) == 1 and check_staleness(3, [1], 2) == 2
    with pytest.raises(RuntimeError, match="staleness 2 .must be 0..1"):
        check_staleness(3, [1], 1)
    with pytest.raises(RuntimeError, match="staleness -1"):
        check_staleness(3, [4], 2)          # a sample from the future


def test_prefetched_round_trips():
    c = Completion(5, [1, 2], [3, 4, 5], [-0.5, -1.0, -2.0], "stop", 1, 0, versions=[(0, 2), (2, 3)])
    p = Prefetched(4, 3, [{"index": 7, "prompt": "x", "answer": "y", "task": "copy"}], [c],
                   np.asarray([0.25], np.float32), {"items": 1, "rollout_s": 0.5, "accepted": [0]})
    q = Prefetched.from_state(p.state_dict())
    assert (q.step, q.version, q.rows, q.stats, q.plan) == (4, 3, p.rows, p.stats, None)
    assert q.completions[0] == c and q.rewards.tolist() == [0.25]
    # tail batching's round plan and the rollout side's metrics (one-step-async with tail batching, the planner)
    p.plan = RoundPlan("short", p.rows, 5, 4, 8, [0])
    p.stats["mechanisms"] = {"tail/queue_len": 4, "planner/tp": np.int64(2), "pat/switch_s": 0.5}
    q = Prefetched.from_state(json.loads(json.dumps(p.state_dict())))
    assert q.plan == p.plan and q.stats["mechanisms"] == {"tail/queue_len": 4, "planner/tp": 2, "pat/switch_s": 0.5}
    assert type(q.stats["mechanisms"]["planner/tp"]) is int


def test_best_split_minimises_the_slower_stage():
    tg, tt = scaled(40.0, 1), scaled(10.0, 1)      # generation 4x the training work
    x, y, table = best_split(8, 2, [1, 2, 4], tg, tt)
    assert (x, y) == (6, 2)                          # max(40/6, 10/2) = 6.67: the best of every split
    assert min(t for _, _, t in table) == pytest.approx(max(40 / 6, 10 / 2))
    assert all(a + b <= 8 and a % 2 == 0 for a, b, _ in table)
    with pytest.raises(ValueError):
        best_split(2, 4, [1], tg, tt)


def test_searched_split_equals_the_full_enumeration_in_few_evaluations():
    """On random monotone stage-time curves (a generation time that stops falling, as a long tail makes it, or
    one falling as work / devices; a train time falling as work / devices, with plateaus from rounding), every
    gen unit and train-size set: searched_split's (x, y) is best_split's over every x, and it evaluated T_g
    at no more than 2 log2(candidates) + 3 points."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        total = int(rng.choice([8, 16, 32, 64, 128]))
        unit = int(rng.choice([1, 2, 4, 8]))
        sizes = ([2 ** k for k in range(total.bit_length()) if 2 ** k < total] if trial % 2 else
                 list(range(unit, total, unit)))
        if not sizes or total - min(sizes) < unit:
            continue
        floor, work = rng.uniform(1, 50), rng.uniform(10, 5000)
        drops = np.round(np.sort(rng.uniform(0, 5, total + 1))[::-1]) * (trial % 4 > 0)   # nonincreasing, in steps
        t_gen = lambda x, f=floor, w=work, d=drops: max(f, round(w / x, 1)) + float(d[x])
        t_train = lambda y, w=rng.uniform(10, 5000): round(w / y, 2) if trial % 3 else w / y
        calls = []
        x, y, table, seen = searched_split(total, unit, sizes, lambda n: calls.append(n) or t_gen(n), t_train)
        assert (x, y) == best_split(total, unit, sizes, t_gen, t_train)[:2], trial
        candidates = len(range(unit, total - min(sizes) + 1, unit))
        assert len(set(calls)) == len(calls) == len(seen) <= 2 * np.log2(max(candidates, 2)) + 3
        assert {a for a, _, _ in table} == set(seen) and x in seen
    with pytest.raises(ValueError):
        searched_split(2, 4, [1], t_gen, t_train)


def test_scale_up_rule():
    assert scale_up_due(10.0, 2.0, 1) == (True, 8.0, 5.0)       # delta 8 >= 10/2
    assert scale_up_due(10.0, 8.0, 1)[0] is False                # delta 2 < 5
    assert scale_up_due(10.0, 2.0, 4)[0] is True                  # delta 8 >= 2
    assert scale_up_due(0.0, 0.0, 1)[0] is False


def test_scale_up_grows_the_generation_pool_by_one_instance():
    cfg = PRESETS["tiny-qwen3"]
    weights = init(jax.random.key(0), cfg)
    svc = RolloutService(cfg, weights, tp=1, instances=1, devices=jax.devices()[:3], page_size=8, num_pages=32,
                         max_seq_len=40, max_batch=8)
    up = ScaleUp(StageBalanceSection(scale_up=True, max_instances=2), tp=1)
    m = up.step(svc, t_gen=10.0, t_train=1.0, params=weights)
    assert m["placement/scaled_up"] == 1 and len(svc.instances) == 2
    assert up.step(svc, t_gen=10.0, t_train=1.0, params=weights)["placement/scaled_up"] == 0   # at max_instances
    assert up.step(svc, t_gen=1.0, t_train=10.0, params=weights)["placement/delta_s"] == -9.0
    p = SamplingParams(max_new_tokens=6, temperature=0.0)
    rids = [svc.add([1, 2, 3], p, instance=i)[0] for i in range(2)]
    outs = {c.request_id: c.tokens for c in svc.stream()}
    assert outs[rids[0]] == outs[rids[1]]          # the new instance holds the same weights


def test_gradient_stream_on_the_worker_equals_inline():
    """The same groups through the train worker's thread give bitwise the same sums as inline."""
    from jaxrl.config.train import AlgoSection, TrainConfig
    from jaxrl.train.batch import Sample
    from jaxrl.train.grad_stream import GradientStream
    from jaxrl.train.optim import make_optimizer
    from jaxrl.train.step import LossSpec
    from jaxrl.train.update import Updater
    from sharding import Layout, ShardingRules, shardings_for
    from models import logical_axes

    cfg_m = PRESETS["tiny-qwen3"]
    cfg = TrainConfig(algo=AlgoSection(group_size=2))
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_new_tokens=8))
    mesh = Layout(fsdp=2).make_mesh(jax.devices()[:2])
    sh = shardings_for(logical_axes(cfg_m), mesh, ShardingRules.train(cfg_m, Layout(fsdp=2)))
    params = init(jax.random.key(1), cfg_m, shardings=sh)
    spec = LossSpec.from_config(cfg.algo, temperature=1.0, trainer=cfg.trainer)
    tx, _ = make_optimizer(cfg.optim, 1)
    updater = Updater(cfg_m, spec, tx)
    rng = np.random.default_rng(0)
    groups = [[Sample(rng.integers(1, 90, 5).tolist(), rng.integers(1, 90, int(n)).tolist(), float(a))
               for n, a in zip(rng.integers(1, 8, 2), rng.standard_normal(2))] for _ in range(6)]
    sums = []
    for executor in (None, TrainWorker()):
        gs = GradientStream(cfg, spec, updater, mesh, pack_len=16, mb_rows=2, executor=executor)
        gs.begin(None)
        gs.target(params, None, gs.train_rows)
        for g in groups:
            gs.add(g)
        grads, stats, d = gs.combine(params)
        sums.append((jax.device_get(grads), jax.device_get(stats), d, gs.micro_batches_early))
        if executor is not None:
            executor.close()
    assert sums[0][2] == sums[1][2] and sums[0][3] == sums[1][3] > 0
    for a, b in zip(jax.tree.leaves(sums[0][:2]), jax.tree.leaves(sums[1][:2])):
        np.testing.assert_array_equal(a, b)


def test_split_from_a_runs_stage_times(tmp_path):
    """The static split from measured stage times: generation 3x the training work on 4 + 4 devices."""
    import json

    from jaxrl.config import to_yaml
    from jaxrl.config.train import TrainConfig
    from jaxrl.train.balance import main, split_from_run

    (tmp_path / "config.yaml").write_text(to_yaml(TrainConfig(placement="disaggregated")))
    rows = [{"step": k, "rollout_s": 3.0, "train_s": 9.0, "placement/t_train_s": 1.0, "placement/gen_devices": 4,
             "placement/train_devices": 4} for k in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = split_from_run(tmp_path, 8)
    # T_g(x) = 12/x, T_t(y) = 4/y: x=6, y=2 gives max(2, 2) = 2, the best of every split
    assert (got["gen_devices"], got["train_devices"], got["engine.instances"]) == (6, 2, 6)
    assert got["predicted_s"] == pytest.approx(2.0)
    assert main([str(tmp_path), "8"]) == 0 and main([str(tmp_path)]) == 2


@pytest.mark.parametrize("args, match", [
    (["trainer.max_staleness=1"], "needs placement=disaggregated"),
    (["trainer.max_staleness=-1", "placement=disaggregated"], "must be >= 0"),
    (["placement=sideways"], "valid choices"),
    (["placement=disaggregated", "trainer.stream.enabled=true", "engine.instances=2", "trainer.max_staleness=1"],
     "trained at the weights of later updates"),
    (["placement=disaggregated", "trainer.micro_batch_tokens=null"], "fixed-shape"),
    (["placement=disaggregated", "stage_balance.scale_up=true"], "spare devices"),
    (["placement=disaggregated", "trainer.max_staleness=1", "trainer.backward=blockwise", "trainer.kv_source=rollout"],
     "another policy's"),
    (["stage_balance.scale_up=true", "stage_balance.max_instances=2"], "needs placement=disaggregated"),
])
def test_placement_config_refusals(args, match):
    from jaxrl.config.base import ConfigError
    from jaxrl.config.loading import load_config
    from jaxrl.config.train import TrainConfig

    with pytest.raises(ConfigError, match=match):
        load_config(TrainConfig, args)
