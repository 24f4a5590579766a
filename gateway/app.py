"""The REST gateway: an aiohttp application translating HTTP into Conductor gRPC calls.

Routes: ``POST /generate`` (generate.py), ``GET /health``, ``GET /v1/models``, ``GET /metrics``
(Prometheus, metrics.py), the OpenAI-compatible ``POST /v1/chat/completions``,
``/v1/audio/speech``, ``/v1/images/generations`` and ``/v1/images/edits`` (oai/), and ``GET /openapi.json``
(openapi.py, the document describing all of them).
Run it with ``handler_cancellation=True`` (server.py and aiohttp's TestServer do) so that a
client that disconnects cancels its gRPC call at once, not at the next chunk written.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from mstar.auth import NO_KEYS, ApiKeys
from mstar.gateway.auth import API_KEYS, require_api_key
from mstar.gateway.client import ConductorClient
from mstar.gateway.errors import json_errors
from mstar.gateway.generate import CLIENT, SETTINGS, UPLOADS, GatewaySettings, generate
from mstar.gateway.json_body import json_workers
from mstar.gateway.metrics import http_metrics, metrics_handler
from mstar.gateway.oai.chat import chat_completions
from mstar.gateway.oai.edits import edit_images
from mstar.gateway.oai.images import generate_images
from mstar.gateway.oai.speech import speech
from mstar.gateway.openapi import SPEC, build, openapi_handler
from mstar.gateway.uploads import UploadDir, UploadSettings
from mstar.limits import MAX_REQUEST_BYTES

DEFAULT_MAX_UPLOAD_BYTES = MAX_REQUEST_BYTES
#: set while the gateway drains: /health answers 503 so that load balancers stop sending before it closes
DRAINING = web.AppKey("draining", asyncio.Event)


def create_app(conductor_address: str, *, max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
               request_timeout_s: float = 300.0, uploads: UploadSettings | None = None,
               api_keys: ApiKeys = NO_KEYS) -> web.Application:
    """``uploads``: spill large uploaded files to a folder (uploads.py); None keeps them in memory.
    ``api_keys``: required of callers (auth.py); none: the routes are open."""
    settings = GatewaySettings(conductor_address, max_upload_bytes, request_timeout_s)
    app = web.Application(client_max_size=max_upload_bytes, middlewares=[http_metrics, json_errors, require_api_key])
    app[API_KEYS] = api_keys
    app[SETTINGS] = settings
    app[CLIENT] = ConductorClient(conductor_address)
    app[SPEC] = build(settings)
    app[DRAINING] = asyncio.Event()
    app.cleanup_ctx.append(_conductor_channel)
    app.cleanup_ctx.append(json_workers)  # large JSON bodies' worker processes, started on first use
    if uploads is not None:
        app[UPLOADS] = UploadDir(uploads)
        app.cleanup_ctx.append(_upload_dir)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/audio/speech", speech)
    app.router.add_post("/v1/images/generations", generate_images)
    app.router.add_post("/v1/images/edits", edit_images)
    app.router.add_get("/openapi.json", openapi_handler)
    return app


async def _conductor_channel(app: web.Application):
    """One channel for the app's life: opened on startup, closed after in-flight handlers end."""
    await app[CLIENT].open()
    yield
    await app[CLIENT].close()


async def _upload_dir(app: web.Application):
    """The gateway's upload folder: made on startup, removed after in-flight handlers end."""
    app[UPLOADS].open()
    yield
    app[UPLOADS].close()


async def health(request: web.Request) -> web.Response:
    if request.app[DRAINING].is_set():
        return web.json_response({"status": "draining", "reason": "the gateway is shutting down"}, status=503)
    problem = await request.app[CLIENT].health_problem()
    if problem is None:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "unavailable", "reason": problem}, status=503)


async def list_models(request: web.Request) -> web.Response:
    models = await request.app[CLIENT].models()
    data = [{"id": m.name, "object": "model", "owned_by": "mstar", "walks": list(m.walks), "outputs": list(m.outputs),
             "node_groups": list(m.node_groups), "api": api_json(m.api)} for m in models.values()]
    return web.json_response({"object": "list", "data": data})


def api_json(a) -> dict:
    """ModelInfo.api as JSON: what chat may attach and answer with, whether the model edits images."""
    return {"chat_media": list(a.chat_media), "chat_kwargs": _kwargs(a.chat_kwargs_json),
            "chat_audio_output": a.chat_audio_output or None, "voices": list(a.voices),
            "default_voice": a.default_voice or None, "audio_formats": list(a.audio_formats),
            "edit_kwargs": _kwargs(a.edit_kwargs_json) if a.edit_kwargs_json else None}


def _kwargs(raw: str) -> dict:
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
