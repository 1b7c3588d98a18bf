"""Typed run configuration: `TrainConfig`, by job.

- schema.py     the fields, each with its documentation (`grouprl train --help` prints them)
- validate.py   the preset filled in, and every value checked before any model loads
- io.py         YAML: read, write, and what a resumed run changed (`changed_settings`)
- fieldtypes.py each field's type and whether a value has it (validation and cli_args.py)
- errors.py     ConfigError

Every value is validated in :meth:`TrainConfig.validate`, before any model is loaded; files are
probed by their loaders (``policy.check_model_source``, ``data.check_data_source``), also before.
This package touches no file but the YAML it reads or writes, and imports none of its dependents.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from . import io
from .errors import ConfigError, did_you_mean, unknown_field_hint
from .fieldtypes import field_types, list_item_type, value_matches
from .io import RUN_CONFIG_HEADER, changed_settings, load_yaml
from .schema import TrainFields
from .validate import (PRESET_FIELDS, derived_overlong, parse_eval_metric, resolve_preset, validate_config,
                       with_algorithm)


_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainFields))


class TrainConfig(TrainFields):
    """A run's configuration: the fields of `TrainFields` (schema.py, each documented there), with
    the methods that resolve and validate them (validate.py) and read and write them (io.py)."""

    def __init__(self, *args: Any, **fields: Any) -> None:
        unknown = [k for k in fields if k not in _FIELDS]
        if unknown:  # the dataclass's own TypeError names no field it may mean
            hints = [f"{k!r}" + unknown_field_hint(k, _FIELDS) for k in unknown]
            raise ConfigError(f"unknown config field(s): {', '.join(hints)}; `grouprl train --help` lists every field")
        super().__init__(*args, **fields)

    def resolved(self) -> TrainConfig:
        """A copy with the preset's values filled into every algorithm field left at None."""
        return resolve_preset(self)

    def validate(self) -> TrainConfig:
        """Check every field; raise ConfigError naming the field and the fix. Returns the resolved copy.
        Paths are not probed here: the loaders do it (policy.check_model_source, data.check_data_source)."""
        return validate_config(self)

    def to_dict(self) -> dict[str, Any]:
        return io.to_dict(self)

    def save_yaml(self, path: str | Path, *, absolute: bool = False) -> None:
        io.save_yaml(self, path, absolute=absolute)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        return io.from_dict(cls, values)

    @classmethod
    def load(cls, path: str | Path | None = None, *, base: TrainConfig | None = None) -> TrainConfig:
        """Read a YAML file (optional) over `base` (default: the field defaults). Command-line
        overrides are applied on top by the CLI (cli_args.build_config)."""
        return io.load(cls, path, base=base)


__all__ = [
    "PRESET_FIELDS",
    "RUN_CONFIG_HEADER",
    "ConfigError",
    "TrainConfig",
    "TrainFields",
    "changed_settings",
    "derived_overlong",
    "did_you_mean",
    "unknown_field_hint",
    "field_types",
    "list_item_type",
    "load_yaml",
    "parse_eval_metric",
    "value_matches",
    "with_algorithm",
]
