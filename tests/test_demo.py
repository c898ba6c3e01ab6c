"""The README's main command (`python -m jaxrl.demo`) runs end to end on the default recipe."""

import json

from jaxrl.config import CONFIGS_DIR, DemoConfig, load_config
from jaxrl.demo import run


def test_demo_recipe(tmp_path):
    cfg = load_config(DemoConfig, [f"run_dir={tmp_path}", "new_tokens=4"], CONFIGS_DIR / "demo.yaml")
    report = run(cfg)
    assert report["ok"]
    assert report["hf_round_trip_exact"] and report["reshard"]["round_trip_exact"] and report["greedy"]["identical"]
    assert len(report["greedy"]["layouts"]) == 2 + cfg.mesh.rollout_instances
    assert json.loads((tmp_path / "demo.json").read_text())["ok"] is True
    assert (tmp_path / "hf" / "config.json").exists()
