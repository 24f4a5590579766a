"""An in-process mesh with the real gateway app in front of it on a loopback port, kept for a whole
test module on an event loop of its own thread (importable as `served_gateway`: tests/ is on
sys.path). Tests talk plain HTTP to ``url`` (``post_json`` / ``post_form``: stdlib, hard
timeouts) or run the SDK against it; ``call`` runs a coroutine (a gRPC call on ``mesh.stub``) on
the mesh's loop."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
import uuid

from aiohttp import web

from mstar.gateway.app import create_app

from inprocess import inprocess_mesh


class ServedGateway:
    def __init__(self, config, cache_dir: str | None = None, conductor_kw: dict | None = None, **app_kw):
        """``conductor_kw``: the conductor's own settings (api_keys, per_key_max_inflight); ``app_kw``: the
        gateway's (create_app)."""
        self.config, self.cache_dir, self.app_kw = config, cache_dir, app_kw
        self.conductor_kw = conductor_kw or {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.url = ""
        self.mesh = None

    def __enter__(self) -> ServedGateway:
        self.thread.start()
        try:
            self.call(self._up(), timeout=180)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.call(self._down(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def call(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop).result(timeout + 5)

    async def _up(self) -> None:
        self._mesh_cm = inprocess_mesh(self.config, cache_dir=self.cache_dir, **self.conductor_kw)
        self.mesh = await self._mesh_cm.__aenter__()
        self.runner = web.AppRunner(create_app(self.mesh.address, **self.app_kw), handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def _down(self) -> None:
        if getattr(self, "runner", None) is not None:
            await self.runner.cleanup()
        if self.mesh is not None:
            await self._mesh_cm.__aexit__(None, None, None)

    # -- plain HTTP ------------------------------------------------------------------------------
    def post(self, path: str, data: bytes, content_type: str, timeout: float = 120) -> tuple[int, dict, bytes]:
        """(status, headers, body) of a POST; error statuses are answers too."""
        req = urllib.request.Request(self.url + path, data=data, method="POST", headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as e:
            with e:
                return e.code, dict(e.headers), e.read()

    def post_json(self, path: str, body: dict, timeout: float = 120) -> tuple[int, object]:
        """(status, parsed body): JSON, or the raw bytes of anything else (audio, SSE)."""
        status, headers, raw = self.post(path, json.dumps(body).encode(), "application/json", timeout)
        return status, json.loads(raw) if headers.get("Content-Type", "").startswith("application/json") else raw

    def post_form(self, path: str, fields: dict, files: dict[str, tuple[str, bytes, str]],
                  timeout: float = 120) -> tuple[int, object]:
        """multipart/form-data: ``fields`` as text parts, ``files`` name -> (filename, bytes, content type)."""
        b = uuid.uuid4().hex
        parts = [f'--{b}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields.items()]
        parts += [f'--{b}\r\nContent-Disposition: form-data; name="{k}"; filename="{fn}"\r\nContent-Type: {ct}\r\n\r\n'
                  .encode() + data + b"\r\n" for k, (fn, data, ct) in files.items()]
        status, headers, raw = self.post(path, b"".join(parts) + f"--{b}--\r\n".encode(),
                                         f"multipart/form-data; boundary={b}", timeout)
        return status, json.loads(raw) if headers.get("Content-Type", "").startswith("application/json") else raw


def sse_events(raw: bytes) -> list:
    """The JSON objects of an SSE body (``[DONE]`` kept as the string)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
