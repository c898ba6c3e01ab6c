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
`parse_cli` turns that into a one-line message and exit status 2. Draccus's own `draccus.parse` is not
used for the command line: it is argparse-based, so it needs `--` on every key, reports a typo as
argparse's "unrecognized arguments" with a usage dump and `SystemExit`, and cannot see field types
when it pre-parses each value as YAML. Draccus still loads the YAML files (with its `!include`
support), decodes, and encodes (see base.py for the decoding hook).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

import draccus
import yaml
from draccus.cfgparsing import load_config as draccus_load_config
from draccus.utils import ParsingError, stringify_type

from .base import ConfigError, decode, init_field_types, is_plain_section, unwrap_optional

T = TypeVar("T")

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
    path = config_file if config_file is not None else default_yaml
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
              prog: str | None = None) -> T:
    """`load_config` for an entry point: `-h/--help` prints usage and the resolved config (exit 0);
    a ConfigError prints `prog: error: …` to stderr and exits with status 2, without a traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or os.path.basename(sys.argv[0])
    wants_help = any(a in ("-h", "--help") for a in argv)
    argv = [a for a in argv if a not in ("-h", "--help")]
    try:
        cfg = load_config(cls, argv, default_yaml)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if wants_help:
        base = f" (defaults from {os.fspath(default_yaml)})" if default_yaml is not None else ""
        print(f"usage: {prog} [--config FILE] [key=value ...]\n\n"
              f"Dotted overrides such as mesh.train.fsdp=4 (or --mesh.train.fsdp=4) apply on top of the YAML"
              f" file{base}.\nResolved configuration:\n\n{to_yaml(cfg)}")
        raise SystemExit(0)
    return cfg


# -- internals -----------------------------------------------------------------------------------------

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
            raise ConfigError(".".join(parts[:i + 1]), f"unknown key; valid keys{where}: {', '.join(fields)}")
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
