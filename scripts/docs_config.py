"""docs/config.md's rendered blocks: every key of every entry point's config, read from the config dataclasses.

    scripts/venv.sh python scripts/docs.py           # re-renders docs/config.md with the other pages

One block per entry point (`ENTRY_POINTS`), one table per section: each key's dotted name, its type as the source
declares it, its dataclass default (and the value the entry point's own YAML file gives it, where that differs),
its meaning and the mechanism it belongs to. The meaning is the field's comment in the source, read as `--help` reads
it (`jaxrl.config.loading.field_comment`); a field without one gets the first
sentence of its section's docstring. The mechanism comes from `MECHANISMS`, the longest dotted prefix that
matches. Nothing here is measured: the blocks change only when the code does, and tests/test_docs.py fails when a
block differs from what the code renders to now (tests/test_config_reference.py checks the page's keys both ways).

Registered by scripts/docs.py with its helpers (`register`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
import typing
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxrl.config.loading import class_summary, field_comment  # noqa: E402


class EntryPoint(typing.NamedTuple):
    name: str                      # the render block is config-NAME
    command: str
    cls: str                       # "module:Class"
    yaml: str | None               # the file under configs/ the command loads by default


ENTRY_POINTS = (
    EntryPoint("train", "python -m jaxrl.train", "jaxrl.config:TrainConfig", "quickstart.yaml"),
    EntryPoint("eval", "python -m jaxrl.eval", "jaxrl.config:EvalConfig", "eval.yaml"),
    EntryPoint("generate", "python -m jaxrl.generate", "jaxrl.config:GenerateConfig", "generate.yaml"),
    EntryPoint("profile", "python -m jaxrl.rollout.profile", "jaxrl.config.profile:ProfileConfig", None),
    EntryPoint("demo", "python -m jaxrl.demo", "jaxrl.config:DemoConfig", "demo.yaml"),
)

# dotted prefix -> (mechanism, its page); the longest prefix matching a key wins ("" = the entry point itself).
MECHANISMS: dict[str, tuple[str, str]] = {
    "": ("the run", "training.md"),
    "model": ("model", "reference.md"),
    "model.lora": ("LoRA", "lora.md"),
    "train_layout": ("train sharding", "training.md"),
    "mesh": ("device layouts", "reference.md"),
    "data": ("data", "training.md"),
    "rollout": ("sampling", "rollout.md"),
    "sampling": ("sampling", "rollout.md"),
    "rollout.tail_batching": ("RollPacker tail batching", "rollpacker.md"),
    "rollout.tail_batching.dynamic_sampling": ("DAPO dynamic sampling", "rollpacker.md"),
    "rollout.tail_batching.max_waves": ("DAPO dynamic sampling", "rollpacker.md"),
    "rollout.tail_batching.carry_partial": ("slime partial rollouts", "async.md"),
    "rollout.skew": ("StreamRL skew-aware scheduling", "streamrl.md"),
    "rollout.env": ("multi-turn", "multiturn.md"),
    "rollout.turns": ("multi-turn", "multiturn.md"),
    "engine": ("rollout engine", "rollout.md"),
    "engine.adaptive_tp": ("PAT", "pat.md"),
    "engine.planner": ("RollPacker TP planner", "rollpacker.md"),
    "algo": ("RL objective", "training.md"),
    "algo.objective": ("off-policy objective", "async.md"),
    "algo.is_correction": ("off-policy objective", "async.md"),
    "algo.is_cap": ("off-policy objective", "async.md"),
    "algo.graph": ("DistFlow step graph", "distflow.md"),
    "optim": ("optimizer", "training.md"),
    "critic": ("PPO critic", "training.md"),
    "trainer": ("train step", "training.md"),
    "trainer.backward": ("MetroRLHF blockwise backward", "metrorlhf.md"),
    "trainer.block_size": ("MetroRLHF blockwise backward", "metrorlhf.md"),
    "trainer.kv_source": ("MetroRLHF blockwise backward", "metrorlhf.md"),
    "trainer.stream": ("RollPacker stream trainer", "rollpacker.md"),
    "trainer.max_staleness": ("asynchronous RL", "async.md"),
    "trainer.swap_step": ("asynchronous RL", "async.md"),
    "trainer.swap_kv": ("asynchronous RL", "async.md"),
    "trainer.stale_samples": ("asynchronous RL", "async.md"),
    "trainer.repartition": ("DistFlow databuffer", "distflow.md"),
    "warm_start": ("supervised warm start", "training.md"),
    "rewards": ("rewards", "training.md"),
    "rewards.sandbox": ("code sandbox", "rollpacker.md"),
    "rewards.adaptive_timeout": ("RollPacker adaptive timeout", "rollpacker.md"),
    "eval": ("evaluation", "training.md"),
    "distributed": ("multi-host", "training.md"),
    "placement": ("StreamRL placement", "streamrl.md"),
    "stage_balance": ("StreamRL stage balance", "streamrl.md"),
    "profile_steps": ("profiling", "training.md"),
}


class Key(typing.NamedTuple):
    key: str            # dotted name
    type: str           # as declared in the source
    default: str        # the dataclass default, as `key=value` reads it back
    file_value: str | None   # the entry point's YAML file's value where it differs from the default
    meaning: str        # the field's comment, else SECTION_MARK + its section's first sentence
    mechanism: str      # MECHANISMS prefix that matched


class Group(typing.NamedTuple):
    path: str           # the section's dotted path ("" = the top level)
    doc: str            # the field's comment, else the class docstring's first paragraph
    cls: str
    keys: tuple[Key, ...]


def config_class(entry: EntryPoint) -> type:
    module, name = entry.cls.split(":")
    return getattr(importlib.import_module(module), name)


# -------------------------------------------------------------------------------------------- the source

def comment(cls: type, name: str) -> str:
    """The comment of field `name` of `cls`: the text `--help` prints (`jaxrl.config.loading.field_comment`)."""
    return field_comment(cls, name)


def summary(cls: type) -> str:
    """The first paragraph of a class docstring, on one line (`jaxrl.config.loading.class_summary`)."""
    return class_summary(cls)


def first_sentence(text: str) -> str:
    m = re.match(r"(.+?[.:;])(\s|$)", text)
    return (m.group(1) if m else text).rstrip(".:;")


# ----------------------------------------------------------------------------------------------- the tree

def _is_section(value) -> bool:
    from draccus.utils import is_choice_type
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and not is_choice_type(type(value))


def show(value) -> str:
    """A value as `key=value` on the command line reads it back (`jaxrl.config.loading`'s `--help` spelling)."""
    import draccus
    import yaml

    if isinstance(value, str):
        return value or "''"
    return yaml.safe_dump(draccus.encode(value), default_flow_style=True, width=10**9).removesuffix("\n...\n").strip()


def mechanism(key: str) -> str:
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MECHANISMS:
            return ".".join(parts[:n])
    return ""


def groups(cls: type, yaml_name: str | None = None) -> list[Group]:
    """The top level and every section of config class `cls` (depth first, in declaration order)."""
    from jaxrl.config import CONFIGS_DIR, load_config

    default = cls()
    loaded = load_config(cls, [], CONFIGS_DIR / yaml_name) if yaml_name else default

    def walk(value, other, path: str, doc: str) -> list[Group]:
        kind = type(value)
        keys, below = [], []
        for f in dataclasses.fields(kind):
            if not f.init:
                continue
            key = f"{path}.{f.name}" if path else f.name
            v, o = getattr(value, f.name), getattr(other, f.name)
            note = comment(kind, f.name)
            if _is_section(v):
                below.append((v, o, key, note or summary(type(v))))
                continue
            fallback = summary(kind) or doc          # the section's docstring, else the comment on its field
            meaning = note or (f"{SECTION_MARK}{first_sentence(fallback)}" if fallback else "")
            keys.append(Key(key, f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type)),
                            show(v), None if show(o) == show(v) else show(o), meaning, mechanism(key)))
        out = [Group(path, doc, kind.__name__, tuple(keys))]
        for v, o, key, d in below:
            out += walk(v, o, key, d)
        return out

    return walk(default, loaded, "", summary(cls))


def keys(cls: type) -> list[str]:
    """Every dotted key (leaves only) of config class `cls`."""
    return [k.key for g in groups(cls) for k in g.keys]


# -------------------------------------------------------------------------------------------- rendering

SECTION_MARK = "(section) "      # a meaning taken from the section's docstring (the field has no comment)


def _cell(text: str) -> str:
    """Text for a table cell: `|`, `*` and `<` escaped outside code spans (which keep theirs), one line."""
    parts = re.split(r"(`[^`]*`)", text.replace("\n", " "))
    text = "".join(p if p.startswith("`") else p.replace("*", "\\*").replace("<", "&lt;") for p in parts)
    text = text.replace("|", "\\|")
    return f"*(section)* {text.removeprefix(SECTION_MARK)}" if text.startswith(SECTION_MARK) else text


def _code(text: str) -> str:
    tick = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{tick}{pad}{text}{pad}{tick}".replace("|", "\\|")


def render(entry: EntryPoint) -> str:
    cls = config_class(entry)
    parts = []
    for g in groups(cls, entry.yaml):
        title = f"`{g.path}`" if g.path else "top level"
        head = f"#### {entry.command.split()[-1].removeprefix('jaxrl.')}: {title}"
        doc = summary(type(getattr_path(cls(), g.path))) if g.path else summary(cls)
        intro = " — ".join(dict.fromkeys(x for x in (g.doc, doc) if x))
        rows = []
        for k in g.keys:
            label, page = MECHANISMS[k.mechanism] if k.mechanism else MECHANISMS[""]
            default = _code(k.default) + (f" (`{entry.yaml}`: {_code(k.file_value)})" if k.file_value else "")
            rows.append([f"`{k.key}`", _cell(k.type), default, _cell(k.meaning), f"[{label}]({page})"])
        block = [head, "", f"{_cell(intro)} (`{g.cls}`)" if intro else f"(`{g.cls}`)"]
        if rows:
            block += ["", _table(["key", "type", "default", "meaning", "mechanism"], rows)]
        parts.append("\n".join(block))
    n = len(keys(cls))
    foot = (f"*{n} keys of `{entry.cls.split(':')[1]}` ({entry.cls.split(':')[0].replace('.', '/')}), read from "
            f"the source, no machine involved. Rendered by `scripts/docs.py` (`scripts/docs_config.py`).*")
    return "\n\n".join(parts + [foot])


def getattr_path(obj, path: str):
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


def _table(head, rows) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def register(renders):
    for entry in ENTRY_POINTS:
        renders(f"config-{entry.name}")(functools.partial(render, entry))
