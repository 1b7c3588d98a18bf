"""Reward functions by name: `BUILTIN_REWARDS`, `resolve_reward_func` and `resolve_reward_spec`.

`BUILTIN_REWARDS` is a `grouprl.core.Registry`: an entry is a reward function (no parameters) or,
registered with `factory=True`, a factory (parameters -> reward function). A config names a
built-in ("math_accuracy", "regex_match" with pattern=...) or any function by import path
("package.module:function"); with parameters, an imported target is called with them to build the
reward function. Names and import paths are resolved as tools' are (grouprl.importpath.resolve_spec).
"""

from __future__ import annotations

from typing import Any, Callable

from grouprl.core.registry import Registry

from ..importpath import resolve_spec, split_spec
from .code import code_tests
from .format import regex_match, think_format, think_format_soft
from .math import math_accuracy
from .model import reward_model
from .prm import process_reward_model
from .shaping import cosine_length, length_target, overlong_penalty, repetition_penalty

BUILTIN_REWARDS: Registry[Callable] = Registry("reward", "grouprl.rewards.BUILTIN_REWARDS.register")
for _func in (math_accuracy, think_format, think_format_soft):
    BUILTIN_REWARDS.register(_func.__name__)(_func)
for _func in (regex_match, length_target, cosine_length, repetition_penalty, overlong_penalty, code_tests,
              reward_model, process_reward_model):
    BUILTIN_REWARDS.register(_func.__name__, factory=True)(_func)
del _func

_CALLED_AS = (" (it is called as f(prompts, completions, **columns) and returns one float or None per "
       "completion).")


def resolve_reward_func(spec: str, **params: Any) -> Callable:
    """A reward function from a built-in name or an import path "package.module:function". A reward
    a factory builds is named after the built-in, or the imported attribute, unless it has a name."""
    func, built = resolve_spec(spec, BUILTIN_REWARDS, params, kind="reward",
                               forms="a built-in name or 'package.module:function'", how=_CALLED_AS)
    if built and not getattr(func, "__name__", None):
        func.__name__ = spec.rpartition(":")[2].rsplit(".", 1)[-1]
    return func


def resolve_reward_spec(spec: Any) -> Callable:
    """A reward function from a `reward_funcs` config entry: a name, a module:function path, or a
    mapping with `name` and the function's parameters."""
    if not isinstance(spec, (str, dict)):
        raise ValueError(f"reward_funcs entry {spec!r} must be a name, a module:function path or a mapping")
    try:
        name, params = split_spec(spec)
    except ValueError as e:
        raise ValueError(f"reward_funcs entry {spec!r}: {e}") from None
    return resolve_reward_func(name, **params)
