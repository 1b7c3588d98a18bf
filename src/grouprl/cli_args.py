"""The command line into a `TrainConfig`: `--field value` overrides over a YAML file or the
embedded task, and the `grouprl train --help` text read from the fields' docstrings."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import logging
import textwrap
import typing
from pathlib import Path
from typing import Any

import yaml

from grouprl.config import (ConfigError, TrainConfig, TrainFields, derived_overlong, field_types,
                            list_item_type, load_yaml, unknown_field_hint, value_matches, with_algorithm)

TASK_FIELDS = {"model", "train_data", "eval_data", "reward_funcs"}
logger = logging.getLogger(__name__)


def build_config(config_path: str | None, args: list[str], *, command: str = "train",
                 options: tuple[str, ...] = ()) -> TrainConfig:
    """`args` (`--field value ...`) over the YAML file `config_path`. With neither a config file nor
    any of TASK_FIELDS on the command line, the embedded task is the base; otherwise TrainConfig's
    own defaults are. `command` (train, eval, preflight) words the errors (a task left incomplete, an
    unknown option); `options`: the command's own flags, already taken out of `args`, suggested for
    a misspelt one (preflight's `--prompt 8`)."""
    overrides = parse_overrides(args, field_types(), command=command, options=options)
    base = None
    if config_path is None and not TASK_FIELDS & overrides.keys():
        from grouprl.tasks import DEFAULT_TASK

        base = TrainConfig.from_dict(dict(DEFAULT_TASK))
    elif config_path is None:
        _check_own_task(overrides, command)
    cfg = TrainConfig.load(config_path, base=base)
    if config_path is not None and "algorithm" in overrides and overrides["algorithm"] != cfg.algorithm:
        # a resolved config (a run's config.yaml) holds every field of its preset: switched, those
        # still at the old preset's values take the new one's, or --algorithm would change only the name
        old = cfg.algorithm
        cfg, changed = with_algorithm(cfg, overrides["algorithm"], keep=overrides.keys())
        if changed:
            logger.info("--algorithm %s over %s (algorithm %s): the fields at %s's values take %s's: %s",
                        cfg.algorithm, config_path, old, old, cfg.algorithm, ", ".join(changed))
    if config_path is not None:
        overrides = {**_derived_follow(cfg, overrides), **overrides}
    return dataclasses.replace(cfg, **overrides)


def _derived_follow(cfg: TrainConfig, overrides: dict[str, Any]) -> dict[str, Any]:
    """Over a run's config.yaml, fields it holds only because of another one follow that one when it is
    given anew: a new --model drops the old model's gguf_file (a checkpoint's model/ folder holds none),
    a new --max_completion_length the window derived from the old one (overlong_cache_len), and a new
    --epsilon alone the upper bound of a symmetric range (a grpo run's 0.2 / 0.2), as over a preset."""
    follow: dict[str, Any] = {}
    if "epsilon" in overrides and "epsilon_high" not in overrides and cfg.epsilon is not None and (
            cfg.epsilon_high == cfg.epsilon):
        follow["epsilon_high"] = overrides["epsilon"]
    if "model" in overrides and "gguf_file" not in overrides and cfg.gguf_file:
        follow["gguf_file"] = None
    if "max_completion_length" in overrides and "overlong_cache_len" not in overrides and derived_overlong(cfg):
        follow["overlong_cache_len"] = None  # derived again from the new length (validate.resolve_preset)
    return follow


def _check_own_task(overrides: dict[str, Any], command: str) -> None:
    """A task given field by field on the command line has all it needs: a model and reward functions,
    and the prompts `command` reads (eval: eval_data; train and preflight: train_data)."""
    data = "eval_data" if command == "eval" else "train_data"
    missing = [f"--{k}" for k in ("model", data, "reward_funcs") if k not in overrides]
    if command == "eval" and "eval_fraction" in overrides and "train_data" in overrides:
        missing.remove("--eval_data")  # held out of train_data
    if not missing:
        return
    given = ", ".join(f"--{k}" for k in sorted(TASK_FIELDS & overrides.keys()))
    if command != "eval":
        raise ConfigError(f"{given} without a config file starts a task of your own, which also needs "
                          f"{', '.join(missing)}; give them (or a config file), or leave out {given} "
                          f"to {command} on the embedded task")
    where = ""
    if "model" in overrides:
        where = (f" (--model {overrides['model']} is not a checkpoint inside a run folder, RUN/checkpoints/"
                 "step-N/model beside RUN/config.yaml, whose config eval would use by itself)")
    raise ConfigError(f"{given} without a config file evaluates on a task of your own, which also needs "
                      f"{', '.join(missing)}{where}; give them, or the config file the model was trained with "
                      f"(grouprl eval RUN/config.yaml {given} ...), or leave out {given} to evaluate on the "
                      "embedded task")


def run_of_checkpoint(args: list[str]) -> Path | None:
    """For `grouprl eval --model RUN/checkpoints/step-N/model` without a config file: RUN, the run
    folder that holds the checkpoint and the run's config.yaml (None when --model is not given or is
    not inside a run folder)."""
    from grouprl.checkpoint import checkpoint_dir

    model = parse_overrides(args, field_types(), command="eval").get("model")
    if not isinstance(model, str):
        return None
    for folder in Path(model).expanduser().resolve().parents:
        if folder == checkpoint_dir(folder.parent) and (folder.parent / "config.yaml").is_file():
            return folder.parent
    return None


_BOOL_WORDS = {"true", "false", "yes", "no", "on", "off", "y", "n", "1", "0", "null", "~"}  # YAML's, and what
# type-checks a bool field to an error: a bool field's flag takes them as its value, and anything else after it
# is the next argument (`grouprl train --resume run.yaml`, `--progress run.yaml`)


def parse_overrides(args: list[str], types: dict[str, Any], *, command: str = "train",
                    options: tuple[str, ...] = ()) -> dict[str, Any]:
    """`--field value` / `--field=value` pairs for the fields in `types` (name: type), each value read
    by `parse_value`. Dashes in names are accepted for underscores. A bare flag is `true` for a field
    that takes true/false, and an error naming the missing value for any other. An unknown name is
    matched against the fields and `options`, the flags of `command` itself, and the error points at
    `grouprl COMMAND --help`."""
    known = set(types)
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            first = (" (a config file comes right after the command: grouprl train CONFIG [--field value ...])"
                     if arg.endswith((".yaml", ".yml")) else "")
            raise ConfigError(f"unexpected argument {arg!r}: overrides take the form --field value{first}")
        name, eq, value = arg[2:].partition("=")
        name = name.replace("-", "_")
        if name not in known:
            # a misspelt flag of the command's own (preflight's --prompts) is no field: "did you mean
            # 'chat_prompts'?" misled, and so did `grouprl train --help` for preflight
            listed = f"{command}'s options and every field" if options else "every field"
            raise ConfigError(f"unknown option --{name}{unknown_field_hint(name, known | set(options))}; "
                              f"`grouprl {command} --help` lists {listed}")
        if not eq:
            flag = types[name] is bool and (i + 1 == len(args) or args[i + 1].lower() not in _BOOL_WORDS)
            if i + 1 < len(args) and not args[i + 1].startswith("--") and not flag:
                value = args[i + 1]
                i += 1
            elif value_matches(True, types[name]):
                value = "true"
            else:  # `--output_dir` then another option: most likely an unset shell variable
                raise ConfigError(f"--{name} needs a value: --{name} VALUE (or --{name}=VALUE); "
                                  f"`grouprl {command} --help` says what it takes")
        out[name] = parse_value(value, types[name], name)
        i += 1
    return out


def parse_value(text: str, tp: Any, name: str = "") -> Any:
    """One --field value for a field of type `tp` (the field `name`, for errors): YAML (`0.04`, `1e-6`,
    `null`, `[a, b]`), except that a text field keeps the text as typed (`--output_dir 2024` is not a
    number), and a list field also takes one value or comma-separated values (`--report_to wandb`,
    `--reward_funcs a,b`). A list or mapping in brackets that is not valid YAML is a ConfigError."""
    try:
        parsed = load_yaml(text) if text != "" else ""
    except yaml.YAMLError as e:
        if text.lstrip().startswith(("[", "{")) and _takes_structure(tp):
            # split on its commas, it failed on a piece of it (`reward_funcs[3]={'full': 'true}]'}`)
            # and the message blamed that piece, not the YAML
            raise ConfigError(f"--{name} {text} is not valid YAML: {e}\n{_yaml_fix(str(e))}") from None
        parsed = text
    inner = list_item_type(tp)
    if inner is not None and parsed is not None and not value_matches(parsed, tp) and not isinstance(parsed, list):
        if isinstance(parsed, dict):
            return [parsed]
        return [parse_value(piece.strip(), inner, name) for piece in text.split(",")]
    return text if not value_matches(parsed, tp) and value_matches(text, tp) else parsed


def _takes_structure(tp: Any) -> bool:
    """Whether a field of type `tp` takes a list or a mapping: a value of it in brackets is meant as YAML.
    A text field keeps such a value as typed (`--system_prompt '[INST] ...'`)."""
    return tp is Any or any(t is Any or typing.get_origin(t) in (list, dict) for t in (tp, *typing.get_args(tp)))


def _yaml_fix(error: str) -> str:
    """The fix for a --field value in brackets that YAML cannot read (`error`, YAML's message)."""
    if "escape" in error:
        return ("in YAML, a backslash in double quotes starts an escape, and \"\\d\" is none: single quotes keep "
                "backslashes as typed ('^\\d+$'), or double them in double quotes (\"^\\\\d+$\")")
    return ("write the value as YAML, a list [a, b] or a mapping {key: value}, with its brackets closed and any "
            "text holding ',', ':', '[' or '{' in quotes; in the shell, put the whole value in quotes")


def field_docs() -> dict[str, str]:
    """Each field's attribute docstring, read from the source of TrainConfig's fields (config/schema.py)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(TrainFields)))
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
