"""Typed knobs: a model's YAML ``model_kwargs`` and a request's ``model_kwargs`` as pydantic models.

A model declares ``class MyConfig(Knobs)`` / ``class MyRequest(Knobs)`` with one typed field per
knob (its default and range in the field); ``parse`` returns the instance or raises ``KnobError``
naming the key and what it must be, e.g. ``model_kwargs.snac_dtype must be one of float32,
bfloat16, float16, got 'fp8'`` or ``model_kwargs.tempreature: unknown key for model 'orpheus'; did
you mean 'temperature'? known: ...``. Unknown keys are refused; spellings other servers use
(``RENAMED``) are refused naming ours. The gateway's OpenAPI document takes each model's request
schema from the same classes (``json_schema``). Only pydantic is imported here: the gateway reads
these schemas without torch.
"""

from __future__ import annotations

import difflib
import json
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator


class KnobError(ValueError):
    """A knob is unknown or out of range; ``key`` is e.g. ``model_kwargs.temperature``."""

    def __init__(self, key: str, message: str, sep: str = ": "):
        super().__init__(f"{key}{sep}{message}")
        self.key, self.description = key, message


class Knobs(BaseModel):
    """Base of a model's knob schemas: strict types (no "1" for 1, no true for 1), unknown keys
    refused, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    #: keys other servers or the original M* docs use -> what to write instead (they are refused
    #: with that hint, never silently taken)
    RENAMED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _integers_are_integers(cls, data: Any) -> Any:
        """pydantic accepts 3.0 for Literal[3, 4] even when strict: refuse it as for int fields."""
        if isinstance(data, Mapping):
            for name, field in cls.model_fields.items():
                args = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is Literal else ()
                value = data.get(name)
                if args and all(type(a) is int for a in args) and name in data and type(value) is not int:
                    raise KnobError(name, f"must be {_what(cls.model_json_schema()['properties'][name])}, got "
                                          f"{value!r}", sep=" ")
        return data

    @classmethod
    def parse(cls, data: Mapping[str, Any] | None, *, model: str = "", prefix: str = "model_kwargs.",
              sep: str = " "):
        """``data`` checked and completed with the defaults; KnobError names the first problem
        (``sep`` between the key and the message: " " in configs, ": " in request errors)."""
        data = dict(data or {})
        known = sorted(cls.model_fields)
        for key in data:
            if key in cls.RENAMED:
                raise KnobError(prefix + key, f"not a knob of this model: {cls.RENAMED[key]}", sep=": ")
            if key not in cls.model_fields:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                who = f" for model '{model}'" if model else ""
                raise KnobError(prefix + key, f"unknown key{who}; {hint}known: {', '.join(known)}", sep=": ")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            key = str(err["loc"][0]) if err["loc"] else ""
            inner = err.get("ctx", {}).get("error")
            if isinstance(inner, KnobError):
                raise KnobError(prefix + inner.key, inner.description, sep=sep) from None
            what = _what(cls.model_json_schema()["properties"].get(key, {}))
            raise KnobError(prefix + key, f"must be {what}, got {data.get(key)!r}", sep=sep) from None

    def given(self) -> dict[str, Any]:
        """The knobs as a plain dict, defaults included."""
        return self.model_dump()

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The JSON schema of the knobs (OpenAPI 3.1), each field's range and default in it."""
        schema = cls.model_json_schema()
        for prop in schema.get("properties", {}).values():
            prop.pop("title", None)
            if "what" in prop:  # for error messages only
                prop.pop("what")
                for alt in prop.get("anyOf", []):
                    alt.pop("what", None)
        return schema


def _what(prop: dict[str, Any]) -> str:
    """What a value must be, from a field's JSON schema: "an integer in [1, 8192]", "one of a, b"
    (a field may say it itself: ``json_schema_extra={"what": ...}``)."""
    if "what" in prop:
        return prop["what"]
    if "anyOf" in prop:
        parts = [_what(p) for p in prop["anyOf"]]
        return ", ".join(parts[:-1]) + " or " + parts[-1]
    if "const" in prop:
        return json.dumps(prop["const"])
    if "enum" in prop:
        values = [str(v) for v in prop["enum"]]
        return " or ".join(values) if len(values) == 2 else "one of " + ", ".join(values)
    kind = {"integer": "an integer", "number": "a number", "boolean": "true or false", "string": "a string",
            "null": "null"}.get(prop.get("type", ""), "a value")
    lo = prop.get("minimum", prop.get("exclusiveMinimum"))
    hi = prop.get("maximum", prop.get("exclusiveMaximum"))
    step = f", a multiple of {prop['multipleOf']}" if "multipleOf" in prop else ""
    if lo is not None and hi is not None:
        left = "(" if "exclusiveMinimum" in prop else "["
        right = ")" if "exclusiveMaximum" in prop else "]"
        return f"{kind} in {left}{lo}, {hi}{right}{step}"
    if lo is not None:
        return (f"{kind} > {lo}" if "exclusiveMinimum" in prop else f"{kind} >= {lo}") + step
    if hi is not None:
        return (f"{kind} < {hi}" if "exclusiveMaximum" in prop else f"{kind} <= {hi}") + step
    return kind + step
