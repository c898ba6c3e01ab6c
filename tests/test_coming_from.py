"""docs/coming_from.md stays true: every jaxrl key it names exists, each table cell's overrides load together through
the config loader, both quick-start command lines load, and its conversion script and GSM8K reward run.

The checks read the page itself (no copy of its keys here), so a key renamed in `jaxrl/config/` or a typo on the
page fails; `test_the_checks_catch_a_wrong_key` shows they do."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.config import CONFIGS_DIR, ConfigError, TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "coming_from.md"
QUICKSTART = CONFIGS_DIR / "quickstart.yaml"
OVERRIDE = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z0-9_]+)*=\S*$")
DOTTED = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z0-9_]+)+$")


def _keys() -> set[str]:
    """Every dotted key and section path of TrainConfig."""
    import dataclasses

    out = set()

    def walk(cfg, path):
        for f in dataclasses.fields(cfg):
            key, value = (f"{path}.{f.name}" if path else f.name), getattr(cfg, f.name)
            out.add(key)
            if dataclasses.is_dataclass(value):
                walk(value, key)

    walk(TrainConfig(), "")
    return out


def _jaxrl_cells(text: str) -> list[str]:
    """The cells of every table's `jaxrl` column."""
    cells, col = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            col = None
            continue
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if col is None:                                   # a header row
            col = row.index("jaxrl") if "jaxrl" in row else -1
        elif col >= 0 and not set(line) <= set("|-: ") and len(row) > col:
            cells.append(row[col])
    return cells


def _commands(text: str) -> list[list[str]]:
    """The arguments of every `python -m jaxrl.train` command in the page's bash blocks."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            words = shlex.split(cmd)
            if "jaxrl.train" in words:
                out.append(words[words.index("jaxrl.train") + 1:])
    return out


def problems(text: str) -> list[str]:
    """What on the page does not hold: keys that do not exist, cells or commands the config refuses."""
    keys, bad = _keys(), []
    cells = _jaxrl_cells(text)
    assert cells, "no jaxrl column found"
    for cell in cells:
        spans = re.findall(r"`([^`]+)`", cell)
        overrides = [s for s in spans if OVERRIDE.match(s)]
        bad += [f"unknown key {s!r}" for s in spans if DOTTED.match(s) and s.split(".")[0] in keys and s not in keys]
        if overrides:
            try:
                load_config(TrainConfig, overrides, QUICKSTART)
            except ConfigError as e:
                bad.append(f"{' '.join(overrides)}: {e}")
    commands = _commands(text)
    assert len(commands) >= 2, "the verl and TRL quick-start commands are missing"
    for args in commands:
        try:
            load_config(TrainConfig, args, QUICKSTART)
        except ConfigError as e:
            bad.append(f"python -m jaxrl.train {' '.join(args)}: {e}")
    return bad


def test_every_jaxrl_key_and_command_on_the_page_loads():
    text = PAGE.read_text()
    assert not problems(text), problems(text)
    overrides = [s for c in _jaxrl_cells(text) for s in re.findall(r"`([^`]+)`", c) if OVERRIDE.match(s)]
    assert len(overrides) > 60 and "algo.group_size=8" in overrides      # the page really was checked


def test_the_checks_catch_a_wrong_key():
    text = PAGE.read_text()
    assert problems(text.replace("| `algo.group_size=8` |", "| `algo.group_sizes=8` |", 1))  # an override
    assert problems(text.replace("`algo.kl_estimator=k3`", "`algo.kl_estimator=k4`", 1))  # a refused value
    assert problems(text.replace("=1024 algo.mini_batches=", "=1024 algo.mini_batch=", 1))       # a command
    assert problems(text.replace("| `engine.tp=2` |", "| `engine.tps` |", 1))              # a bare key


def _block(text: str, first_line: str) -> str:
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith(first_line)]
    assert len(blocks) == 1, first_line
    return blocks[0]


def test_conversion_script_reads_verl_and_trl_files(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    from jaxrl.data.dataset import PromptDataset

    script = tmp_path / "to_jaxrl.py"
    script.write_text(_block(PAGE.read_text(), "# to_jaxrl.py"))
    verl = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}],
             "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"split": "train", "index": 0}}]
    trl = [{"prompt": [{"role": "user", "content": "Solve x + 1 = 3."}], "solution": "$2$"}]
    for name, rows in (("verl", verl), ("trl", trl)):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
        subprocess.run([sys.executable, str(script), str(tmp_path / f"{name}.parquet"),
                        str(tmp_path / f"{name}_jaxrl.parquet")], check=True, capture_output=True, timeout=60)
    (v,), (t,) = (PromptDataset.from_parquet(tmp_path / f"{n}_jaxrl.parquet") for n in ("verl", "trl"))
    assert (v["prompt"], v["answer"], v["data_source"], v["extra_info"]["split"]) == ("1 + 1?", "2", "openai/gsm8k",
                                                                                      "train")
    assert (t["prompt"], t["answer"]) == ("Solve x + 1 = 3.", "$2$")


def test_gsm8k_reward_and_verl_wrapper_signatures(tmp_path):
    from jaxrl.rewards.calling import signature_problem

    text = PAGE.read_text()
    ns: dict = {}
    exec(_block(text, "# gsm8k_reward.py"), ns)
    gsm8k = ns["gsm8k"]
    assert gsm8k("so 3 + 4 = 7.\n#### 7", "7") == 1.0 and gsm8k("#### 1,024", "1024") == 1.0
    assert gsm8k("the answer is 7", "7") == 0.0 and gsm8k("#### 8", "7") == 0.0
    assert signature_problem(gsm8k, ["prompt", "answer", "task"]) is None
    wrapper = _block(text, "# my_rewards.py").replace("from my_verl_rewards import compute_score",
                                                      "def compute_score(s, r, g, e): return float(r == g)")
    exec(wrapper, ns)
    assert signature_problem(ns["from_verl"], ["prompt", "answer", "task", "data_source", "extra_info"]) is None
    assert "data_source" in signature_problem(ns["from_verl"], ["prompt", "answer", "task"])
