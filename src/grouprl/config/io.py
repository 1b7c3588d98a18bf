"""A TrainConfig as YAML: read a file (`load`, `load_yaml`), build one from a mapping (`from_dict`),
write one (`save_yaml`), and what a resumed run changed against the config its first start wrote
(`changed_settings`). TrainConfig's methods of the same names call these."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .errors import ConfigError, unknown_field_hint
from .fieldtypes import field_types, list_item_type, value_matches
from .schema import TrainFields

C = TypeVar("C", bound=TrainFields)


class _YamlLoader(yaml.SafeLoader):
    """PyYAML reads YAML 1.1, where a float needs a dot: `1e-6` is the *string* '1e-6' there, and
    every learning rate written that way failed validation. This loader also reads `1e-6`, `3E5`
    and `-2e+3` as floats (as YAML 1.2 and JSON do); nothing else changes."""


class _YamlDumper(yaml.SafeDumper):
    """What `_YamlLoader` reads as a float, written quoted when it is a string: a run named `1e5`
    (or an output_dir `1e3`) was written bare, read back as 100000.0, and its config.yaml refused."""


for _resolving in (_YamlLoader, _YamlDumper):
    _resolving.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
        list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, with `1e-6` read as a float (`_YamlLoader`): config files and --field values."""
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader subclass)


def to_dict(cfg: TrainFields) -> dict[str, Any]:
    """{field: value}, as written to config.yaml."""
    return dataclasses.asdict(cfg)


RUN_CONFIG_HEADER = "# grouprl: this run's resolved config, written when it started (read by --resume and eval)\n"


def save_yaml(cfg: TrainFields, path: str | Path, *, absolute: bool = False) -> None:
    """Through a temporary file renamed into place: a kill mid-write leaves the previous file whole.
    `absolute`: a run's own config.yaml: local paths written absolute (`absolute_paths`), under
    RUN_CONFIG_HEADER, by which a new run tells its own file from a user's it must not overwrite."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    values = to_dict(cfg)
    text = yaml.dump(absolute_paths(values) if absolute else values, Dumper=_YamlDumper, sort_keys=False)
    tmp.write_text(RUN_CONFIG_HEADER + text if absolute else text)
    tmp.replace(path)


def from_dict(cls: type[C], values: dict[str, Any]) -> C:
    """A `cls` from {field: value}; ConfigError naming an unknown field (and the one it may mean). A
    string given to a list field is the list of that one string (`report_to: wandb`)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in values if k not in known]
    if unknown:
        hints = [f"{k!r}" + unknown_field_hint(k, known) for k in unknown]
        raise ConfigError(f"unknown config field(s): {', '.join(hints)}; "
                          "`grouprl train --help` lists every field")
    types = field_types()
    return cls(**{k: [v] if isinstance(v, str) and list_item_type(types[k]) is not None  # `report_to: wandb`
                  and not value_matches(v, types[k]) else v for k, v in values.items()})


def load(cls: type[C], path: str | Path | None = None, *, base: TrainFields | None = None) -> C:
    """Read a YAML file (optional) over `base` (default: the field defaults). Command-line
    overrides are applied on top by the CLI (cli_args.build_config)."""
    values: dict[str, Any] = to_dict(base) if base is not None else {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = load_yaml(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of field: value")
        values.update(loaded)
    return from_dict(cls, values)


PATH_FIELDS = ("model", "tokenizer", "train_data", "eval_data", "teacher_model")
"""Fields that may name a local file or folder (or a hub id, `builtin:NAME`)."""


HUB_PREFIX = "hf:"


def split_hub_source(value: str) -> tuple[str, str, str]:
    """`hf:NAME[:CONFIG][@SPLIT]` (a `datasets` dataset named in train_data/eval_data) as (NAME, CONFIG,
    SPLIT), each "" where not given."""
    spec, _, split = value.removeprefix(HUB_PREFIX).partition("@")
    path, _, config = spec.partition(":")
    return path, config, split


def absolute_paths(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each of PATH_FIELDS that names an existing local path made absolute: a run's
    config.yaml then means the same files from any folder (`grouprl eval --model RUN/checkpoints/..`
    run elsewhere reads the run's eval_data). Hub ids and `builtin:` names are left as they are."""
    out = dict(values)
    for k in PATH_FIELDS:
        v = out.get(k)
        if isinstance(v, str) and v.startswith(HUB_PREFIX):  # hf:FOLDER[:CONFIG][@SPLIT] of a local dataset folder
            path, config, split = split_hub_source(v)
            if path and Path(path).expanduser().exists():
                out[k] = (f"{HUB_PREFIX}{Path(path).expanduser().resolve()}" + (f":{config}" if config else "")
                          + (f"@{split}" if split else ""))
        elif isinstance(v, str) and v and not v.startswith("builtin:") and Path(v).expanduser().exists():
            out[k] = str(Path(v).expanduser().resolve())
    return out


def changed_settings(path: str | Path, cfg: TrainFields) -> dict[str, tuple[Any, Any]]:
    """{field: (value in the config file at `path`, value in `cfg`)} for each field that differs: what
    a resumed run changes against the config.yaml its first start wrote (paths compared as absolute:
    `data/x.jsonl` and the /abs/data/x.jsonl it was written as are the same). Empty without that file."""
    p = Path(path)
    try:
        before = load_yaml(p.read_text()) if p.is_file() else {}
    except yaml.YAMLError:
        return {}
    before = absolute_paths(before) if isinstance(before, dict) else {}
    now = absolute_paths(to_dict(cfg))
    return {k: (v, now[k]) for k, v in before.items() if k in now and k != "progress" and v != now[k]}
