"""API keys on the gateway: ``Authorization: Bearer <key>`` (as OpenAI clients send it).

Every route needs a key when the gateway has keys, except ``OPEN_PATHS``: ``/health`` (load
balancers and the launcher poll it), ``/metrics`` (the Prometheus scraper on the mesh's network;
Envoy does not route it) and ``/openapi.json`` (the API's public description). A missing or
unknown key is 401 with the OpenAI error shape and ``code: UNAUTHENTICATED``. The caller's key
goes on to the conductor as gRPC metadata (``CALLER_METADATA``, read by ConductorClient), where
the same keys are checked again and each key's concurrency limit is kept (429 beyond it).
"""

from __future__ import annotations

from contextvars import ContextVar

from aiohttp import web

from mstar.auth import ApiKeys, bearer
from mstar.gateway.errors import ApiError

API_KEYS = web.AppKey("api_keys", ApiKeys)
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})
#: the authenticated caller's gRPC metadata, set for the handler's task (its calls to the conductor carry it)
CALLER_METADATA: ContextVar[tuple[tuple[str, str], ...]] = ContextVar("caller_metadata", default=())
#: the authenticated caller's key id (mstar.auth.key_id), set for the handler's task; "" without keys
CALLER_KEY_ID: ContextVar[str] = ContextVar("caller_key_id", default="")


def caller_of(request: web.Request) -> str:
    """Who sends ``request``, for per-caller fairness (json_fair.py): its API key's id, or without
    keys its client address (behind a proxy, the proxy's: all its clients are one caller then)."""
    return CALLER_KEY_ID.get() or f"address {request.remote}"


def unauthenticated() -> web.Response:
    return ApiError(401, "missing or unknown API key: send the header 'Authorization: Bearer <key>'",
                    code="UNAUTHENTICATED").response({"WWW-Authenticate": 'Bearer realm="mstar"'}, openai=True)


@web.middleware
async def require_api_key(request: web.Request, handler) -> web.StreamResponse:
    keys = request.app[API_KEYS]
    if not keys.enabled or request.path in OPEN_PATHS:
        return await handler(request)
    token = bearer(request.headers.get("Authorization"))
    kid = keys.identify(token)
    if kid is None:
        return unauthenticated()
    CALLER_METADATA.set((("authorization", f"Bearer {token}"),))
    CALLER_KEY_ID.set(kid)
    return await handler(request)
