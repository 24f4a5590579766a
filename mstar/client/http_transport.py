"""REST transports to the gateway: sync (urllib, stdlib) and asyncio (aiohttp).

Generate always uses ``POST /generate`` with ``"stream": true`` and NDJSON lines; the SDK folds
one-shot results itself, so both transports hand back the same chunks.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import aiohttp

from mstar.client.convert import (
    Message,
    act_rest_params,
    message_from_line,
    model_from_json,
    rest_body,
    tensor_from_headers,
)
from mstar.client.errors import DeadlineExceeded, Internal, Unavailable, from_http
from mstar.client.robot import ActParams
from mstar.client.types import GenerateParams, Health, ModelInfo, Tensor

USER_AGENT = "mstar-python-sdk"
OCTET = "application/octet-stream"


def _multipart(body: dict, params: GenerateParams) -> tuple[bytes, str]:
    """``multipart/form-data`` with the JSON fields as form fields and each file as a file part."""
    boundary = uuid.uuid4().hex
    parts: list[bytes] = []
    for key, value in body.items():
        text = json.dumps(value) if isinstance(value, dict | bool) else str(value)
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n{text}\r\n'.encode())
    for f in params.files:
        filename = (f.filename or f.name).replace('"', "")
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{f.name}"; filename="{filename}"\r\n'
                     f"Content-Type: {f.content_type}\r\n\r\n".encode() + f.data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def _encode(params: GenerateParams, stream: bool = True) -> tuple[bytes, str]:
    body = rest_body(params, stream)
    if params.files:
        return _multipart(body, params)
    return json.dumps(body).encode(), "application/json"


def _error_body(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def _unhealthy(status: int, body: object) -> Health:
    """``GET /health`` answered non-200: ``{"status": "unavailable", "reason": ...}``."""
    reason = body.get("reason") if isinstance(body, dict) else None
    return Health(False, "unavailable", reason if isinstance(reason, str) else f"HTTP {status}: {str(body)[:200]}")


class HttpCall:
    """One streaming ``POST /generate`` response read line by line."""

    def __init__(self, resp, deadline: float):
        self._resp, self._deadline = resp, deadline
        self.request_id = resp.headers.get("X-Request-Id", "")
        self._lines: Iterator[bytes] = iter(resp)

    def next(self) -> Message | None:
        while True:
            try:
                line = next(self._lines)
            except StopIteration:
                return None
            except TimeoutError:
                raise DeadlineExceeded("no data from the gateway within the request timeout",
                                       request_id=self.request_id) from None
            except (OSError, ValueError) as e:  # ValueError: read on a closed response (cancelled)
                raise Unavailable(f"connection to the gateway lost: {e}", request_id=self.request_id) from None
            if time.monotonic() > self._deadline:
                self.cancel()
                raise DeadlineExceeded("the request ran past the client's timeout", request_id=self.request_id)
            if line.strip():
                return message_from_line(line, self.request_id)

    def cancel(self) -> None:
        self._resp.close()  # the gateway sees the disconnect and cancels the conductor call

    def finish(self) -> None:
        """After the final event: read the (empty) rest so the gateway ends the response cleanly."""
        try:
            self._resp.read()
        except OSError:
            pass
        self._resp.close()


class HttpTransport:
    def __init__(self, base_url: str, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _open(self, method: str, path: str, timeout: float, data: bytes | None = None, content_type: str | None = None,
              accept: str = "application/json, application/x-ndjson"):
        headers = {"User-Agent": USER_AGENT, "Accept": accept, **self._auth}
        if content_type:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            return urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as e:
            with e:
                raise from_http(e.code, _error_body(e.read()), e.headers.get("X-Request-Id")) from None
        except TimeoutError:
            raise DeadlineExceeded(f"{method} {self.base_url}{path}: no answer within {timeout:g} s") from None
        except urllib.error.URLError as e:
            raise Unavailable(f"cannot reach the gateway at {self.base_url}: {e.reason}") from None

    def _json(self, method: str, path: str, timeout: float):
        with self._open(method, path, timeout) as resp:
            try:
                return json.loads(resp.read())
            except ValueError as e:
                raise Internal(f"{method} {path}: the gateway answered malformed JSON: {e}") from None

    def generate(self, params: GenerateParams, timeout: float) -> HttpCall:
        data, content_type = _encode(params)
        return HttpCall(self._open("POST", "/generate", timeout, data, content_type), time.monotonic() + timeout)

    def act(self, params: ActParams, timeout: float) -> Tensor:
        """``POST /generate`` answered as the actions' raw bytes (Accept: application/octet-stream)."""
        data, content_type = _encode(act_rest_params(params), stream=False)
        with self._open("POST", "/generate", timeout, data, content_type, accept=OCTET) as resp:
            try:
                body = resp.read()
            except OSError as e:
                raise Unavailable(f"connection to the gateway lost: {e}") from None
            return tensor_from_headers(resp.headers, body)

    def models(self, timeout: float) -> list[ModelInfo]:
        return [model_from_json(m) for m in self._json("GET", "/v1/models", timeout)["data"]]

    def health(self, timeout: float) -> Health:
        req = urllib.request.Request(self.base_url + "/health", headers={"User-Agent": USER_AGENT})
        try:
            with urllib.request.urlopen(req, timeout=timeout):
                return Health(True, "ok")
        except urllib.error.HTTPError as e:
            with e:
                return _unhealthy(e.code, _error_body(e.read()))
        except (urllib.error.URLError, OSError) as e:
            return Health(False, "unreachable", f"cannot reach the gateway at {self.base_url}: {getattr(e, 'reason', e)}")

    def close(self) -> None:
        pass  # urllib opens one connection per request


class AsyncHttpCall:
    """Lines are split here, not by ``StreamReader.readline``, whose 128 KiB line limit an
    image or a long audio chunk (base64 in one NDJSON line) would exceed."""

    def __init__(self, resp: aiohttp.ClientResponse, deadline: float):
        self._resp, self._deadline = resp, deadline
        self.request_id = resp.headers.get("X-Request-Id", "")
        self._buf = bytearray()
        self._eof = False

    async def _line(self) -> bytes | None:
        while True:
            end = self._buf.find(b"\n")
            if end >= 0:
                line = bytes(self._buf[:end])
                del self._buf[:end + 1]
                return line
            if self._eof:
                line, self._buf = bytes(self._buf), bytearray()
                return line or None
            try:
                data = await self._resp.content.readany()
            except TimeoutError:
                raise DeadlineExceeded("no data from the gateway within the request timeout",
                                       request_id=self.request_id) from None
            except aiohttp.ClientError as e:
                raise Unavailable(f"connection to the gateway lost: {e}", request_id=self.request_id) from None
            if time.monotonic() > self._deadline:
                self.cancel()
                raise DeadlineExceeded("the request ran past the client's timeout", request_id=self.request_id)
            self._eof = not data
            self._buf += data

    async def next(self) -> Message | None:
        while True:
            line = await self._line()
            if line is None:
                self._resp.release()
                return None
            if line.strip():
                return message_from_line(line, self.request_id)

    def cancel(self) -> None:
        self._resp.close()

    async def finish(self) -> None:
        try:
            await self._resp.read()
        except (aiohttp.ClientError, TimeoutError):
            pass
        self._resp.release()


class AsyncHttpTransport:
    """The aiohttp session opens on first use, inside the caller's event loop."""

    def __init__(self, base_url: str, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers={"User-Agent": USER_AGENT, **self._auth})
        return self._session

    async def _request(self, method: str, path: str, timeout: float, **kw) -> aiohttp.ClientResponse:
        # sock_read bounds each wait for data; the whole stream is bounded by the call's deadline.
        t = aiohttp.ClientTimeout(total=None, connect=timeout, sock_read=timeout)
        try:
            resp = await self._client().request(method, self.base_url + path, timeout=t, **kw)
        except TimeoutError:
            raise DeadlineExceeded(f"{method} {self.base_url}{path}: no answer within {timeout:g} s") from None
        except aiohttp.ClientError as e:
            raise Unavailable(f"cannot reach the gateway at {self.base_url}: {e}") from None
        if resp.status >= 400:
            async with resp:
                raw = await resp.read()
            raise from_http(resp.status, _error_body(raw), resp.headers.get("X-Request-Id"))
        return resp

    async def _json(self, method: str, path: str, timeout: float):
        async with await self._request(method, path, timeout) as resp:
            try:
                return json.loads(await resp.read())
            except ValueError as e:
                raise Internal(f"{method} {path}: the gateway answered malformed JSON: {e}") from None

    @staticmethod
    def _body(params: GenerateParams, stream: bool = True) -> dict:
        body = rest_body(params, stream)
        if not params.files:
            return {"json": body}
        form = aiohttp.FormData()
        for key, value in body.items():
            form.add_field(key, json.dumps(value) if isinstance(value, dict | bool) else str(value))
        for f in params.files:
            form.add_field(f.name, f.data, filename=f.filename or f.name, content_type=f.content_type)
        return {"data": form}

    async def generate(self, params: GenerateParams, timeout: float) -> AsyncHttpCall:
        resp = await self._request("POST", "/generate", timeout, **self._body(params))
        return AsyncHttpCall(resp, time.monotonic() + timeout)

    async def act(self, params: ActParams, timeout: float) -> Tensor:
        resp = await self._request("POST", "/generate", timeout, headers={"Accept": OCTET},
                                   **self._body(act_rest_params(params), stream=False))
        async with resp:
            try:
                body = await resp.read()
            except aiohttp.ClientError as e:
                raise Unavailable(f"connection to the gateway lost: {e}") from None
            return tensor_from_headers(resp.headers, body)

    async def models(self, timeout: float) -> list[ModelInfo]:
        return [model_from_json(m) for m in (await self._json("GET", "/v1/models", timeout))["data"]]

    async def health(self, timeout: float) -> Health:
        try:
            async with self._client().get(self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status == 200:
                    return Health(True, "ok")
                return _unhealthy(resp.status, _error_body(await resp.read()))
        except (aiohttp.ClientError, TimeoutError) as e:
            return Health(False, "unreachable", f"cannot reach the gateway at {self.base_url}: {e!r}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
