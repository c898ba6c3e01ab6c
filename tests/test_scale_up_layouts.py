"""StreamRL's scale-up with the mechanisms that set the generation layout: scale-up decides how many devices
generate (one more instance of engine.tp between steps), PAT how the pool's devices are grouped mid-rollout,
RollPacker's planner the TP of the next round over the pool. The rollout side owns the pool a rollout starts
on (`RolloutSide.instances`, grown by `RolloutSide.grow`), so PAT's switches and the planner's layouts spread
over the grown pool; the grown count is checkpointed.

Scale-up's rule is forced due here (its rule is tests/test_pipeline.py's; only who owns the layout is under
test)."""

import contextlib
import io
import json

import pytest

from jaxrl.train import balance
from jaxrl.train.__main__ import main
from tests.pat_profiles import forcing_profile
from tests.train_runs import POOLS, ROLLOUT_KEYS, _command, _metrics, _same_weights, _train


def _due(t_gen, t_train, k):        # (tests/forced_scale_up.py's, for runs in processes of their own)
    return True, t_gen - t_train, t_gen / (k + 1)


def test_pat_switches_on_the_pool_scale_up_grew(tmp_path, monkeypatch):
    """Disaggregated, TP2 x 1 instance with one spare group (max_instances=2), PAT on a profile that prefers
    TP1: after step 0 the pool grows to TP2 x 2, step 1's switch goes to TP1 x 4 (the grown pool's 4
    devices, not the configured 2), and it comes home to TP2 x 2 (not the configured TP2 x 1, which would let
    scale-up grow again every step), and nothing compiles after step 0 (the warm-up compiled PAT's
    layouts on the grown pool; kv=recompute, as in tests/test_tp_switch.py: a migration compiles its page-staging
    programs on first use of each page-count bucket)."""
    monkeypatch.setattr(balance, "scale_up_due", _due)
    prof = forcing_profile("small")
    prof.key["devices"] = 2
    prof.save(tmp_path / "prof.json")
    run = tmp_path / "run"
    _train(run, "steps=2", "save_every=1", "trainer.warmup=true", "placement=disaggregated", "engine.tp=2",
           "engine.instances=1", "train_layout.fsdp=4", "stage_balance.scale_up=true",
           "stage_balance.max_instances=2", "engine.adaptive_tp.enabled=true",
           f"engine.adaptive_tp.profile={tmp_path / 'prof.json'}", "engine.adaptive_tp.candidates=[1, 2]",
           "engine.adaptive_tp.check_every=2", "engine.adaptive_tp.kv=recompute", "engine.adaptive_tp.warm=true",
           "engine.batch_buckets_per_octave=1", "engine.page_buckets=2")
    rows = _metrics(run)
    assert [r["placement/scaled_up"] for r in rows] == [1, 0]
    assert [r["placement/gen_instances"] for r in rows] == [1, 2]      # (at the sync, before the step's scale-up)
    assert all(r["pat/switches"] >= 1 for r in rows)
    recs = [json.loads(line) for line in (run / "pat_decisions.jsonl").read_text().splitlines()]
    first = [next(r for r in recs if r["rl_step"] == s and r["switch"]) for s in (0, 1)]
    assert [(r["current"], r["tp"], r["actual"]["instances"]) for r in first] == [(2, 1, 2), (2, 1, 4)]
    assert rows[1]["compiles"] == 0
    meta = json.loads((run / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert meta["instances"] == 2                     # a resume starts on the grown pool


def test_planner_lays_out_the_pool_scale_up_grew(tmp_path, monkeypatch):
    """Disaggregated, TP2 x 1 instance with one spare group (max_instances=2), the planner on (a KV budget that
    preempts): the pool grows to 4 devices after step 0, and from then on the planner's TP is laid out over
    all 4 (it used to go back to the configured 2 devices at every sync); the checkpoint holds the grown pool
    for the planner and the rollout side."""
    monkeypatch.setattr(balance, "scale_up_due", _due)
    run = tmp_path / "run"
    _train(run, "steps=2", "save_every=1", "placement=disaggregated", "engine.tp=2", "engine.instances=1",
           "train_layout.fsdp=4", "stage_balance.scale_up=true", "stage_balance.max_instances=2",
           "engine.planner.enabled=true", "engine.kv_bytes_per_device=3900000")
    rows = _metrics(run)
    assert [r["placement/scaled_up"] for r in rows] == [1, 0]
    tp = [r["planner/tp"] for r in rows]
    assert [r["planner/instances"] for r in rows] == [2 // tp[0], 4 // tp[1]]
    assert [r["placement/gen_devices"] for r in rows] == [2 // tp[0] * tp[0], 4]   # (after each step's sync)
    meta = json.loads((run / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert meta["instances"] == 2 and meta["planner"]["devices"] == 4
    # resumed without the spare group the grown pool needs: one line naming the key, no traceback
    args = _command(run, "steps=3", "save_every=1", "placement=disaggregated", "engine.tp=2", "engine.instances=1",
                    "train_layout.fsdp=4", "engine.planner.enabled=true", "engine.kv_bytes_per_device=3900000",
                    "--resume=force")[3:]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and "Traceback" not in err.getvalue()
    assert "runs on 2 generation instances (scaled up); resume with stage_balance.max_instances=2" in err.getvalue()



def test_stream_trainer_frees_half_of_the_pool_scale_up_grew(tmp_path, monkeypatch):
    """Disaggregated, TP1 x 2 instances with two spares (max_instances=4), RollPacker's stream trainer on: the
    pool grows 2 -> 3 -> 4 and a shrink frees half of the pool it runs on: 1 device of 2 instances at step 0,
    none of 3 (no half of whole instances), 2 of 4 at step 2 (milestones from 10%: at this size most
    responses end together, past 50%); nothing compiles after step 0 (the warm-up compiled the freed
    devices' executables for each grown pool, and a grown pool's instances keep the configured batch: the
    step shapes the warm-up compiled on the largest pool). The same rollouts and, within float tolerance,
    the same weights as the run without the stream trainer."""
    monkeypatch.setattr(balance, "scale_up_due", _due)
    sync, st = tmp_path / "sync", tmp_path / "st"
    common = ["steps=3", "save_every=null", *POOLS, "placement=disaggregated", "engine.instances=2",
              "stage_balance.scale_up=true", "stage_balance.max_instances=4", "algo.prompts_per_step=16"]
    _train(sync, *common)
    _train(st, *common, "trainer.stream.enabled=true", "trainer.warmup=true", "trainer.stream.start=0.1")
    m1, m2 = _metrics(sync), _metrics(st)
    assert [r["placement/scaled_up"] for r in m2] == [1, 1, 0] and [r["placement/gen_instances"] for r in m2] == [2, 3, 4]
    assert [r["stream/freed_devices"] for r in m2] == [1, 0, 2] and m2[2]["stream/groups_early"] > 0
    assert [r["compiles"] for r in m2][1:] == [0, 0]
    for key in ROLLOUT_KEYS:
        assert [r[key] for r in m1] == [r[key] for r in m2], key
    _same_weights(sync, st)
