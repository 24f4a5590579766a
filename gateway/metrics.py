"""The gateway's Prometheus side: ``GET /metrics`` and a middleware that counts and times
every HTTP request by route (the route's pattern, so cardinality stays bounded)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mstar import metrics


@web.middleware
async def http_metrics(request: web.Request, handler) -> web.StreamResponse:
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "other"
    inflight = metrics.HTTP_INFLIGHT.labels(route)
    inflight.inc()
    t0, code = time.perf_counter(), "500"
    try:
        response = await handler(request)
        code = str(response.status)
        return response
    except web.HTTPException as e:
        code = str(e.status)
        raise
    except asyncio.CancelledError:
        code = "499"  # the client went away (nginx's "client closed request")
        raise
    finally:
        inflight.dec()
        metrics.HTTP_REQUESTS.labels(route, request.method, code).inc()
        metrics.HTTP_DURATION.labels(route).observe(time.perf_counter() - t0)


async def metrics_handler(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})
