"""API keys for M*'s public surfaces (the gateway's HTTP routes, the conductor's Conductor API).

Keys come from a file (``--api-keys-file``: one key per line, ``#`` comments) and/or the
environment (``MSTAR_API_KEYS``, comma-separated). Clients send ``Authorization: Bearer <key>``
(HTTP header, as OpenAI clients do; gRPC metadata ``authorization``). A key is never logged:
logs and errors name it by ``key_id`` (a hash prefix). Lookups compare every key in constant
time. No keys configured: the public surfaces are open (loopback development).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass, field
from pathlib import Path

from mstar.env import settings

log = logging.getLogger(__name__)

MIN_KEY_CHARS = 16
API_KEYS_HELP = ("file of API keys, one per line ('#' starts a comment); clients send 'Authorization: Bearer <key>'. "
                 "Also MSTAR_API_KEYS (comma-separated). Without keys the public API is open")
PER_KEY_HELP = "most in-flight requests one API key may have (0: no limit); past it RESOURCE_EXHAUSTED / HTTP 429"


class ApiKeyError(ValueError):
    """A key file or variable that cannot be used."""


def key_id(key: str) -> str:
    """What logs and errors call a key: never the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class ApiKeys:
    keys: tuple[bytes, ...] = field(default=(), repr=False)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    @classmethod
    def load(cls, path: str | None = None, env_value: str | None = None) -> ApiKeys:
        """Keys of ``path`` (a file) and of ``env_value`` (default: MSTAR_API_KEYS)."""
        found: list[str] = []
        if path:
            try:
                text = Path(path).expanduser().read_text()
            except OSError as e:
                raise ApiKeyError(f"--api-keys-file {path}: cannot read it: {e.strerror or e}") from None
            for n, line in enumerate(text.splitlines(), 1):
                line = line.split("#", 1)[0].strip()
                if line:
                    found.append(_checked(line, f"--api-keys-file {path}, line {n}"))
        env_value = settings().api_keys if env_value is None else env_value
        for i, part in enumerate(env_value.split(",")):
            if part.strip():
                found.append(_checked(part.strip(), f"MSTAR_API_KEYS, entry {i + 1}"))
        return cls(tuple(dict.fromkeys(k.encode() for k in found)))

    def identify(self, token: str | None) -> str | None:
        """The key id of ``token`` if it is one of the keys, else None. Every key is compared
        (hmac.compare_digest), so the time taken does not say how close a guess came."""
        if token is None:
            return None
        given = token.encode()
        match = None
        for k in self.keys:
            if hmac.compare_digest(k, given):
                match = k
        return None if match is None else key_id(match.decode())


#: no keys: the public surfaces are open
NO_KEYS = ApiKeys()


def _checked(key: str, where: str) -> str:
    if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        raise ApiKeyError(f"{where}: an API key must be at least {MIN_KEY_CHARS} characters without spaces "
                          f"(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return key


def bearer(value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (None if absent or another scheme)."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


class KeyLimiter:
    """In-flight requests per key id, at most ``limit`` each (0: unlimited)."""

    def __init__(self, limit: int = 0):
        if limit < 0:
            raise ValueError(f"per-key in-flight limit must be >= 0, got {limit}")
        self.limit = limit
        self.inflight: dict[str, int] = {}

    def acquire(self, kid: str) -> bool:
        n = self.inflight.get(kid, 0)
        if self.limit and n >= self.limit:
            return False
        self.inflight[kid] = n + 1
        return True

    def release(self, kid: str) -> None:
        n = self.inflight.get(kid, 0) - 1
        if n > 0:
            self.inflight[kid] = n
        else:
            self.inflight.pop(kid, None)
