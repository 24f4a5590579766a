"""/health, /v1/models, and the gateway process: port file, log line, graceful SIGTERM."""

import asyncio
import json
import os
import re
import signal
import socket
import sys

import aiohttp
from gateway_harness import WAIT_S, FakeConductorServer, gateway, run
from grpc_health.v1 import health_pb2

from mstar.ports import EXIT_PORT_IN_USE


def test_health_follows_the_conductor():
    async def go():
        async with gateway() as env:
            async with env.client.get("/health") as r:
                up = r.status, await r.json()
            await env.conductor.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            async with env.client.get("/health") as r:
                not_serving = r.status, await r.json()
            await env.conductor.stop()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            async with env.client.get("/health") as r:
                down = r.status, await r.json()
            return up, not_serving, down, loop.time() - t0

    up, not_serving, down, down_s = run(go())
    assert up == (200, {"status": "ok"})
    assert not_serving[0] == 503 and not_serving[1]["status"] == "unavailable"
    assert "NOT_SERVING" in not_serving[1]["reason"]
    assert down[0] == 503 and "unreachable" in down[1]["reason"]
    assert down_s < 2.0  # bounded by the 1 s health-check deadline


def test_models_openai_style():
    async def go():
        async with gateway() as env:
            async with env.client.get("/v1/models") as r:
                return r.status, await r.json()

    status, body = run(go())
    assert status == 200
    assert body == {"object": "list", "data": [{
        "id": "toy", "object": "model", "owned_by": "mstar", "walks": ["prompt", "decode"],
        "outputs": ["text:text", "audio:audio", "latent:latent"], "node_groups": ["encoder", "decoder"],
        "api": {"chat_media": [], "chat_kwargs": {}, "chat_audio_output": None, "voices": [], "default_voice": None,
                "audio_formats": [], "edit_kwargs": None}}]}


def test_models_when_the_conductor_is_down_is_503_json():
    async def go():
        async with gateway() as env:
            await env.conductor.stop()
            async with env.client.get("/v1/models") as r:
                return r.status, await r.json()

    status, body = run(go())
    assert status == 503 and body["error"]["code"] == "UNAVAILABLE" and body["error"]["type"] == "server_error"


async def _start_gateway_process(conductor: str, port_file: str, *extra: str):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mstar.gateway", "--conductor", conductor, "--port", "0", "--port-file", port_file,
        "--log-level", "INFO", *extra, stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while not os.path.exists(port_file):
        assert proc.returncode is None, await proc.stderr.read()
        assert loop.time() < deadline, "the gateway did not write its port file"
        await asyncio.sleep(0.05)
    return proc, int(open(port_file).read())


def test_process_serves_and_drains_on_sigterm(tmp_path):
    async def go():
        conductor = FakeConductorServer()
        conductor.fake.behavior.delay_s = 0.3  # the streaming response is still going when SIGTERM arrives
        await conductor.start()
        proc, port = await _start_gateway_process(conductor.address, str(tmp_path / "port"), "--shutdown-grace", "5")
        try:
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http:
                async with http.get(f"{url}/health") as r:
                    assert r.status == 200
                async with http.post(f"{url}/generate", json={"model": "toy", "stream": True}) as r:
                    first = json.loads(await r.content.readline())
                    proc.send_signal(signal.SIGTERM)
                    rest = [json.loads(x) for x in (await r.read()).splitlines() if x.strip()]
                code = await asyncio.wait_for(proc.wait(), WAIT_S)
                log = (await proc.stderr.read()).decode()
            return port, first, rest, code, log, conductor.fake.cancelled.is_set()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await conductor.stop()

    port, first, rest, code, log, cancelled = run(go(), timeout=30)
    assert re.search(rf"gateway listening on http://127\.0\.0\.1:{port}\b", log), log
    assert first["type"] == "chunk" and rest[-1]["type"] == "final"  # the in-flight response finished
    assert not cancelled
    assert code == 0, log


def test_process_cuts_a_response_that_outlives_the_grace(tmp_path):
    async def go():
        conductor = FakeConductorServer()
        conductor.fake.behavior.hold_after = 1  # never finishes on its own
        await conductor.start()
        proc, port = await _start_gateway_process(conductor.address, str(tmp_path / "port"), "--shutdown-grace", "1")
        loop = asyncio.get_running_loop()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http:
                async with http.post(f"http://127.0.0.1:{port}/generate", json={"model": "toy", "stream": True}) as r:
                    await r.content.readline()
                    t0 = loop.time()
                    proc.send_signal(signal.SIGTERM)
                    code = await asyncio.wait_for(proc.wait(), WAIT_S)
                    stopped_s = loop.time() - t0
            await asyncio.wait_for(conductor.fake.cancelled.wait(), WAIT_S)
            return code, stopped_s
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await conductor.stop()

    code, stopped_s = run(go(), timeout=30)
    assert code == 0
    assert 0.9 < stopped_s < 2.5  # the grace, not more


def test_process_with_a_busy_port_exits_nonzero(tmp_path):
    async def go():
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mstar.gateway", "--conductor", "127.0.0.1:1", "--port",
                str(busy.getsockname()[1]), stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL)
            try:
                code = await asyncio.wait_for(proc.wait(), 15)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            return code, (await proc.stderr.read()).decode()

    code, log = run(go())
    assert code == EXIT_PORT_IN_USE and "cannot serve" in log and "Traceback" not in log, log  # the launcher reads it
