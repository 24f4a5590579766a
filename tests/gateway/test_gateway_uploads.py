"""--upload-dir: large uploaded files spill to disk while their request runs, and nothing is left
behind however the request ends (success, conductor error, timeout, cancel, client disconnect,
a refused body); the folder's bound refuses an upload with 413 RESOURCE_EXHAUSTED."""

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import grpc
import pytest
from gateway_harness import WAIT_S, assert_error, gateway, ndjson_lines, run

from mstar.gateway.generate import UPLOADS
from mstar.gateway.uploads import UploadSettings

MIB = 1 << 20
BIG = os.urandom(3 * MIB + 123)  # spilled (over 1 MiB)
SMALL = b"RIFF" + os.urandom(1000)  # kept in memory


def form(*files: tuple[str, bytes], **fields) -> aiohttp.FormData:
    f = aiohttp.FormData()
    f.add_field("model", "toy")
    for key, value in fields.items():
        f.add_field(key, value if isinstance(value, str) else json.dumps(value))
    for i, (name, data) in enumerate(files):
        f.add_field(name, data, filename=f"{name}{i}.bin", content_type="application/octet-stream")
    return f


def spilled(env) -> list[Path]:
    """The files the gateway holds in its upload folder now."""
    return sorted(p for p in env.client.server.app[UPLOADS].root.rglob("*") if p.is_file())


async def wait(aw):
    return await asyncio.wait_for(aw, WAIT_S)


def settings(tmp_path, max_mb: float = 64) -> UploadSettings:
    return UploadSettings(str(tmp_path), spill_bytes=MIB, max_bytes=int(max_mb * MIB))


async def assert_nothing_left(env, tmp_path) -> None:
    """The client may see a response end before the handler's finally has run: wait for it (bounded)."""
    spool = env.client.server.app[UPLOADS]
    for _ in range(250):
        if not spilled(env) and spool.used == 0:
            break
        await asyncio.sleep(0.02)
    assert spilled(env) == [] and spool.used == 0
    assert [p.name for p in tmp_path.iterdir()] == [spool.root.name]  # only the (empty) gateway folder


def test_a_large_file_is_on_disk_while_its_request_runs_and_reaches_the_conductor_intact(tmp_path):
    async def go():
        async with gateway(uploads=settings(tmp_path)) as env:
            env.fake.behavior.hold_after = 1
            r = await env.client.post("/generate", data=form(("image", BIG), ("clip", SMALL), stream="true"))
            assert r.status == 200, await r.text()
            assert json.loads(await wait(r.content.readline()))["type"] == "chunk"
            on_disk = spilled(env)
            assert [p.stat().st_size for p in on_disk] == [len(BIG)]  # the small one stayed in memory
            assert on_disk[0].read_bytes() == BIG and env.client.server.app[UPLOADS].used == len(BIG)
            r.close()  # the client goes away mid-stream
            await wait(env.fake.ended.wait())
            await assert_nothing_left(env, tmp_path)
            [req] = env.fake.requests
            assert [(f.name, f.data) for f in req.files] == [("image", BIG), ("clip", SMALL)]

    run(go())


def test_no_upload_dir_keeps_files_in_memory_as_before(tmp_path):
    async def go():
        async with gateway() as env:
            async with env.client.post("/generate", data=form(("image", BIG))) as r:
                assert r.status == 200, await r.text()
            assert UPLOADS not in env.client.server.app
            assert env.fake.requests[0].files[0].data == BIG

    run(go())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ending", ["success", "stream", "invalid", "cancelled", "unavailable", "deadline",
                                    "disconnect-one-shot", "body-too-large", "bad-field-after-file"])
def test_every_request_end_removes_its_files(tmp_path, ending):
    async def go():
        async with gateway(uploads=settings(tmp_path), max_upload_bytes=8 * MIB) as env:
            b = env.fake.behavior
            data = form(("image", BIG), stream="true" if ending == "stream" else "false")
            want, code = 200, None
            if ending in ("invalid", "cancelled", "unavailable"):
                b.fail_code = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "cancelled": grpc.StatusCode.CANCELLED,
                               "unavailable": grpc.StatusCode.UNAVAILABLE}[ending]
                want, code = {"invalid": 400, "cancelled": 499, "unavailable": 503}[ending], b.fail_code.name
            elif ending == "deadline":  # the gateway's own deadline: timeout_s plus 2 s of slack
                b.hold_after = 1
                data = form(("image", BIG), timeout_s="0.2")
                want, code = 504, "DEADLINE_EXCEEDED"
            elif ending == "body-too-large":
                data = form(("image", BIG), ("more", BIG), ("more", BIG))
                want, code = 413, "PAYLOAD_TOO_LARGE"
            elif ending == "bad-field-after-file":
                data = form(("image", BIG))
                data.add_field("nope", "x")
                want, code = 400, "INVALID_ARGUMENT"
            if ending == "disconnect-one-shot":
                b.hold_after = 1
                with pytest.raises(TimeoutError):
                    await env.client.post("/generate", data=data, timeout=aiohttp.ClientTimeout(total=1.0))
                await wait(env.fake.cancelled.wait())
            else:
                async with env.client.post("/generate", data=data, timeout=aiohttp.ClientTimeout(total=10)) as r:
                    if ending == "stream":
                        assert r.status == 200 and (await ndjson_lines(r))[-1]["type"] == "final"
                    else:
                        body = await r.json()
                        assert r.status == want, body
                        if code:
                            assert body["error"]["code"] == code, body
            await assert_nothing_left(env, tmp_path)

    run(go())


def test_the_folder_bound_refuses_an_upload_with_413_resource_exhausted_naming_it(tmp_path):
    async def go():
        async with gateway(uploads=settings(tmp_path, max_mb=5)) as env:
            env.fake.behavior.hold_after = 1
            first = await env.client.post("/generate", data=form(("image", BIG), stream="true"))
            assert json.loads(await wait(first.content.readline()))["type"] == "chunk"  # 3 MiB held on disk
            env.fake.behavior.hold_after = None
            async with env.client.post("/generate", data=form(("image", BIG))) as r:
                status, body = r.status, await r.json()
            assert_error(status, body, 413, None, "RESOURCE_EXHAUSTED")
            assert "5 MiB, --upload-dir-max-mb" in body["error"]["message"] and str(tmp_path) in body["error"]["message"]
            assert [p.stat().st_size for p in spilled(env)] == [len(BIG)]  # the refused one's part is gone
            first.close()
            await wait(env.fake.cancelled.wait())
            await assert_nothing_left(env, tmp_path)  # the first one's 3 MiB are freed
            async with env.client.post("/generate", data=form(("image", BIG))) as r:  # room again
                assert r.status == 200, await r.text()
            await assert_nothing_left(env, tmp_path)

    run(go())


def test_the_gateway_folder_goes_when_the_gateway_stops(tmp_path):
    async def go():
        async with gateway(uploads=settings(tmp_path)) as env:
            root = env.client.server.app[UPLOADS].root
            assert root.is_dir() and root.name == f"gateway-{os.getpid()}"
        assert not root.exists()

    run(go())
