"""DistFlow (`jaxrl.flow`): graph checks, the planner, the registry and the databuffer.

End-to-end runs of graphs (the default graph against the trainer it replaced, a custom node by import
path) are in test_train_e2e.py; several processes with the token-balanced repartition in
test_train_processes.py."""

import dataclasses
import random
import textwrap
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import yaml

from jaxrl.config.train import TrainConfig
from jaxrl.flow import (Databuffer, GraphError, StepData, builtin_graphs, load_graph, padding, parse_graph, plan,
                        plan_contiguous, plan_tokens)
from jaxrl.flow.databuffer import decode, encode, is_identity
from jaxrl.flow.registry import bind, resolve
from jaxrl.flow.runner import Flow
from jaxrl.train.batch import Sample

BASE = [{"id": "rollout", "role": "actor", "type": "model_inference"},
        {"id": "reward", "role": "reward", "type": "compute", "deps": ["rollout"], "stream": ["rollout"]},
        {"id": "advantage", "role": "advantage", "type": "compute", "deps": ["reward"]},
        {"id": "update", "role": "actor", "type": "model_train", "deps": ["advantage"]}]


def graph(nodes):
    return parse_graph({"name": "t", "nodes": nodes})


def edit(**changes):
    """BASE with node `id` replaced by `changes[id]` (None: removed); other keys add nodes."""
    nodes = [dict(n) for n in BASE]
    out = []
    for n in nodes:
        if n["id"] in changes:
            if changes[n["id"]] is not None:
                out.append({**n, **changes[n["id"]]})
        else:
            out.append(n)
    out += [dict(v, id=k) for k, v in changes.items() if k not in {n["id"] for n in nodes}]
    return out


@pytest.mark.parametrize("nodes, message", [
    (edit(update={"deps": ["nope"]}), "node 'update' depends on 'nope', which is not a node"),
    (edit(advantage={"deps": ["reward", "update"]}), "cycle"),
    (edit(reward={"type": "infer"}), "node 'reward': unknown type 'infer'"),
    (edit(extra={"role": "judge", "type": "compute", "deps": ["reward"]}), "node 'extra': role 'judge' is not built in"),
    (edit(update=None), "missing required node: role actor, type model_train"),
    (edit(rollout={"role": "critic"}), "missing required node: role actor, type model_inference"),
    (edit(advantage={"stream": ["rollout"]}), "node 'advantage': stream edge from 'rollout' is not one of its deps"),
    (BASE + [dict(BASE[0])], "node 'rollout' is defined twice"),
    (edit(update={"colour": "red"}), "node 'update': unknown key(s) ['colour']"),
])
def test_graph_errors_name_the_node(nodes, message):
    with pytest.raises(GraphError) as e:
        graph(nodes)
    assert message in str(e.value)


def test_cycle_is_reported_with_its_path():
    with pytest.raises(GraphError, match=r"cycle (advantage -> update -> advantage|update -> advantage -> update)"):
        graph(edit(advantage={"deps": ["reward", "update"]}))


def test_planner_is_deterministic_and_serialises_same_depth_nodes():
    nodes = edit(reference={"role": "reference", "type": "model_inference", "deps": ["rollout"]},
                 zeta={"role": "filter", "type": "compute", "deps": ["rollout"], "fn": "drop_equal_groups"},
                 update={"deps": ["advantage", "reference", "zeta"]})
    plans = set()
    for seed in range(6):          # the file's node order does not matter
        shuffled = list(nodes)
        random.Random(seed).shuffle(shuffled)
        plans.add(tuple(tuple(n.id for n in s.nodes) for s in plan(graph(shuffled)).stages))
    assert plans == {(("rollout", "reward"), ("reference",), ("zeta",), ("advantage",), ("update",))}
    p = plan(graph(nodes))
    assert p.stages[0].pipelined and p.streamed("reward") and not p.streamed("advantage")
    assert p.describe().splitlines()[0] == "1. rollout => reward (pipelined)"


def test_streamed_consumer_with_a_late_dependency_is_refused():
    nodes = edit(side={"role": "reference", "type": "model_inference", "deps": ["rollout"]},
                 advantage={"deps": ["reward", "side"], "stream": ["reward"]})
    with pytest.raises(GraphError, match="node 'advantage' streams from .* also depends on 'side'"):
        plan(graph(nodes))


def test_builtin_graphs_resolve_against_the_config():
    assert set(builtin_graphs()) >= {"grpo", "dapo", "rloo", "reinforce_pp"}
    for name in builtin_graphs():
        g = load_graph(name)
        assert "reference" not in plan(g.resolve(TrainConfig())).order       # kl_coef 0: no reference pass
        with_kl = plan(g.resolve(TrainConfig(algo=dataclasses.replace(TrainConfig().algo, kl_coef=0.1))))
        assert with_kl.order.index("reference") < with_kl.order.index("update")
    assert plan(load_graph("dapo").resolve(TrainConfig())).order == ["rollout", "reward", "filter", "advantage",
                                                                     "update"]


def test_streamed_update_fuses_the_chain_into_one_stage():
    cfg = TrainConfig()
    flow = Flow.build(cfg, streamed_update=True)
    assert [[n.id for n in s.nodes] for s in flow.plan.stages] == [["rollout", "reward", "advantage", "update"]]
    with pytest.raises(GraphError, match="node 'filter' is a stream consumer"):     # a batch node cannot stream
        Flow.build(dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, graph="dapo")), streamed_update=True)


def test_graph_and_config_must_agree():
    cfg = TrainConfig(algo=dataclasses.replace(TrainConfig().algo, graph="rloo"))
    with pytest.raises(GraphError, match="computes rloo advantages but algo.advantage=grpo"):
        Flow.build(cfg)
    assert Flow.build(dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, advantage="rloo"))).plan
    with pytest.raises(GraphError, match="neither a built-in graph"):
        Flow.build(dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, graph="ppo2")))


def test_user_node_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_nodes.py").write_text(textwrap.dedent("""
        def keep_first(ctx, data, groups: int = 1):
            data.keep_groups([g < groups for g in range(data.groups)])

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    node = graph(edit(pick={"role": "filter", "type": "compute", "deps": ["reward"], "fn": "my_nodes:keep_first",
                            "options": {"groups": 2}}, advantage={"deps": ["pick"]})).node("pick")
    fn = resolve(node)
    data = StepData(0, rows=[{"i": i} for i in range(3)], prompts=[[i] for i in range(3)], group_size=2,
                    completions=[SimpleNamespace(tokens=[i] * i) for i in range(6)], rewards=np.arange(6, dtype=np.float32))
    fn(None, data, **node.options)
    assert data.lens == [0, 1, 2, 3] and data.rows == [{"i": 0}, {"i": 1}]
    assert data.rewards.tolist() == [0, 1, 2, 3]
    for bad, message in [("my_nodes:nope", "has no 'nope'"), ("no_such_module:f", "cannot import 'no_such_module'"),
                         ("my_nodes:NOT_CALLABLE", "is not callable"), ("keep_first", "is not a registered node")]:
        with pytest.raises(GraphError, match=message):
            resolve(dataclasses.replace(node, fn=bad))
    with pytest.raises(GraphError, match="cannot be called as fn"):       # an option the function does not take
        resolve(dataclasses.replace(node, options={"colour": 1}))
    g = graph(edit(pick={"role": "filter", "type": "compute", "deps": ["reward"], "stream": ["reward"],
                         "fn": "my_nodes:keep_first"}, advantage={"deps": ["pick"]}))
    with pytest.raises(GraphError, match="'pick' is a stream consumer"):
        bind(g, {"pick"})


def test_graph_file_from_yaml(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump({"name": "mine", "nodes": BASE}))
    assert load_graph(str(path)).name == "mine"
    path.write_text("nodes: [1, 2")
    with pytest.raises(GraphError, match="not valid YAML"):
        load_graph(str(path))


# ------------------------------------------------------------------------------------------- databuffer
def rows_of(counts, width=3):
    """Source group g's rows: sample k (global index) holds [k, k, k] in every column."""
    start = np.concatenate([[0], np.cumsum(counts)])
    return {g: np.repeat(np.arange(start[g], start[g + 1], dtype=np.int32)[:, None], width, axis=1)
            for g in range(len(counts))}


@pytest.mark.parametrize("counts, n_dst", [([8, 8], 4), ([4, 4, 4, 4], 2), ([3, 7], 4), ([5, 0, 2, 9], 2),
                                           ([1, 2, 3, 4, 5, 6, 7, 8], 8)])
def test_repartition_moves_every_sample_once_in_order(counts, n_dst):
    buf = Databuffer(jax.devices(), len(counts), n_dst)
    p = plan_contiguous(counts, n_dst)
    moved = buf.move({"x": rows_of(counts)}, counts, p)
    got = [moved.rows[q]["x"][:, 0].tolist() for q in range(n_dst)]
    assert got == p and sum(got, []) == list(range(sum(counts)))          # each exactly once, global order kept
    assert all((moved.rows[q]["x"] == np.asarray(p[q])[:, None]).all() for q in range(n_dst))
    assert moved.bytes_moved > 0


def test_fast_path_and_byte_counts():
    counts = [4, 4]
    assert is_identity(counts, plan_contiguous(counts, 2))
    moved = Databuffer(jax.devices(), 2, 2).move({"x": rows_of(counts)}, counts, plan_contiguous(counts, 2))
    assert moved.bytes_moved == 0 and moved.bytes_into_first == 0
    # 2 -> 2 with the first group's last sample moved to the second: 12 bytes (3 int32) moved, none into group 0
    moved = Databuffer(jax.devices(), 2, 2).move({"x": rows_of(counts)}, counts, [[0, 1, 2], [3, 4, 5, 6, 7]])
    assert (moved.bytes_moved, moved.bytes_into_first) == (12, 0)
    assert moved.rows[1]["x"][:, 0].tolist() == [3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="exactly once"):
        Databuffer(jax.devices(), 2, 2).move({"x": rows_of(counts)}, counts, [[0, 1, 2], [2, 4, 5, 6, 7]])


def test_token_balanced_plan_cuts_padding_on_a_long_tail():
    rng = np.random.default_rng(0)
    short = [int(x) for x in rng.integers(20, 60, 48)]
    tail = [int(x) for x in rng.integers(200, 256, 16)]          # one process drew every long response
    by_proc = [short[:16] + tail, short[16:32], short[32:], []]
    every = sum(by_proc, [])
    p = plan_tokens(every, 4)
    assert sorted(sum(p, [])) == list(range(len(every))) and all(q == sorted(q) for q in p)
    before, after = padding(by_proc, 256), padding([[every[i] for i in q] for q in p], 256)
    assert after < 0.5 * before, (before, after)
    loads = [sum(every[i] for i in q) for q in p]
    assert max(loads) - min(loads) <= max(every)
    home = np.repeat(np.arange(4), [len(x) for x in by_proc])
    moves = plan_tokens(every, 4, home=home, tolerance=256)           # from where the samples are: few of them move
    assert sorted(sum(moves, [])) == list(range(len(every))) and all(q == sorted(q) for q in moves)
    assert padding([[every[i] for i in q] for q in moves], 256) < 0.5 * before
    assert sum(home[i] != q for q, idx in enumerate(moves) for i in idx) <= len(tail)
    even = [short[:16], short[16:32], short[32:48]]      # already balanced: nothing moves (the fast path)
    assert is_identity([16] * 3, plan_tokens(sum(even, []), 3, home=np.repeat(np.arange(3), 16),
                                                tolerance=256))


def test_samples_survive_the_move():
    rng = np.random.default_rng(1)
    samples = [Sample([int(t) for t in rng.integers(0, 50, rng.integers(1, 6))],
                      [int(t) for t in rng.integers(0, 50, rng.integers(1, 9))], 0.0, None, 3) for _ in range(6)]
    for s in samples:
        s.advantage = rng.standard_normal(len(s.response)).astype(np.float32)
        s.logprobs = [float(x) for x in rng.standard_normal(len(s.response)).astype(np.float32)]
    samples[2].logprobs = None
    fields = encode(samples, 16, 0)
    back = decode({k: v[0] for k, v in fields.items()})
    for a, b in zip(samples, back, strict=True):
        assert (a.prompt, a.response, a.logprobs, a.version) == (b.prompt, b.response, b.logprobs, b.version)
        np.testing.assert_array_equal(a.advantage, b.advantage)


def test_keep_groups_keeps_every_per_sample_field_aligned():
    comps = [SimpleNamespace(tokens=[0] * i) for i in range(6)]
    data = StepData(0, rows=[0, 1, 2], prompts=[[0], [1], [2]], completions=comps,
                    rewards=np.arange(6.0), group_size=2, samples=list("ABCDEF"), advantages=list("uvwxyz"))
    data.cache["mbs"] = "stale"
    assert data.keep_groups([True, False, True]) == 1
    assert (data.rows, data.lens, data.samples, data.advantages) == ([0, 2], [0, 1, 4, 5], list("ABEF"), list("uvyz"))
    assert data.rewards.tolist() == [0, 1, 4, 5] and not data.cache
    assert data.extra["rollout"][0].tolist() == list(range(6))      # the step's metrics still see every rollout
    assert data.extra["rollout"][1] == list(range(6))
