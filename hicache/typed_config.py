"""Building frozen config dataclasses from URL query strings, CLI flags and files.

Values arrive as strings (``?fsync=true&max_bytes=10G``) or already typed (keyword arguments);
:func:`build_config` turns them into the dataclass's field types and refuses unknown fields with
a message that lists the known ones.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import types
import typing
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, TypeVar

from hicache.errors import ConfigError

__all__ = ["build_config", "parse_bool", "parse_duration", "parse_size"]

T = TypeVar("T")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*\Z", re.ASCII)


def parse_size(text: str) -> int:
    """``"512M"`` -> 536870912. Units are binary (K = 1024); a bare number is bytes.

    The number is read exactly (``"1.5K"`` is 1536), so a huge or fractional value is either
    exact or refused, never rounded through a float.
    """
    match = _SIZE_RE.match(text.lower().replace("_", "")) if isinstance(text, str) else None
    if match is None or match.group(2) not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use a number with an optional K, M, G or T)")
    value = Fraction(match.group(1)) * _SIZE_UNITS[match.group(2)]
    if value.denominator != 1:
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdw]?)\s*\Z", re.ASCII)


def parse_duration(text: str) -> float:
    """``"90s"``, ``"15m"``, ``"12h"``, ``"7d"``, ``"2w"`` -> seconds; a bare number is seconds."""
    match = _DURATION_RE.match(text.lower()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"not a duration: {text!r} (use a number with s, m, h, d or w)")
    seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if not math.isfinite(seconds):  # a few hundred digits overflow a float
        raise ValueError(f"not a duration: {text!r} (too large)")
    return seconds


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true or false)")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _coerce_enum(tp: type[enum.Enum], value: Any) -> enum.Enum:
    if isinstance(value, tp):
        return value
    text = str(value).strip().lower()
    for member in tp:
        # A member is named by its name, or by its label or str value where it has one.
        names = {member.name.lower()}
        for alias in (getattr(member, "label", None), member.value):
            if isinstance(alias, str) and alias:
                names.add(alias.lower())
        if text in names:
            return member
    raise ValueError(f"use one of {', '.join(m.name.lower() for m in tp)}")


def _coerce_float(value: Any) -> float:
    """A float field's value: a number, or text that is one; never NaN (it compares false with
    everything, so no range check would catch it)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"expected float, got {type(value).__name__}")
    try:
        number = float(value)
    except (ValueError, OverflowError):  # an int too large for a float overflows
        raise ValueError(f"not a number: {value!r}") from None
    if math.isnan(number):
        raise ValueError("must be a number, not NaN")
    return number


def _coerce(name: str, tp: Any, value: Any) -> Any:
    tp, optional = _unwrap_optional(tp)
    if isinstance(value, str) and optional and value.strip().lower() in ("", "none", "null"):
        value = None
    if value is None:
        if optional:
            return None
        raise ValueError("may not be None")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _coerce_enum(tp, value)
    if tp is float:
        return _coerce_float(value)
    if not isinstance(value, str):
        # bool is an int subclass, but True for a size or a count is a mistake, not 1.
        wrong_bool = isinstance(value, bool) and tp is not bool
        if wrong_bool or (isinstance(tp, type) and not isinstance(value, tp)):
            expected = getattr(tp, "__name__", str(tp))
            raise ValueError(f"expected {expected}, got {type(value).__name__}")
        return value
    if tp is bool:
        return parse_bool(value)
    if tp is int:
        # A byte count takes K/M/G/T suffixes: fields named *bytes, and capacity.
        is_size = name.endswith("bytes") or name == "capacity"
        return parse_size(value) if is_size else int(value)
    if tp is str:
        return value
    raise ValueError(f"cannot be set from text (type {tp})")


def build_config(config_type: type[T], values: Mapping[str, Any]) -> T:
    """An instance of the frozen dataclass ``config_type`` from ``values``.

    Raises :class:`ConfigError` naming the field for an unknown field or a bad value.
    """
    if not dataclasses.is_dataclass(config_type):
        raise TypeError(f"{config_type!r} is not a dataclass")
    hints = typing.get_type_hints(config_type)
    fields = {f.name: f for f in dataclasses.fields(config_type) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields)) or "(none)"
        raise ConfigError(
            f"{config_type.__name__}: unknown option(s) {', '.join(unknown)}; known: {known}"
        )
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        try:
            kwargs[key] = _coerce(key, hints[key], value)
        except ValueError as exc:
            raise ConfigError(f"{config_type.__name__}.{key} = {value!r}: {exc}") from None
    try:
        return config_type(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{config_type.__name__}: {exc}") from None
