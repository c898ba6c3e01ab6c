"""The composition table (`jaxrl.config.composition`, docs/composition.md): recomputed from the config checks, it
equals the committed scripts/results/composition.json (so the rendered page cannot drift from the code); every
mechanism loads alone; every refusal names its key and a reason; the number of refused pairs only goes down.
The all-mechanisms recipes (configs/all_mechanisms{,_async}.yaml) are written from the same declarations."""

import importlib.util
import json
from pathlib import Path

import pytest

from jaxrl.config.composition import MECHANISMS, RECIPES, check, overrides, recipe_config, recipe_yaml

ROOT = Path(__file__).resolve().parents[1]
REFUSED_AT_MOST = 22          # of the 231 pairs; lower it when a pair starts to compose, never raise it for an old
                              # pair (5 of the first 120; 7 more came with async_k2, weight_swap and gspo, 4 with
                              # carry_partial, 2 with opd; 4 pairs that set one key twice, e.g. async's
                              # max_staleness=1 and async_k2's 2, had counted as accepted while the later value won:
                              # `composition.clash` refuses them)


def _script():
    spec = importlib.util.spec_from_file_location("composition_script", ROOT / "scripts" / "composition.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def table():
    return _script().table()


def test_committed_table_matches_the_code(table):
    committed = json.loads((ROOT / "scripts" / "results" / "composition.json").read_text())
    committed.pop("provenance", None)          # (where and when it was written: scripts/bench_harness.py)
    assert committed == table, "re-run: scripts/venv.sh python scripts/composition.py && scripts/venv.sh python scripts/docs.py"


def test_refusals_name_a_key_and_a_reason(table):
    n = len(MECHANISMS)
    assert table["total"] == n * (n - 1) // 2 == len(table["pairs"])
    refused = [p for p in table["pairs"] if not p["accepted"]]
    assert table["refused"] == len(refused) <= REFUSED_AT_MOST
    for p in refused:
        assert p["key"] and len(p["reason"]) > 20, p
    assert all(p["key"] is None and p["reason"] is None for p in table["pairs"] if p["accepted"])


def test_each_mechanism_loads_alone_and_a_contradiction_is_refused():
    for name in MECHANISMS:
        assert check(name) is None, (name, check(name))
    # both decide which weights a gradient is taken at: the rollout's (stream trainer), the next ones (async)
    key, reason = check("stream_trainer", "async")
    assert key == "trainer.stream.enabled" and "weights of later updates" in reason
    assert check("stream_trainer", "disaggregated") is None     # the freed devices join the train pool's stream
    assert overrides("async", "disaggregated").count("placement=disaggregated") == 1


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipes_are_written_from_the_declarations(name):
    path = ROOT / "configs" / f"{name}.yaml"
    assert path.read_text() == recipe_yaml(name), "re-run: scripts/venv.sh python scripts/composition.py"
    cfg = recipe_config(name)
    on = {"tail": cfg.rollout.tail_batching.enabled, "dynamic": cfg.rollout.tail_batching.dynamic_sampling,
          "skew": cfg.rollout.skew.enabled, "planner": cfg.engine.planner.enabled,
          "blockwise": cfg.trainer.backward == "blockwise", "repartition": cfg.trainer.repartition == "tokens"}
    assert all(on.values()), on
    assert (cfg.distributed.num_processes, cfg.trainer.max_staleness) == ((2, 0) if name == "all_mechanisms" else (None, 1))


def test_every_accepted_pair_was_run(table):
    """scripts/pair_runs.py's record (2 RL steps of each accepted pair on a 4-device train layout, too long for
    the suite) covers every pair the code accepts, and none failed: a mechanism that joins MECHANISMS, or a pair
    that starts to compose, fails here until its runs are recorded."""
    runs = json.loads((ROOT / "scripts" / "results" / "pair_runs.json").read_text())
    ran = {(p["a"], p["b"]): p for p in runs["pairs"]}
    accepted = [(p["a"], p["b"]) for p in table["pairs"] if p["accepted"]]
    missing = [pair for pair in accepted if pair not in ran]
    assert not missing, f"re-run: scripts/venv.sh python scripts/pair_runs.py --within A B for {missing}"
    assert all(ran[pair]["ran"] for pair in accepted), [pair for pair in accepted if not ran[pair]["ran"]]
