"""YAML files and command lines → validated config objects, and back to YAML.

    cfg = load_config(DemoConfig, ["--config", "configs/demo.yaml", "model.preset=qwen3-0.6b",
                                   "--mesh.train.fsdp=4"])
    text = to_yaml(cfg); assert from_yaml(DemoConfig, text) == cfg

Command line grammar: `--config FILE` (or `--config=FILE`) picks the YAML file (it replaces
`default_yaml`); every other token is a dotted override `key=value` or `--key=value`, applied in
order on top of the file, later ones winning. A value is read by its field's type:

* `str` fields take the text verbatim (`run_dir=010` is "010"); `str | None` fields read `null` or `~`
  as None;
* `int`, `bool`, lists and sections are parsed as YAML (`mesh.train={fsdp: 4, tp: 2}` merges into
  the section); `float` fields also take `1e-6`;
* the key is checked against the dataclass tree before anything is parsed, so a typo fails with
  the valid keys at that level.

Everything a file or the command line can get wrong raises `ConfigError` naming the dotted key;
`parse_cli` turns that into a one-line message and exit status 2. Its `--help` lists every key as
`key = resolved value   description`, grouped by section, with the description read from the field's
inline comment (`steps: int = 3   # RL steps`) or, for a section, its class docstring's first paragraph
(draccus's docstring helpers read the source), after the entry point's examples.

Draccus's own `draccus.parse` is not used for the command line: it is argparse-based, so it needs `--`
on every key, reports a typo as argparse's "unrecognized arguments" with a usage dump and `SystemExit`,
and cannot see field types when it pre-parses each value as YAML. Draccus still loads the YAML files (with its `!include`
support), decodes, and encodes (see base.py for the decoding hook).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import shlex
import sys
import textwrap
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import draccus
import yaml
from draccus.cfgparsing import load_config as draccus_load_config
from draccus.utils import ParsingError, stringify_type
from draccus.wrappers.docstring import HelpOrder, get_attribute_docstring, get_preferred_help_text

from .base import ConfigError, decode, init_field_types, is_plain_section, join_key, renamed, unwrap_optional

T = TypeVar("T")

# configs/ of a source checkout (the YAML files are not installed as package data).
CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"

_NULLS = ("null", "~")


def to_yaml(cfg: Any) -> str:
    """The YAML serialisation of a config, every field written, in declaration order."""
    return draccus.dump(cfg, sort_keys=False)


def from_yaml(cls: type[T], text: str) -> T:
    """Decode and validate YAML text into `cls`; raises ConfigError."""
    return decode(cls, _load_yaml(text, source="<yaml text>"))


def from_yaml_file(cls: type[T], path: str | os.PathLike) -> T:
    """Decode and validate a YAML file into `cls`; raises ConfigError (the key, and the file)."""
    try:
        return decode(cls, _read_yaml_file(path))
    except ConfigError as e:
        raise ConfigError(e.key, f"{e.message} (in {os.fspath(path)})") from None


def load_config(cls: type[T], argv: Sequence[str], default_yaml: str | os.PathLike | None = None) -> T:
    """`cls` from `default_yaml` (or `--config FILE`) plus dotted overrides in `argv`; raises ConfigError.

    Without any YAML file the dataclass defaults are the base. Fields a file leaves out keep their
    dataclass defaults.
    """
    if "config" in init_field_types(cls):
        raise TypeError(f"{cls.__name__} has a field named 'config', which clashes with --config FILE")
    config_file, overrides = _split_argv(argv)
    path = _config_path(config_file) if config_file is not None else default_yaml
    data = _read_yaml_file(path) if path is not None else {}
    if not isinstance(data, dict):
        raise ConfigError("", f"expected a mapping at the top of {os.fspath(path)}, got {data!r}")
    for key, text in overrides:
        _set_dotted(data, key, _parse_value(_field_type(cls, key), key, text))
    try:
        return decode(cls, data)
    except ConfigError as e:
        if path is None or any(e.key == k or e.key.startswith(k + ".") for k, _ in overrides):
            raise
        raise ConfigError(e.key, f"{e.message} (in {os.fspath(path)})") from None


def parse_cli(cls: type[T], argv: Sequence[str] | None = None, *, default_yaml: str | os.PathLike | None = None,
              prog: str | None = None, examples: Sequence[str] | None = None, flags: str = "") -> T:
    """`load_config` for an entry point: `-h/--help` prints usage, examples and every key with its resolved
    value and description (exit 0); a ConfigError prints `prog: error: …` to stderr and exits with status 2,
    without a traceback.

    `prog` defaults to `python -m PACKAGE` when run with `-m`. `examples` are argument strings shown after
    `prog` (shell quoting included, e.g. "'train_layout={fsdp: 2, tp: 2}' steps=20"); each must load on top
    of `default_yaml`. Left out, two are derived from the config's own keys and values. `flags`: options
    the entry point handles itself before calling this, for the usage line (e.g. "[--run-dir DIR]").
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or _default_prog()
    wants_help = any(a in ("-h", "--help") for a in argv)
    argv = [a for a in argv if a not in ("-h", "--help")]
    try:
        cfg = load_config(cls, argv, default_yaml)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if wants_help:
        print(format_help(cfg, prog=prog, default_yaml=default_yaml, examples=examples, flags=flags), end="")
        raise SystemExit(0)
    return cfg


def format_help(cfg: Any, *, prog: str, default_yaml: str | os.PathLike | None = None,
                examples: Sequence[str] | None = None, flags: str = "") -> str:
    """The `--help` text of config `cfg`: usage, examples, then `key = value   description` for every
    key, grouped by section. A key's description is its field's inline comment (`x: int = 3   # …`); a
    section's is the comment on the field holding it, else the first paragraph of its class docstring."""
    groups = _help_groups(cfg)
    if examples is None:
        examples = _derived_examples(groups)
    base = (f"the YAML file (default {os.fspath(default_yaml)}; --config FILE replaces it)"
            if default_yaml is not None else "the dataclass defaults (or --config FILE)")
    intro = (f"Each key=value (or --key=value) applies on top of {base}, in order, later ones winning; a section "
             f"takes a YAML mapping merged into it. The values below are the resolved ones.")
    usage = " ".join(filter(None, ("usage:", prog, "[--config FILE]", flags, "[key=value ...]")))
    lines = [usage, "", textwrap.fill(intro, 100), ""]
    if examples:
        lines += ["examples:", *(f"  {prog} {ex}" for ex in examples), ""]
    rows = [f"{key} = {_show(value)}" for group in groups for key, value, _ in group.leaves]
    width = min(max(map(len, rows), default=0), 44) + 3
    for group in groups:
        title = f"{group.path}:" if group.path else "top level:"
        lines.append(f"{title} {group.doc}".rstrip())
        for key, value, doc in group.leaves:
            row = f"{key} = {_show(value)}"
            lines.append(f"  {row.ljust(width)}{doc}".rstrip() if doc else f"  {row}")
        lines.append("")
    return "\n".join(lines)


def undocumented_keys(cls: type) -> list[str]:
    """Dotted keys (and sections) of config class `cls` that `--help` shows without a description."""
    out = []
    for group in _help_groups(cls()):
        if group.path and not group.doc:
            out.append(group.path)
        out += [key for key, _, doc in group.leaves if not doc]
    return out


# -- internals -----------------------------------------------------------------------------------------

def _config_path(given: str) -> str:
    """`--config FILE` as given, or, when no such file exists here and FILE is relative, the bundled one:
    `--config configs/quickstart.yaml` (or `quickstart.yaml`) works from any directory."""
    if os.path.exists(given) or os.path.isabs(given):
        return given
    for candidate in (CONFIGS_DIR.parent / given, CONFIGS_DIR / given):
        if candidate.is_file():
            return str(candidate)
    return given


@dataclasses.dataclass(frozen=True)
class _HelpGroup:
    path: str                                  # dotted path of the section ("" = the top level)
    doc: str
    leaves: list[tuple[str, Any, str]]         # (dotted key, value, description)


def _help_groups(cfg: Any, path: str = "", doc: str | None = None) -> list[_HelpGroup]:
    """The top level and then every section (depth first, in declaration order) of config instance `cfg`."""
    cls = type(cfg)
    leaves, sections = [], []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key, value = join_key(path, f.name), getattr(cfg, f.name)
        comment = field_comment(cls, f.name)
        if is_plain_section(type(value)):
            sections.append((value, key, comment))
        else:
            leaves.append((key, value, comment))
    groups = [_HelpGroup(path, class_summary(cls) if doc is None else doc, leaves)]
    for value, key, comment in sections:
        groups += _help_groups(value, key, comment or class_summary(type(value)))
    return groups


def field_comment(cls: type, name: str) -> str:
    """The field's comment (inline, else a docstring below or a comment above it) as one line; "" if none."""
    text = get_preferred_help_text(get_attribute_docstring(cls, name), HelpOrder.inline)
    return " ".join((text or "").split())


def class_summary(cls: type) -> str:
    """The first paragraph of a class docstring as one line ("" for none, or dataclass's generated one)."""
    doc = cls.__doc__
    if not doc or doc.startswith(f"{cls.__name__}("):
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def _show(value: Any) -> str:
    """A value as `key=value` on the command line reads it back (str fields take text verbatim)."""
    if isinstance(value, str):
        return value or "''"
    text = yaml.safe_dump(draccus.encode(value), default_flow_style=True, width=10**9)
    return text.removesuffix("\n...\n").strip()


def _derived_examples(groups: list[_HelpGroup]) -> list[str]:
    """Example arguments from the config's own keys: a dotted key and a top-level key, then a small
    section (scalars only) as a mapping. They set the resolved values, so they always load."""
    def arg(key: str, value: Any) -> str:
        return shlex.quote(f"{key}={_show(value)}")

    def usable(value: Any) -> bool:
        return "\n" not in _show(value) and _show(value) != "''"

    nested = next(((k, v) for g in groups if g.path for k, v, _ in g.leaves if usable(v)), None)
    top = next(((k, v) for k, v, _ in groups[0].leaves if usable(v)), None)
    first = [arg(*kv) for kv in (nested, top) if kv is not None]
    small = next((g for g in groups[1:] if 0 < len(g.leaves) <= 3
                  and all(isinstance(v, (bool, int, float)) for _, v, _ in g.leaves)
                  and not any(h.path.startswith(g.path + ".") for h in groups)), None)
    out = [" ".join(first)] if first else []
    if small is not None:
        mapping = ", ".join(f"{k.rsplit('.', 1)[1]}: {_show(v)}" for k, v, _ in small.leaves)
        out.append(shlex.quote(f"{small.path}={{{mapping}}}"))
    return out


def _default_prog() -> str:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return f"python -m {spec.name.removesuffix('.__main__')}"
    return os.path.basename(sys.argv[0])


def _load_yaml(text_or_stream: Any, source: str, file: str | None = None) -> Any:
    try:
        return draccus_load_config(text_or_stream, file=file)
    except ParsingError as e:
        raise ConfigError("", f"cannot parse YAML in {source}: {e.__cause__ or e}") from None


def _read_yaml_file(path: str | os.PathLike) -> Any:
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            return _load_yaml(f, source=path, file=path)
    except OSError as e:
        raise ConfigError("--config", f"cannot read {path}: {e.strerror}") from None


def _split_argv(argv: Sequence[str]) -> tuple[str | None, list[tuple[str, str]]]:
    config_file: str | None = None
    overrides: list[tuple[str, str]] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--config" or arg.startswith("--config="):
            if config_file is not None:
                raise ConfigError("--config", "given more than once")
            if arg == "--config":
                if i == len(args) or args[i].startswith("-"):
                    raise ConfigError("--config", "needs a file: --config FILE")
                config_file = args[i]
                i += 1
            else:
                config_file = arg.split("=", 1)[1]
            continue
        key, eq, text = arg.removeprefix("--").partition("=")
        if not eq or not key or any(not part for part in key.split(".")):
            raise ConfigError("", f"cannot read argument {arg!r}: expected key=value (e.g. model.preset=tiny-qwen3)"
                                  f" or --config FILE")
        overrides.append((key, text))
    return config_file, overrides


def _field_type(cls: type, key: str) -> Any:
    """The declared type at dotted `key` in config class `cls`; ConfigError for an unknown key.

    Below a field whose keys are not static (a dict, or a draccus choice section) returns Any; the
    decoder checks those keys.
    """
    tp: Any = cls
    parts = key.split(".")
    for i, part in enumerate(parts):
        base, _ = unwrap_optional(tp)
        if not is_plain_section(base):
            if base is Any or typing.get_origin(base) is dict or base is dict or dataclasses.is_dataclass(base):
                return Any
            parent = ".".join(parts[:i])
            raise ConfigError(key, f"{parent} is a {stringify_type(base)} value, not a section")
        fields = init_field_types(base)
        if part not in fields:
            where = f" under {'.'.join(parts[:i])}" if i else ""
            raise ConfigError(".".join(parts[:i + 1]), f"unknown key{renamed('.'.join(parts[:i + 1]))}; valid "
                              f"keys{where}: {', '.join(fields)}")
        tp = fields[part]
    return tp


def _parse_value(tp: Any, key: str, text: str) -> Any:
    base, optional = unwrap_optional(tp)
    if optional and text in _NULLS:
        return None
    if base is str:
        return text
    if base is float:
        try:
            return float(text)
        except ValueError:
            pass  # the decoder reports it with the field's type
    try:
        return yaml.safe_load(text) if text else None
    except yaml.YAMLError as e:
        raise ConfigError(key, f"cannot parse {text!r} as YAML: {e}") from None


def _set_dotted(data: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    if isinstance(value, dict) and isinstance(node.get(leaf), dict):
        _deep_merge(node[leaf], value)
    else:
        node[leaf] = value


def _deep_merge(into: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _deep_merge(into[k], v)
        else:
            into[k] = v
