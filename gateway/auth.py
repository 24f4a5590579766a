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


def unauthenticated() -> web.Response:
    return ApiError(401, "missing or unknown API key: send the header 'Authorization: Bearer <key>'",
                    code="UNAUTHENTICATED").response({"WWW-Authenticate": 'Bearer realm="mstar"'}, openai=True)


@web.middleware
async def require_api_key(request: web.Request, handler) -> web.StreamResponse:
    keys = request.app[API_KEYS]
    if not keys.enabled or request.path in OPEN_PATHS:
        return await handler(request)
    token = bearer(request.headers.get("Authorization"))
    if keys.identify(token) is None:
        return unauthenticated()
    CALLER_METADATA.set((("authorization", f"Bearer {token}"),))
    return await handler(request)
