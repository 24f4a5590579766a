"""The REST gateway: an aiohttp application translating HTTP into Conductor gRPC calls.

Routes: ``POST /generate`` (generate.py), ``GET /health``, ``GET /v1/models``.
Run it with ``handler_cancellation=True`` (server.py and aiohttp's TestServer do) so that a
client that disconnects cancels its gRPC call at once, not at the next chunk written.
"""

from __future__ import annotations

from aiohttp import web
from mstar.gateway.client import ConductorClient
from mstar.gateway.errors import json_errors
from mstar.gateway.generate import CLIENT, SETTINGS, GatewaySettings, generate

DEFAULT_MAX_UPLOAD_BYTES = 32 << 20


def create_app(conductor_address: str, *, max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
               request_timeout_s: float = 300.0) -> web.Application:
    settings = GatewaySettings(conductor_address, max_upload_bytes, request_timeout_s)
    app = web.Application(client_max_size=max_upload_bytes, middlewares=[json_errors])
    app[SETTINGS] = settings
    app[CLIENT] = ConductorClient(conductor_address)
    app.cleanup_ctx.append(_conductor_channel)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    return app


async def _conductor_channel(app: web.Application):
    """One channel for the app's life: opened on startup, closed after in-flight handlers end."""
    await app[CLIENT].open()
    yield
    await app[CLIENT].close()


async def health(request: web.Request) -> web.Response:
    problem = await request.app[CLIENT].health_problem()
    if problem is None:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "unavailable", "reason": problem}, status=503)


async def list_models(request: web.Request) -> web.Response:
    models = await request.app[CLIENT].models()
    data = [{"id": m.name, "object": "model", "owned_by": "mstar", "walks": list(m.walks), "outputs": list(m.outputs),
             "node_groups": list(m.node_groups)} for m in models.values()]
    return web.json_response({"object": "list", "data": data})
