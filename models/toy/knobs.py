"""The toy's knobs, typed: it takes no YAML ``model_kwargs`` (``ToyConfig``), and a request's
``model_kwargs`` are ``ToyRequest``. Imports no torch (the gateway's OpenAPI document reads it)."""

from __future__ import annotations

from pydantic import Field

from mstar.models.knobs import Knobs

MAX_PROMPT_BYTES = 4096
MAX_RELAY_BYTES = 1 << 30


class ToyConfig(Knobs):
    """The toy has no server knobs: any key in the YAML's model_kwargs is refused."""


class ToyRequest(Knobs):
    """A request's ``model_kwargs`` for the toy."""

    max_tokens: int = Field(256, ge=1, le=MAX_PROMPT_BYTES, description="bytes decoded at most")
    stop: str | None = Field(None, min_length=1, max_length=1, pattern=r"^[\x00-\x7f]$",
                             description="a byte that ends decoding when generated",
                             json_schema_extra={"what": "a single ASCII character"})
    delay_ms: float = Field(0.0, ge=0, le=10_000, description="the decoder sleeps this long per call")
    echo_delay_ms: float = Field(0.0, ge=0, le=10_000, description="echo (walk duet) sleeps this long per call")
    duet: bool = Field(False, description="run walk duet (decoder and echo as two running loops) instead of generate")
    echo_tail: int = Field(2, ge=1, le=16, description="echo's iterations after the decoder's stream ended")
    fail_at: int | None = Field(None, ge=0, description="the decoder raises at this iteration")
    relay_bytes: int | None = Field(None, ge=1, le=MAX_RELAY_BYTES,
                                    description="run walk relay: a tensor of this many bytes between two groups")

    RENAMED = {"max_output_tokens": "M* calls it max_tokens", "max_new_tokens": "M* calls it max_tokens"}
