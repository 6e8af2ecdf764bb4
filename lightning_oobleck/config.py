"""Structured configuration: dataclass schemas loaded from YAML and overridden with ``key=value`` pairs.

Every configurable part of the project declares a dataclass (its schema) and loads it with
:func:`load_config`, which layers ``defaults < YAML file < dot-list overrides`` through OmegaConf and
turns OmegaConf's errors into one-line :class:`ConfigError` messages that name the key and the fix. A
schema may define ``validate(self) -> None`` raising ``ValueError`` for constraints types cannot say.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException, ValidationError

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot be loaded: the message names the key and what to do."""


def _valid_keys(schema: Any) -> str:
    if dataclasses.is_dataclass(schema):
        return ", ".join(f.name for f in dataclasses.fields(schema))
    return "?"


def load_config(schema: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """An instance of the dataclass ``schema`` from its defaults, a YAML file and ``key=value`` overrides.

    Nested keys use dots (``cluster.num_nodes=16``). Raises :class:`ConfigError` for a missing file,
    a malformed override, an unknown key (listing the valid ones), a value of the wrong type, a
    mandatory value left unset, or a failed ``validate()``.
    """
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. cluster.num_nodes=16)")
    if path is None:
        return structured(schema, OmegaConf.from_dotlist(list(overrides)), source="the overrides")
    if not Path(path).is_file():
        raise ConfigError(f"config file {path} not found: pass an existing YAML file")
    try:
        node = OmegaConf.load(path)
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot read the configuration from {path}: {e.msg}") from e
    from_file = structured(schema, node, source=str(path))  # its errors name the file
    if not overrides:
        return from_file
    return structured(schema, node, OmegaConf.from_dotlist(list(overrides)), source="the overrides")


def structured(schema: type[T], *nodes: Any, source: str) -> T:
    """An instance of the dataclass ``schema``: its defaults, then ``nodes`` (OmegaConf nodes or dicts) merged
    over them, then its ``validate()``. Errors are :class:`ConfigError` naming the key, ``source`` and the
    fix (an unknown key: the closest valid one and the valid keys)."""
    try:
        instance = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), *nodes))
    except ConfigKeyError as e:
        valid = _valid_keys(e.object_type)
        close = difflib.get_close_matches(str(e.key), valid.split(", "), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown key {e.full_key!r} in {source}{hint}; valid keys here: {valid}") from e
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} has no value: set it in the YAML file or as {e.full_key}=...") from e
    except ValidationError as e:
        raise ConfigError(f"{e.full_key}: {e.msg} (in {source})") from e
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot read the configuration from {source}: {e.msg}") from e
    validate = getattr(instance, "validate", None)
    if callable(validate):
        try:
            validate()
        except ValueError as e:
            raise ConfigError(str(e)) from e
    return instance  # type: ignore[return-value]
