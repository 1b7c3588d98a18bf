"""The command line into a `TrainConfig`: `--field value` overrides over a YAML file or the
embedded task, and the `grouprl train --help` text read from the fields' docstrings."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any

import yaml

from grouprl.config import ConfigError, TrainConfig, did_you_mean, field_types, load_yaml, value_matches

TASK_FIELDS = {"model", "train_data", "eval_data", "reward_funcs"}


def build_config(config_path: str | None, args: list[str]) -> TrainConfig:
    """`args` (`--field value ...`) over the YAML file `config_path`. With neither a config file nor
    any of TASK_FIELDS on the command line, the embedded task is the base; otherwise TrainConfig's
    own defaults are."""
    overrides = parse_overrides(args, field_types())
    base = None
    if config_path is None and not TASK_FIELDS & overrides.keys():
        from grouprl.tasks import DEFAULT_TASK

        base = TrainConfig.from_dict(dict(DEFAULT_TASK))
    return dataclasses.replace(TrainConfig.load(config_path, base=base), **overrides)


def parse_overrides(args: list[str], types: dict[str, Any]) -> dict[str, Any]:
    """`--field value` / `--field=value` pairs for the fields in `types` (name: type); values are
    parsed as YAML (`--beta 0.04`, `--learning_rate 1e-6`, `--reward_funcs '[a, b]'`), except that a
    text field keeps the text as typed. Dashes in names are accepted for underscores. A bare flag
    is `true`."""
    known = set(types)
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides take the form --field value")
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if name not in known:
            raise ConfigError(f"unknown option --{name}{did_you_mean(name, known)}; "
                              "`grouprl train --help` lists every field")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            else:
                value = "true"
        try:
            parsed = load_yaml(value) if value != "" else ""
        except yaml.YAMLError:
            parsed = value
        # A text field keeps the text as typed: `--output_dir 2024` or `--run_name 1e5` is not a number.
        out[name] = value if not value_matches(parsed, types[name]) and value_matches(value, types[name]) else parsed
        i += 1
    return out


def field_docs() -> dict[str, str]:
    """Each field's attribute docstring, read from TrainConfig's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(TrainConfig)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def help_text() -> str:
    """Every field with its type (as annotated), default and documentation."""
    docs = field_docs()
    lines = ["Config fields (YAML keys, or --field value on the command line):", ""]
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"  --{f.name} ({f.type}, default {default!r})")
        lines.extend("      " + s for s in textwrap.wrap(docs.get(f.name, ""), 88))
    return "\n".join(lines)
