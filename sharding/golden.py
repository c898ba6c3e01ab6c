"""Golden sharding snapshots: every weight leaf's `PartitionSpec`, per preset and role, as reviewed JSON files.

A change to `ShardingRules`, to the logical axes in `models/weights.py` or to a preset shows up as a diff of
`sharding/golden/<preset>__<role>.json` in review (maxtext `sharding_compare_test.py` does the same).

    python -m sharding.golden            # compare; prints a readable diff, exit status 1 on mismatch
    python -m sharding.golden --update   # regenerate every file (then review `git diff sharding/golden`)

The snapshot layouts are fixed (`GOLDEN_LAYOUTS`): train `Layout(fsdp=4, tp=2)`, rollout `Layout(tp=4)`: both
sizes > 1 on every sharded axis so each rule is visible, and both divide every preset. Each file records its
layout. (This module and the `golden/` data directory share a name on purpose; with no `__init__.py` in the
directory, `sharding.golden` imports this module.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
from jax.sharding import PartitionSpec

from models.config import PRESETS, preset
from models.weights import is_spec, logical_axes

from .layout import MESH_AXES, Layout
from .rules import ROLES, ShardingRules, path_str, specs_for

GOLDEN_DIR = Path(__file__).with_name("golden")
GOLDEN_LAYOUTS = {"train": Layout(fsdp=4, tp=2), "rollout": Layout(tp=4)}


def golden_path(preset_name: str, role: str) -> Path:
    return GOLDEN_DIR / f"{preset_name}__{role}.json"


def _spec_json(spec: PartitionSpec, ndim: int) -> list:
    """A spec as a JSON list over the full rank: axis name, null, or a list of names for a multi-axis dim."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return [list(e) if isinstance(e, tuple) else e for e in entries]


def snapshot(preset_name: str, role: str) -> dict:
    """The golden record for one preset and role (what the JSON file holds)."""
    cfg, layout = preset(preset_name), GOLDEN_LAYOUTS[role]
    rules = ShardingRules.for_role(role, cfg, layout)
    axes = logical_axes(cfg)
    specs = specs_for(axes, rules, layout.mesh_shape)
    flat_axes = jax.tree_util.tree_flatten_with_path(axes, is_leaf=is_spec)[0]
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return {
        "preset": preset_name,
        "role": role,
        "layout": layout.mesh_shape,
        "mesh_axes": list(MESH_AXES),
        "rules": dataclasses.asdict(rules),
        "specs": {path_str(p): _spec_json(s, len(a.shape)) for (p, a), s in zip(flat_axes, flat_specs)},
    }


def dumps(record: dict) -> str:
    """JSON text with one line per leaf, so diffs in review are one line per changed spec."""
    head = {k: v for k, v in record.items() if k != "specs"}
    lines = ["{"]
    lines += [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines.append('  "specs": {')
    items = list(record["specs"].items())
    lines += [f"    {json.dumps(k)}: {json.dumps(v)}{',' if i < len(items) - 1 else ''}" for i, (k, v) in
              enumerate(items)]
    lines += ["  }", "}", ""]
    return "\n".join(lines)


def diff(expected: dict, actual: dict) -> list[str]:
    """Readable differences (`- golden`, `+ current`), one line per changed field or leaf; empty if equal."""
    out = []
    for key in sorted(set(expected) | set(actual)):
        if key == "specs":
            continue
        if expected.get(key) != actual.get(key):
            out += [f"- {key}: {json.dumps(expected.get(key))}", f"+ {key}: {json.dumps(actual.get(key))}"]
    exp, act = expected.get("specs", {}), actual.get("specs", {})
    for path in list(exp) + [p for p in act if p not in exp]:
        if exp.get(path) != act.get(path):
            if path in exp:
                out.append(f"- {path}: {json.dumps(exp[path])}")
            if path in act:
                out.append(f"+ {path}: {json.dumps(act[path])}")
    return out


def check() -> dict[str, list[str]]:
    """File name -> diff lines, for every preset/role whose golden file is missing, stale or different."""
    problems = {}
    expected_files = set()
    for name in PRESETS:
        for role in ROLES:
            path = golden_path(name, role)
            expected_files.add(path.name)
            if not path.exists():
                problems[path.name] = ["missing golden file"]
                continue
            lines = diff(json.loads(path.read_text()), snapshot(name, role))
            if lines:
                problems[path.name] = lines
    for path in sorted(GOLDEN_DIR.glob("*.json")):
        if path.name not in expected_files:
            problems[path.name] = ["stale golden file: no such preset/role"]
    return problems


def update() -> list[Path]:
    """Rewrite every golden file from the current rules (and remove stale ones); returns the files written."""
    GOLDEN_DIR.mkdir(exist_ok=True)
    written = []
    for name in PRESETS:
        for role in ROLES:
            path = golden_path(name, role)
            path.write_text(dumps(snapshot(name, role)))
            written.append(path)
    for path in GOLDEN_DIR.glob("*.json"):
        if path not in written:
            path.unlink()
    return written


def format_problems(problems: dict[str, list[str]]) -> str:
    parts = [f"{name}:\n" + "\n".join(f"  {line}" for line in lines) for name, lines in sorted(problems.items())]
    return ("\n".join(parts) + "\n(if the change is intended: python -m sharding.golden --update, "
            "then review git diff sharding/golden)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sharding.golden", description=__doc__.split("\n")[0])
    parser.add_argument("--update", action="store_true", help="regenerate the golden files")
    args = parser.parse_args(argv)
    if args.update:
        for path in update():
            print(f"wrote {path}")
        return 0
    problems = check()
    if problems:
        print(format_problems(problems))
        return 1
    print(f"golden sharding snapshots match ({len(PRESETS)} presets x {len(ROLES)} roles)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
