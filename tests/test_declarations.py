"""The refusals between mechanisms come from one source (`jaxrl.config.declarations`): every refused pair of the
composition table is a conflict the declarations compute, and breaking one declaration changes the table and
the config's check together."""

import dataclasses
import json
from pathlib import Path

import pytest

from jaxrl.config import composition, declarations
from jaxrl.config.base import ConfigError
from jaxrl.config.declarations import COMPONENTS, Component, Decides, Needs, conflicts
from jaxrl.config.loading import CONFIGS_DIR, load_config
from jaxrl.config.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def _unchecked(monkeypatch, *names) -> TrainConfig:
    """The pair's config with the declarations' check off (what the other checks alone make of it)."""
    monkeypatch.setattr("jaxrl.config.train.check_declarations", lambda cfg: None)
    return load_config(TrainConfig, composition.overrides(*names), default_yaml=CONFIGS_DIR / "quickstart.yaml")


def test_every_refused_pair_is_a_declared_conflict(monkeypatch):
    table = json.loads((ROOT / "scripts" / "results" / "composition.json").read_text())
    refused = [p for p in table["pairs"] if not p["accepted"]]
    assert refused
    for p in refused:
        if composition.clash(p["a"], p["b"]) is not None:   # two settings of one key (no config to load)
            assert composition.clash(p["a"], p["b"]) == (p["key"], p["reason"]), p
            continue
        cfg = _unchecked(monkeypatch, p["a"], p["b"])        # no section check refuses it any more...
        assert conflicts(cfg)[0] == (p["key"], p["reason"]), p   # ...the declarations do, with the same words


def test_breaking_one_declaration_changes_the_table_and_the_check(monkeypatch):
    table = json.loads((ROOT / "scripts" / "results" / "composition.json").read_text())   # the table as committed
    before = {(p["a"], p["b"]): None if p["accepted"] else (p["key"], p["reason"]) for p in table["pairs"]}
    assert before[("stream_trainer", "gspo")][0] == "trainer.stream.enabled"
    stream = next(c for c in COMPONENTS if c.name == "stream_trainer")
    loose = dataclasses.replace(stream, needs=tuple(n for n in stream.needs if n.thing != "objective"))
    monkeypatch.setattr(declarations, "COMPONENTS", tuple(loose if c is stream else c for c in COMPONENTS))
    after = composition.pair_matrix()
    changed = {pair for pair in before if before[pair] != after[pair]}
    assert changed == {("stream_trainer", "gspo"), ("stream_trainer", "carry_partial")}
    assert all(after[pair] is None for pair in changed)        # the table accepts them, and so does the config:
    load_config(TrainConfig, composition.overrides("stream_trainer", "gspo"),
                default_yaml=CONFIGS_DIR / "quickstart.yaml")

    lora_decides = Component("lora", "model.lora.rank", lambda c: c.model.lora.rank is not None,
                             decides=(Decides("rollout_policy", "older"),))      # a made-up decision
    monkeypatch.setattr(declarations, "COMPONENTS", COMPONENTS + (lora_decides,))
    key, reason = composition.check("stream_trainer", "lora")
    assert key == "trainer.stream.enabled" and reason.startswith("true with model.lora.rank=8: ")


def test_a_conflict_names_the_needing_key_and_the_deciding_value():
    a = Component("a", "trainer.stream.enabled", lambda c: True, needs=(Needs("x", frozenset({"1"}), "{value} / {other}"),))
    b = Component("b", "algo.objective", lambda c: True, decides=(Decides("x", lambda c: c.algo.objective),))
    cfg = TrainConfig()
    assert conflicts(cfg, (a, b)) == [("trainer.stream.enabled", "false / algo.objective=ppo")]
    assert conflicts(cfg, (a,)) == [] and conflicts(cfg, (b,)) == []
    with pytest.raises(ConfigError, match="trainer.stream.enabled"):
        load_config(TrainConfig, ["trainer.stream.enabled=true", "trainer.max_staleness=1", "placement=disaggregated",
                                  "engine.instances=2"], default_yaml=CONFIGS_DIR / "quickstart.yaml")
