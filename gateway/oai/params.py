"""Reading an OpenAI request body parameter by parameter, each error naming its parameter.

Usage: ``p = Params(body)``, take every parameter the route honours (``p.string("model",
required=True)``, ``p.knob("temperature", NUMBER)``...), then ``p.finish(neutral)``: whatever
is left is refused with a 400, unless its value is one that changes nothing (``n: 1``).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from mstar.gateway.errors import ApiError, bad_request
from mstar.gateway.json_bounds import json_type

#: JSON kinds: (name for messages, isinstance check)
STRING = ("a string", lambda v: isinstance(v, str))
BOOL = ("a boolean", lambda v: isinstance(v, bool))
INTEGER = ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
NUMBER = ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool))
OBJECT = ("an object", lambda v: isinstance(v, dict))
ARRAY = ("an array", lambda v: isinstance(v, list))
STRING_OR_STRINGS = ("a string or an array of strings",
                     lambda v: isinstance(v, str) or isinstance(v, list) and all(isinstance(x, str) for x in v))
Kind = tuple[str, Callable[[object], bool]]
#: a known OpenAI parameter M* does not honour: (is this value harmless?, why it is refused otherwise)
Known = tuple[Callable[[object], bool], str]


def never(_value: object) -> bool:
    return False


def exactly(expected: object) -> Callable[[object], bool]:
    """Equal and of the same JSON type (``True == 1`` in Python, not in JSON)."""
    return lambda v: type(v) is type(expected) and v == expected
_MISSING = object()


class Params:
    def __init__(self, body: dict):
        self._body = dict(body)
        #: model kwarg -> the OpenAI parameter it came from (to name it in the conductor's errors)
        self.param_of: dict[str, str] = {}
        self.model_kwargs: dict = {}
        #: the request field each GenerateRequest file came from (a conductor error about ``files[i]``
        #: names it), and the field for errors about the files as a whole
        self.file_params: list[str] = []
        self.files_param: str | None = None

    def take(self, name: str, kind: Kind, *, required: bool = False):
        value = self._body.pop(name, _MISSING)
        if value is _MISSING or value is None:
            if required:
                raise bad_request(name, f"{name}: required")
            return None
        what, ok = kind
        if not ok(value):
            raise bad_request(name, f"{name}: must be {what}, got {json_type(value)}")
        return value

    def string(self, name: str, *, required: bool = False, choices: tuple[str, ...] | None = None,
               default: str | None = None) -> str | None:
        value = self.take(name, STRING, required=required)
        if required and not value:
            raise bad_request(name, f"{name}: must not be empty")
        if value is not None and choices is not None and value not in choices:
            raise bad_request(name, f"{name}: {value!r} is not supported; use one of {', '.join(choices)}")
        return default if value is None else value

    def knob(self, name: str, kind: Kind, kwarg: str | None = None) -> None:
        """A parameter passed to the model as ``model_kwargs[kwarg]`` (default: the same name);
        the model accepts or refuses it, and a refusal is reported under ``name``."""
        value = self.take(name, kind)
        if value is None:
            return
        kwarg = kwarg or name
        if kwarg in self.model_kwargs:
            raise bad_request(name, f"{name}: conflicts with {self.param_of.get(kwarg, 'model_kwargs.' + kwarg)}, "
                                    f"which sets the same model kwarg '{kwarg}'")
        self.model_kwargs[kwarg] = value
        self.param_of[kwarg] = name

    def extension_kwargs(self) -> None:
        """M*'s extension ``model_kwargs``: model-specific knobs with no OpenAI name."""
        extra = self.take("model_kwargs", OBJECT)
        for key, value in (extra or {}).items():
            if key in self.model_kwargs:
                raise bad_request(f"model_kwargs.{key}", f"model_kwargs.{key}: also set by "
                                                         f"'{self.param_of[key]}'; give it once")
            self.model_kwargs[key] = value

    def route_kwargs(self, kwargs: dict, who: str) -> None:
        """Model kwargs the route itself sends (a model's ModelApi kwargs); the client may not set them."""
        for key, value in kwargs.items():
            if key in self.model_kwargs:
                param = self.param_of.get(key, f"model_kwargs.{key}")
                raise bad_request(param, f"{param}: {who} sets the model kwarg '{key}' itself ({_short(value)}); "
                                         "leave it out")
            self.model_kwargs[key] = value

    def set_kwarg(self, kwarg: str, value: object, param: str) -> None:
        """A model kwarg the route derives from ``param``; the client's model_kwargs may not set it too."""
        if kwarg in self.model_kwargs:
            raise bad_request(f"model_kwargs.{kwarg}", f"model_kwargs.{kwarg}: also set by '{param}'; give it once")
        self.model_kwargs[kwarg] = value
        self.param_of[kwarg] = param

    def finish(self, known: dict[str, Known], route: str) -> None:
        """Refuse every parameter not taken. A known OpenAI parameter passes only with a value
        that changes nothing (``known[name][0](value)``), else its reason is the 400's message;
        null values are absent."""
        for name, value in self._body.items():
            if value is None:
                continue
            if name in known:
                harmless, reason = known[name]
                if harmless(value):
                    continue
                raise bad_request(name, f"{name}: {_short(value)} is not supported: {reason}")
            raise bad_request(name, f"{name}: unknown parameter for {route}")

    def remap(self, error: ApiError, model: str, text_param: str) -> ApiError:
        """A conductor INVALID_ARGUMENT about ``model_kwargs.X`` or ``text``, renamed to the
        OpenAI parameter the client sent."""
        field = error.field or ""
        kwarg = field.removeprefix("model_kwargs.") if field.startswith("model_kwargs.") else None
        if kwarg in self.param_of:
            param = self.param_of[kwarg]
        elif field == "text":
            param = text_param
        elif field.startswith("files[") and (i := _index(field)) is not None and i < len(self.file_params):
            param = self.file_params[i]
        elif field.startswith("files") and self.files_param is not None:
            param = self.files_param
        else:
            return error
        return ApiError(error.status, f"{param}: model '{model}' rejected it: {error.message}", code=error.code,
                        field=param)


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _index(field: str) -> int | None:
    """``files[3].data`` -> 3."""
    inside = field[len("files["):].split("]", 1)[0]
    return int(inside) if inside.isdigit() else None
