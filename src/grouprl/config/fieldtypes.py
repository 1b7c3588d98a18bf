"""Each field's type, and whether a value has it: what validation checks and what the command line
parses `--field value` into (cli_args.py)."""

from __future__ import annotations

import typing
from typing import Any

from .errors import ConfigError
from .schema import TrainFields


def field_types() -> dict[str, Any]:
    """Each TrainConfig field's type, resolved (`float | None`, `list[str]`, ...)."""
    return typing.get_type_hints(TrainFields)


def _type_name(tp: Any) -> str:
    return str(tp).replace("typing.", "").replace("<class '", "").replace("'>", "")


def check_type(name: str, value: Any, tp: Any) -> None:
    """ConfigError naming the field and the expected type unless `value` is of type `tp` (`value_matches`)."""
    if value_matches(value, tp):
        return
    raise ConfigError(f"{name}={value!r} has the wrong type: expected {_type_name(tp)}")


def list_item_type(tp: Any) -> Any:
    """The item type of a list field (`list[str]`, `list[float] | None`), else None."""
    for t in (tp, *typing.get_args(tp)):
        if typing.get_origin(t) is list:
            return (typing.get_args(t) or (Any,))[0]
    return None


def value_matches(value: Any, tp: Any) -> bool:
    """Whether `value` is of type `tp` as validation checks it (an int is a float, a bool is neither)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(value_matches(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(value_matches(v, inner) for v in value)
    if origin is dict:
        key, val = typing.get_args(tp) or (Any, Any)
        return isinstance(value, dict) and all(value_matches(k, key) and value_matches(v, val)
                                               for k, v in value.items())
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)
