"""The pieces every config section shares: `ConfigError`, the `Section` base, validators, strict decoding.

A config is a tree of frozen dataclasses that subclass `Section`; each checks its own fields in
`__post_init__` with the `check_*` helpers below, which raise `ConfigError(field, message)`. Adding a
section is one dataclass:

    @dataclasses.dataclass(frozen=True)
    class TrainerSection(Section):
        lr: float = 1e-6
        steps: int = 100

        def __post_init__(self):
            check_float("lr", self.lr, above=0.0)
            check_int("steps", self.steps, minimum=1)

Decoding plain YAML data into that tree is draccus's `decode` with one registered hook
(`_decode_section`) for `Section` subclasses. The hook is the "thin wrapper" the project asked to be
explained; it exists because draccus alone

* reports an unknown key as "The fields `x` are not valid for <class>" at the parent's path, without
  the valid keys — the hook names the full dotted key and lists the valid ones;
* loses the key path of a `__post_init__` error (it re-raises "Couldn't instantiate class …") — the
  hook prefixes the section's dotted path to the field the validator named;
* coerces scalars silently (`str(["a"])` into a str field, `True` into an int field as 1,
  `"4"` into 4) — the hook requires a YAML value to already have its field's type (`float` fields
  also take numeric strings, because PyYAML reads `1e-6` without a dot as a string).

Everything else (Optional/union, list/tuple/dict fields, enums, `draccus.ChoiceRegistry` sections,
missing required fields, nested defaults) is draccus's own decoding. Choice-type sections still
decode, but their own level gets draccus's messages rather than the hook's.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import draccus
from draccus.parsers.decoding import decode_choice_class, decode_dataclass
from draccus.utils import DecodingError, ParsingError, is_choice_type


class ConfigError(ValueError):
    """A bad configuration. `key` is the dotted key at fault ("" for the whole config or file)."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)

    def under(self, prefix: str) -> ConfigError:
        """The same error with `prefix` (a section's dotted path) in front of its key."""
        return ConfigError(join_key(prefix, self.key), self.message)


class Section:
    """Base of every config dataclass, top-level configs included. Subclasses are frozen dataclasses.

    The class carries no fields or behaviour of its own; it marks the dataclasses that decode through
    `_decode_section` (registered with draccus for all subclasses).
    """


# keys renamed since a release: an old config gets the new name in its error
RENAMED = {"trainer.async_steps": "trainer.max_staleness"}


def renamed(key: str) -> str:
    return f" (renamed {RENAMED[key]})" if key in RENAMED else ""


def join_key(*parts: str) -> str:
    return ".".join(p for p in parts if p)


# -- validators, for __post_init__ -------------------------------------------------------------------

def check_int(key: str, value: object, *, minimum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(key, f"expected an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {value}")


def check_sections(cfg: Section) -> None:
    """Each field of `cfg` declared as a Section holds that section's class (or a subclass): a config built in
    code with another section in its place (the generate config's `SamplingSection` for a train config's
    `rollout`) is refused here, naming the key, not later by a missing attribute."""
    for name, kind in _section_fields(type(cfg)).items():
        value = getattr(cfg, name)
        if not isinstance(value, kind):
            raise ConfigError(name, f"expected a {kind.__name__} ({kind.__module__}), got {type(value).__name__}")


@functools.cache
def _section_fields(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if isinstance(hints[f.name], type) and issubclass(hints[f.name], Section)}


def check_float(key: str, value: object, *, above: float | None = None) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(key, f"expected a float, got {type(value).__name__} {value!r}")
    if above is not None and not value > above:
        raise ConfigError(key, f"must be > {above}, got {value}")


def check_str(key: str, value: object, *, allow_none: bool = False) -> None:
    """A non-empty string (or None where `allow_none`)."""
    if value is None and allow_none:
        return
    if not isinstance(value, str) or not value:
        raise ConfigError(key, f"expected a non-empty str, got {value!r}")


def check_choice(key: str, value: object, choices: Iterable[str]) -> None:
    choices = list(choices)
    if value not in choices:
        raise ConfigError(key, f"{value!r} is not a valid choice; valid choices: {', '.join(choices)}")


# -- decoding ------------------------------------------------------------------------------------------

_SCALARS: dict[type, tuple[type, ...]] = {str: (str,), int: (int,), float: (int, float), bool: (bool,)}


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(T, True) for `T | None` / `Optional[T]`; (tp, False) otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def init_field_types(cls: type) -> dict[str, Any]:
    """Constructor fields of a dataclass, in declaration order, with resolved type hints."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def is_plain_section(tp: Any) -> bool:
    """A dataclass whose keys are known statically (not a draccus choice type)."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp) and not is_choice_type(tp)


def _check_scalar(key: str, tp: Any, value: Any) -> None:
    """Reject YAML values whose type does not already match a scalar field (see module docstring)."""
    base, optional = unwrap_optional(tp)
    if value is None and optional:
        return
    allowed = _SCALARS.get(base)
    if allowed is None:
        return
    ok = isinstance(value, allowed) and (base is bool or not isinstance(value, bool))
    if not ok and base is float and isinstance(value, str):
        try:
            float(value)
            ok = True
        except ValueError:
            pass
    if not ok:
        hint = " (quote it in YAML to make it a string)" if base is str and value is not None else ""
        raise ConfigError(key, f"expected {base.__name__}{' or null' if optional else ''}, "
                               f"got {type(value).__name__} {value!r}{hint}")


def _decode_section(cls: type, raw: Any, path: Sequence[str]) -> Any:
    # draccus passes errors through only as DecodingError (anything else raised inside a nested field
    # gets rewrapped), so this hook speaks DecodingError and `decode` turns it into ConfigError.
    path = tuple(path)
    if is_choice_type(cls):
        return decode_choice_class(cls, raw, path)
    where = f" under {'.'.join(path)}" if path else ""
    fields = init_field_types(cls)
    if not isinstance(raw, Mapping):
        raise DecodingError(path, f"expected a mapping with keys {', '.join(fields)}; got {raw!r}")
    for name, value in raw.items():
        if name not in fields:
            raise DecodingError((*path, str(name)), f"unknown key{renamed('.'.join((*path, str(name))))}; "
                                f"valid keys{where}: {', '.join(fields)}")
        try:
            _check_scalar(name, fields[name], value)
        except ConfigError as e:
            raise DecodingError((*path, name), e.message) from None
    try:
        return decode_dataclass(cls, dict(raw), path)
    except DecodingError:
        raise
    except ParsingError as e:  # raised by the constructor, i.e. __post_init__
        cause = e.__cause__
        if isinstance(cause, ConfigError):
            raise DecodingError((*path, *filter(None, cause.key.split("."))), cause.message) from None
        raise DecodingError(path, str(cause) if cause is not None else str(e)) from cause


draccus.decode.register(Section, _decode_section, include_subclasses=True)


def decode(cls: type, data: Any) -> Any:
    """Plain data (as loaded from YAML) → an instance of config class `cls`; raises ConfigError."""
    if not (isinstance(cls, type) and issubclass(cls, Section) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r} is not a config class (a dataclass subclassing jaxrl.config.Section)")
    try:
        return draccus.decode(cls, {} if data is None else data)
    except DecodingError as e:
        raise ConfigError(".".join(map(str, e.key_path)), e.message) from None
    except ParsingError as e:
        raise ConfigError("", str(e)) from None
