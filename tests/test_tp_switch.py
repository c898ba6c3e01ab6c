"""PAT switches mid-generation through the controller (`jaxrl.rollout.tp_switch.AdaptiveTP`): synthetic
profiles force tp2x4 -> tp8x1, tp1x8 -> tp4x2 -> tp8x1 and tp8x1 -> tp2x4; the tokens equal a static
layout's and the log-probs are within the float32 tolerance, for greedy and seeded sampling, with the KV
migrated and recomputed. Every decision is recorded with its measured times."""

import pytest

from jaxrl.rollout import RolloutService
from jaxrl.rollout.adaptive_tp import Predictor, SwitchController
from jaxrl.rollout.tp_switch import AdaptiveTP
from tests.pat_profiles import forcing_profile
from tests.test_movable_state import (CFG, GREEDY, SAMPLED, SERVICE, _run, _same, prompts, static,  # noqa: F401
                                      weights)


def _adaptive(prefer, candidates, kv):
    return AdaptiveTP(SwitchController(Predictor(forcing_profile(prefer)), candidates, 8, kv=kv), check_every=3)


@pytest.mark.parametrize("case", [
    ("tp2x4->tp8x1", (2, 4), "large", [2, 8], "migrate", "sampled", {}),
    ("tp1x8->tp4x2->tp8x1", (1, 8), "large", [1, 4], "recompute", "greedy",
     {4: lambda s: setattr(s.adaptive.controller, "candidates", [4, 8])}),
    ("tp8x1->tp2x4", (8, 1), "small", [2, 8], "recompute", "sampled", {}),
], ids=lambda c: c[0])
def test_forced_switches_keep_tokens(weights, prompts, static, case):  # noqa: F811
    name, (tp, n), prefer, candidates, kv, kind, moves = case
    svc = RolloutService(CFG, weights, tp=tp, instances=n, **SERVICE)
    svc.adaptive = _adaptive(prefer, candidates, kv)
    outs = _run(svc, prompts, SAMPLED if kind == "sampled" else GREEDY, moves)
    _same(outs, static[kind])
    path = [int(s.split("x")[0][2:]) for s in name.split("->")]
    switches = [d for d in svc.adaptive.decisions if d.switch]
    assert [d.current for d in switches] + [switches[-1].tp] == path
    assert svc.layout == [path[-1]] * (8 // path[-1])
    for d in switches:
        assert d.kv == kv and d.actual["switch_s"] > 0 and d.actual["moved"] > 0
        assert d.actual["remaining_s"] >= d.actual["switch_s"]   # closed when the generation ended: after the switch
    m = svc.adaptive.metrics()
    assert m["pat/switches"] == len(path) - 1 and m["pat/decisions"] >= len(path) - 1
    assert all("t0" not in r["actual"] for r in svc.adaptive.records())


def test_no_switch_when_the_current_layout_is_best(weights, prompts, static):  # noqa: F811
    """Negative control on the real engine: a profile favouring small TP never leaves tp1x8."""
    svc = RolloutService(CFG, weights, tp=1, instances=8, **SERVICE)
    svc.adaptive = _adaptive("small", [1, 2, 4, 8], "auto")
    outs = _run(svc, prompts, GREEDY, {})
    _same(outs, static["greedy"])
    assert svc.adaptive.decisions and not any(d.switch for d in svc.adaptive.decisions)
    assert svc.layout == [1] * 8


def test_train_run_switches_and_returns_home(tmp_path):
    """`python -m jaxrl.train` with engine.adaptive_tp on a forcing profile: every step starts on the
    configured tp1x4, switches to tp4x1 mid-rollout (the quickstart model's 4 heads allow no TP 8; 4 devices, not
    8: a 4-device run costs ~2/3 of the CPU), and is brought back before the next one (the weight sync);
    every candidate layout is compiled in the warm-up, so the steps compile nothing (with kv=recompute: the
    migration's page-staging executables compile on first use of each page-count bucket)."""
    import json

    from tests.train_runs import _metrics, _train

    prof = forcing_profile("large")
    prof.key["devices"] = 4
    prof.save(tmp_path / "prof.json")
    run = tmp_path / "run"
    _train(run, "steps=2", "save_every=null", "trainer.warmup=true", "engine.tp=1", "engine.instances=4",
           "train_layout.fsdp=4", "engine.batch_buckets_per_octave=1", "engine.page_buckets=2",  # fewer to warm
           "engine.adaptive_tp.enabled=true", f"engine.adaptive_tp.profile={tmp_path / 'prof.json'}",
           "engine.adaptive_tp.candidates=[1, 4]", "engine.adaptive_tp.check_every=4",
           "engine.adaptive_tp.kv=recompute", "engine.adaptive_tp.warm=true")
    rows = _metrics(run)
    assert [r["pat/switches"] for r in rows] == [1, 1] and all(r["pat/max_tp"] == 4 for r in rows)
    assert rows[1]["compiles"] == 0
    recs = [json.loads(line) for line in (run / "pat_decisions.jsonl").read_text().splitlines()]
    firsts = [next(r for r in recs if r["rl_step"] == s) for s in (0, 1)]
    assert [r["current"] for r in firsts] == [1, 1] and all(r["tp"] == 4 and r["switch"] for r in firsts)
    assert all("remaining_s" in r["actual"] for r in recs)


def _decode_keys(tp):
    """The cached decode executables whose inputs live on a TP-`tp` mesh."""
    from jaxrl.rollout import CACHE

    def mesh_tp(key):
        sig = key[3][1]
        return next(e[2][0].shape["tp"] for e in sig if len(e) == 3 and isinstance(e[2], tuple))
    return {k for k in list(CACHE._table) if k[0] == "decode" and mesh_tp(k) == tp}


def test_background_compile_makes_the_switch_compile_no_decode_step(weights, prompts, static):  # noqa: F811
    """First sight of TP 4 (a generation whose profile never switches) starts a background compile of its
    small decode buckets; the next generation switches tp1x8 -> tp4x2 and compiles no decode step (the
    controller counted its compile cost as 0), with the static layout's tokens."""
    from jaxrl.rollout import CACHE
    from jaxrl.rollout.precompile import Precompiler

    CACHE.clear()
    pre = Precompiler(fraction=0.025)               # 6 live sequences: rows buckets up to 8 of 256
    svc = RolloutService(CFG, weights, tp=1, instances=8, **SERVICE)
    svc.adaptive = AdaptiveTP(SwitchController(Predictor(forcing_profile("small")), [1, 4], 8), check_every=3,
                              precompile=pre)
    _same(_run(svc, prompts, GREEDY, {}), static["greedy"])
    assert svc.layout == [1] * 8 and len(pre.threads) == 1           # requested once, at first sight
    pre.wait()
    assert pre.compiled > 0 and pre.ready(4, 1)
    before = _decode_keys(4)
    assert before
    prof = forcing_profile("large")
    prof.layouts[4].compile_seconds = 5.0
    svc.adaptive = AdaptiveTP(SwitchController(Predictor(prof), [1, 4], 8, kv="migrate"), check_every=3,
                              precompile=pre)
    _same(_run(svc, prompts, GREEDY, {}), static["greedy"])
    d = next(d for d in svc.adaptive.decisions if d.switch)
    assert d.tp == 4 and next(c for c in d.candidates if c.tp == 4).compile_s == 0.0
    assert _decode_keys(4) == before                                  # nothing compiled on the switch's path
