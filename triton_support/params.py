"""Parse Triton ``config.pbtxt`` parameters into one frozen config dataclass per model.

Triton hands a Python model its parameters as
``{"name": {"string_value": "..."}}``.  Every field of the target dataclass
may be set; a parameter that names no field, a value left as an unrendered
``${PLACEHOLDER}``, or a value of the wrong type fails model loading loudly.

Written here rather than with pydantic (which the project pins): every value
arrives as a string, so pydantic would have to run in lax mode, and its lax
``bool`` takes ``yes``/``on``/``t`` and its lax ``int`` takes ``"1.0"``;
the placeholder check, the unknown-name message that lists the known names
and the ``str | None`` from an empty string would still be ours.  The target
configs stay plain frozen dataclasses that the engines use without this module.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Final, TypeVar

from grammar_backend.errors import ConfigError

T = TypeVar("T")

_PLACEHOLDER = re.compile(r"\$\{[A-Za-z0-9_]+\}")


#: Parameters Triton itself reads (the Python backend's own environment), not the model.
TRITON_PARAMETERS: Final = frozenset({"EXECUTION_ENV_PATH"})


def parameter_values(model_config: Mapping[str, Any]) -> dict[str, str]:
    """The ``parameters`` of a parsed Triton model config as plain strings (less :data:`TRITON_PARAMETERS`)."""
    raw = model_config.get("parameters", {}) or {}
    return {name: str(value.get("string_value", "")) for name, value in raw.items() if name not in TRITON_PARAMETERS}


def from_parameters(cls: type[T], params: Mapping[str, str], model: str) -> T:
    """Build the frozen dataclass ``cls`` from string parameters.

    Parameters
    ----------
    cls : type
        A dataclass whose fields are ``str``, ``int``, ``float``, ``bool``,
        ``str | None`` or a tuple of ints.
    params : mapping of str to str
    model : str
        The model name, for error messages.

    Raises
    ------
    ConfigError
        Unknown parameter, unrendered placeholder, missing required field or bad value.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ConfigError(f"{model}: unknown parameter {unknown[0]!r}; known: {', '.join(sorted(fields))}")
    values: dict[str, Any] = {}
    for name, text in params.items():
        if _PLACEHOLDER.search(text):
            raise ConfigError(f"{model}: parameter {name!r} has an unfilled placeholder {text!r}")
        values[name] = _convert(model, name, text, hints[name])
    missing = [
        name for name, f in fields.items()
        if name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{model}: missing required parameter {missing[0]!r}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{model}: {err}") from err


def _convert(model: str, name: str, text: str, hint: Any) -> Any:
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    if optional and text == "":
        return None
    try:
        if hint is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"expected true or false, got {text!r}")
            return text.lower() in ("true", "1")
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
        if hint is str:
            return text
        if typing.get_origin(hint) is tuple:
            items = json.loads(text) if text.strip().startswith("[") else [t for t in text.split(",") if t.strip()]
            return tuple(int(t) for t in items)
    except (ValueError, json.JSONDecodeError) as err:
        raise ConfigError(f"{model}: parameter {name!r}: {err}") from err
    raise ConfigError(f"{model}: parameter {name!r} has an unsupported type {hint!r}")
