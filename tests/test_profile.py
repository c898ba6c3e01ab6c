"""PAT's offline profiler (`python -m jaxrl.rollout.profile`) on a tiny model, small grid: every layout
measured at the points that fit T_cap, the predictor exact there, switch costs and the migration
bandwidth, the JSON cached by key and reused, the PNG; the config's refusals; Eq. 1's byte count against
the pages a real relayout moves."""

import json

import jax
import numpy as np
import pytest

from jaxrl.config import ConfigError, load_config
from jaxrl.config.generate import EngineSection
from jaxrl.config.profile import ProfileConfig
from jaxrl.rollout import RolloutService, SamplingParams
from jaxrl.rollout.adaptive_tp import Live, Predictor, Profile, by_group
from jaxrl.rollout.adaptive_tp import Padded
from jaxrl.rollout.profile import batch_grid, context_grid, fits, main, run_profile, shape_grid
from jaxrl.rollout.shapes import ShapeBuckets
from models import PRESETS, init

ARGS = ["model.preset=tiny-qwen3", "engine.tp=1", "engine.instances=4", "engine.max_batch=4", "engine.page_size=8",
        "engine.max_seq_len=64", "candidates=[1, 2]", "batches=3", "contexts=[8, 24]", "decode_steps=2"]


def test_grids():
    assert batch_grid(64, 10) == [1, 2, 3, 4, 6, 10, 16, 25, 40, 64]
    assert batch_grid(2, 10) == [1, 2]
    assert context_grid(1000) == [16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert context_grid(5000)[-4:] == [512, 1024, 2048, 4096]
    assert fits(4, 24, 2, 4 * 28, 64) and not fits(4, 24, 2, 4 * 28 - 1, 64) and not fits(1, 62, 2, 999, 64)


def test_profile_cli_measures_caches_and_predicts(tmp_path, capsys):
    out = tmp_path / "p.json"
    args = ARGS + [f"out={out}", f"cache_dir={tmp_path / 'cache'}"]
    assert main(args) == 0
    prof = Profile.load(out)
    assert sorted(prof.layouts) == [1, 2] and prof.key["devices"] == 4 and prof.key["decode_steps"] == 2
    pred = Predictor(prof)
    for tp, lp in prof.layouts.items():
        # max batch per instance keeps the total (4 x 4): TP 1 -> 4, TP 2 -> 8; 3 batch sizes each
        assert len({b for b, _, _ in lp.decode}) == 3 and len(lp.decode) == len(lp.prefill) == 6
        assert all(s > 0 for *_, s in lp.decode + lp.prefill) and lp.compile_seconds > 0
        # the XLA engine's padded shapes: the predictor is exact at each shape the profile ran (the mean of
        # the points that ran it: here one page-table width, 8 pages of 8 tokens)
        assert lp.shapes["page_size"] == 8 and lp.shapes["pages"] == [8]
        pad, runs = pred.padded[tp], {}
        for b, n, s in lp.decode:
            runs.setdefault((int(pad.rows(b)), int(pad.width(n))), []).append(s)
        for b, n, s in lp.decode:
            assert n in (8 + 1, 24 + 1)              # recorded at the mean context of the timed steps
            want = np.mean(runs[int(pad.rows(b)), int(pad.width(n))])
            assert pred.step_latency(tp, b, b * n) == pytest.approx(want, rel=1e-12)
    assert set(prof.reshard_seconds) == {"1->2", "2->1"}
    assert prof.migrate_bytes_per_s > 0 and prof.control_seconds > 0
    cfg = PRESETS["tiny-qwen3"]
    assert prof.layers == cfg.num_layers and prof.kv_bytes_per_token_layer == 2 * cfg.num_kv_heads * cfg.head_dim * 4
    assert out.with_suffix(".png").stat().st_size > 0
    cached = list((tmp_path / "cache").glob("profile-*.json"))
    assert len(cached) == 1
    capsys.readouterr()
    out2 = tmp_path / "q.json"
    assert main(ARGS + [f"out={out2}", f"cache_dir={tmp_path / 'cache'}"]) == 0     # same key: from the cache
    assert "cached" in capsys.readouterr().err
    assert json.loads(out2.read_text()) == json.loads(out.read_text())


def test_shape_grid_puts_every_timed_step_in_one_padded_shape():
    sh = ShapeBuckets.build(max_batch=24, max_seq_len=512, page_size=16, prefill_chunk=64, prefill_tokens=256,
                            per_octave=2, page_buckets=4)
    for steps in (2, 12):
        batches, contexts = shape_grid(sh, steps)
        assert batches == list(sh.batch)
        pad = Padded({"batch": list(sh.batch), "pages": list(sh.pages), "page_size": 16})
        assert len(contexts) == len(sh.pages)
        for n, w in zip(contexts, sorted(sh.pages)):
            # after prefill the context is n + 1; the timed steps reach n + 1 + steps
            assert {int(pad.width(c)) for c in range(n + 1, n + steps + 2)} == {w * 16}
    # 60 steps span more than one width's 64 tokens: only the widths they fit in are kept
    assert shape_grid(sh, 60)[1] == [4 * 16 - 63, 8 * 16 - 63, 16 * 16 - 63, 32 * 16 - 63]
    assert shape_grid(sh, 70)[1] == [16 * 16 - 73, 32 * 16 - 73]


def test_shapes_grid_with_passes_measures_each_engine_shape():
    """`grid=shapes`: one decode row per (rows bucket, width) that fits; `passes=2` keeps one (median) row
    per point; the key records the method."""
    cfg = PRESETS["tiny-qwen3"]
    engine = EngineSection(tp=1, instances=2, max_batch=4, page_size=8, max_seq_len=64, overlap=False)
    prof = run_profile(cfg, init(jax.random.key(0), cfg), engine, candidates=[1], decode_steps=2, grid="shapes",
                       passes=2, progress=False)
    lp = prof.layouts[1]
    pad = Padded(lp.shapes)
    shapes = [(int(pad.rows(b)), int(pad.width(n))) for b, n, _ in lp.decode]
    assert len(shapes) == len(set(shapes)) == len(lp.prefill)
    assert {b for b, _ in shapes} == set(lp.shapes["batch"]) and all(s > 0 for *_, s in lp.decode)
    assert prof.key["method"] == {"grid": "shapes", "passes": 2}


def test_config_refusals():
    with pytest.raises(ConfigError, match="candidates"):
        load_config(ProfileConfig, ["engine.tp=1", "engine.instances=4", "candidates=[8]"])
    with pytest.raises(ConfigError, match="decode_steps"):
        load_config(ProfileConfig, ["decode_steps=0"])
    with pytest.raises(ConfigError, match="grid"):
        load_config(ProfileConfig, ["grid=dense"])
    with pytest.raises(ConfigError, match="passes"):
        load_config(ProfileConfig, ["passes=0"])
    with pytest.raises(ConfigError, match="profile"):
        load_config(EngineSection, ["adaptive_tp.enabled=true"])


def test_eq1_counts_the_pages_a_relayout_moves():
    """Eq. 1 over the live sequences' page-rounded lengths == the bytes of the pages the migration moves
    (no prefix sharing: every page belongs to one sequence)."""
    cfg = PRESETS["tiny-qwen3"]
    svc = RolloutService(cfg, init(jax.random.key(0), cfg), tp=1, instances=4, page_size=8, num_pages=32,
                         max_seq_len=64, prefix_sharing=False, devices=jax.devices()[:4])
    rng = np.random.default_rng(0)
    for k, n in enumerate((5, 13, 22, 9, 30, 17)):
        svc.add(rng.integers(1, cfg.vocab_size, n).tolist(), SamplingParams(max_new_tokens=20, temperature=0.0,
                                                                            stop_token_ids=()))
    for _ in range(4):
        svc.step()
    svc.pause()
    stats = svc.sequence_stats()
    live = [Live(s["pages"] * 8, 0, s["instance"]) for s in stats]
    kv_tok = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    eq1_total = sum(sum(cfg.num_layers * x.context * kv_tok for x in g) for g in by_group(live))   # x TP_src = 1
    report = svc.relayout(4, 1, kv="migrate")
    assert report.kv.pages_moved * 8 * cfg.num_layers * kv_tok == eq1_total
    assert report.kv.migrated == len(stats)
