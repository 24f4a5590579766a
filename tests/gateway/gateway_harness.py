"""A scriptable in-process fake Conductor (real grpc.aio server on loopback) and the gateway
app in front of it (aiohttp TestServer), for the gateway tests."""

from __future__ import annotations

import asyncio
import json
import struct
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
import grpc
from aiohttp.test_utils import TestClient, TestServer
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mstar.conductor.convert import invalid_argument_status
from mstar.gateway.app import create_app
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc, tensor_pb2

WAIT_S = 5.0  # every network wait in these tests is bounded by this
RID = "req-1"
AUDIO = [struct.pack("<3h", 1, -2, 3), struct.pack("<2h", 32767, -32768)]
LATENT = [1.0, -2.5, 3.25, 0.5]


def run(coro, timeout: float = 20.0):
    """Run a test coroutine with a hard timeout (pytest-asyncio is not used)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def script(request_id: str) -> list[cpb.GenerateResponse]:
    """What the fake streams: text, audio and a latent tensor, interleaved, then the final event."""
    latent = tensor_pb2.Tensor(name="latent", datatype="FP32", shape=[2, 2], raw=struct.pack("<4f", *LATENT))
    chunks = [
        cpb.OutputChunk(name="text", modality=cpb.MODALITY_TEXT, text="Hel", index=0, elapsed_s=0.1, token_ids=[72, 101]),
        cpb.OutputChunk(name="audio", modality=cpb.MODALITY_AUDIO, data=AUDIO[0], mime_type="audio/pcm",
                        sample_rate_hz=24000, index=0, elapsed_s=0.2),
        cpb.OutputChunk(name="text", modality=cpb.MODALITY_TEXT, text="lo", index=1, elapsed_s=0.3, token_ids=[108]),
        cpb.OutputChunk(name="audio", modality=cpb.MODALITY_AUDIO, data=AUDIO[1], mime_type="audio/pcm",
                        sample_rate_hz=24000, index=1, elapsed_s=0.4),
        cpb.OutputChunk(name="latent", modality=cpb.MODALITY_LATENT, tensor=latent, index=0, elapsed_s=0.5),
    ]
    final = cpb.FinalEvent(usage=cpb.Usage(prompt_tokens=4, completion_tokens=3, walks=2, audio_seconds=0.5),
                           timings=cpb.Timings(first_output_s=0.1, total_s=0.6, process_prompt_s=0.01),
                           finish_reason="stop")
    # Batched as the conductor batches: several chunks per message, the last one on the final message.
    batches = [chunks[:1], chunks[1:3], chunks[3:4]]
    return [cpb.GenerateResponse(request_id=request_id, chunks=b) for b in batches] + [
        cpb.GenerateResponse(request_id=request_id, chunks=chunks[4:], final=final)]


@dataclass
class Behavior:
    """How the next Generate calls behave."""

    #: abort with this status after `fail_after` messages (None: succeed)
    fail_code: grpc.StatusCode | None = None
    fail_message: str = "boom"
    #: the BadRequest field of an INVALID_ARGUMENT
    fail_field: str = "model_kwargs.max_tokens"
    fail_after: int = 0
    #: after this many messages, wait until cancelled (None: never)
    hold_after: int | None = None
    #: pause before each message, seconds
    delay_s: float = 0.0
    #: pause after the final message before the call ends with OK, seconds
    linger_s: float = 0.0


@dataclass
class FakeConductor(conductor_pb2_grpc.ConductorServicer):
    behavior: Behavior = field(default_factory=Behavior)
    requests: list[cpb.GenerateRequest] = field(default_factory=list)
    #: context.time_remaining() at the start of each Generate: the deadline the gateway set
    deadlines: list[float | None] = field(default_factory=list)
    list_calls: int = 0
    models: list[cpb.ModelInfo] = field(default_factory=lambda: [cpb.ModelInfo(
        name="toy", walks=["prompt", "decode"], outputs=["text:text", "audio:audio", "latent:latent"],
        node_groups=["encoder", "decoder"])])
    #: set when a Generate is cancelled by the client (the gateway's call.cancel())
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    #: set when a Generate returns, however it ends
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    async def Generate(self, request, context):
        self.requests.append(request)
        self.deadlines.append(context.time_remaining())
        b = self.behavior
        try:
            for i, msg in enumerate(script(request.request_id or RID)):
                if b.hold_after == i:
                    await asyncio.Event().wait()
                if b.fail_code is not None and b.fail_after == i:
                    if b.fail_code == grpc.StatusCode.INVALID_ARGUMENT:
                        await context.abort_with_status(invalid_argument_status(b.fail_field, b.fail_message))
                    await context.abort(b.fail_code, b.fail_message)
                if b.delay_s:
                    await asyncio.sleep(b.delay_s)
                yield msg
            await asyncio.sleep(b.linger_s)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.ended.set()

    async def ListModels(self, request, context):
        self.list_calls += 1
        return cpb.ListModelsResponse(models=self.models)


class FakeConductorServer:
    def __init__(self):
        self.fake = FakeConductor()
        self.server = grpc.aio.server()
        conductor_pb2_grpc.add_ConductorServicer_to_server(self.fake, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    async def stop(self) -> None:
        await self.server.stop(0)


@dataclass
class Env:
    client: TestClient
    conductor: FakeConductorServer

    @property
    def fake(self) -> FakeConductor:
        return self.conductor.fake


@asynccontextmanager
async def gateway(**app_kw):
    """A fake conductor and the gateway app in front of it; the HTTP client has a hard timeout."""
    conductor = FakeConductorServer()
    await conductor.start()
    try:
        app = create_app(conductor.address, **app_kw)
        async with TestClient(TestServer(app), timeout=aiohttp.ClientTimeout(total=WAIT_S)) as client:
            yield Env(client, conductor)
    finally:
        await conductor.stop()


async def post_json(client: TestClient, body, **kw) -> tuple[int, dict]:
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    async with client.post("/generate", data=data, headers={"Content-Type": "application/json"}, **kw) as r:
        return r.status, await r.json()


async def ndjson_lines(resp: aiohttp.ClientResponse) -> list[dict]:
    return [json.loads(line) for line in (await resp.read()).decode().splitlines() if line.strip()]


def assert_error(status: int, body: dict, want_status: int, field: str | None, code: str) -> None:
    assert status == want_status, (status, body)
    err = body["error"]
    assert set(err) == {"message", "type", "field", "code"}, err
    assert err["field"] == field and err["code"] == code and err["message"], err
    assert err["type"] == ("invalid_request_error" if want_status < 500 and want_status != 429
                           else "rate_limit_error" if want_status == 429 else "server_error")
