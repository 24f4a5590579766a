"""Issue 49, hole 1: one caller (API key, or client address without keys) has one large body in
progress at a time; its next ones wait unread, up to MAX_WAITING_BODIES, then get 429 with
Retry-After; another caller's large body goes through meanwhile (json_fair.py)."""

import asyncio
import json

import aiohttp
import pytest
from gateway_harness import gateway, run

from mstar.auth import ApiKeys, key_id
from mstar.gateway.json_body import TURNS
from mstar.gateway.json_fair import Turns
from mstar.limits import INLINE_JSON_BYTES, MAX_WAITING_BODIES

KEY_A, KEY_B = "a-key-for-the-flooder-000", "b-key-for-someone-else-00"
#: a body past the inline size: parsed in a worker, in its caller's turn
LARGE = json.dumps({"model": "toy", "text": "x" * (2 * INLINE_JSON_BYTES)}).encode()
#: a caller's turn that does not come within this is taken as waiting (the answer would take ~10 ms)
STILL_WAITING_S = 0.5


async def _stalled_upload(port: int, key: str) -> asyncio.StreamWriter:
    """A large body whose first bytes are sent and the rest held back: its caller's turn is taken."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {key}\r\nContent-Length: {len(LARGE)}\r\n\r\n".encode() + LARGE[:1000])
    await writer.drain()
    return writer


async def _until(check, what: str, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.01)


def test_one_large_body_per_caller_at_a_time_then_429_and_others_are_not_held():
    async def go():
        async with gateway(api_keys=ApiKeys((KEY_A.encode(), KEY_B.encode()))) as env:
            async def post(key: str):
                async with env.client.post("/generate", data=LARGE, headers={
                        "Content-Type": "application/json", "Authorization": f"Bearer {key}"},
                        timeout=aiohttp.ClientTimeout(total=30)) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json()

            turns, a = env.client.server.app[TURNS], key_id(KEY_A)
            first = await _stalled_upload(env.client.server.port, KEY_A)
            await _until(lambda: turns.in_line(a) == 1, "A's first body takes A's turn")
            waiting = [asyncio.create_task(post(KEY_A)) for _ in range(MAX_WAITING_BODIES)]
            await _until(lambda: turns.in_line(a) == 1 + MAX_WAITING_BODIES, "A's next bodies wait")
            over = await asyncio.wait_for(post(KEY_A), 10)
            other = await asyncio.wait_for(post(KEY_B), 10)  # another key: not held by A's turn
            done_early = [t for t in waiting if t.done()]
            await asyncio.sleep(STILL_WAITING_S)
            still_waiting = sum(not t.done() for t in waiting)
            first.write(LARGE[1000:])  # A's first body arrives: its turn ends, the waiting ones follow
            await first.drain()
            served = await asyncio.wait_for(asyncio.gather(*waiting), 30)
            first.close()
            return over, other, done_early, still_waiting, served, len(env.fake.requests)

    over, other, done_early, still_waiting, served, reached = run(go(), 60)
    status, retry_after, body = over
    assert status == 429 and retry_after == "1", over
    assert body["error"]["code"] == "RESOURCE_EXHAUSTED" and body["error"]["type"] == "rate_limit_error"
    assert other[0] == 200, other
    assert done_early == [] and still_waiting == MAX_WAITING_BODIES
    assert [s for s, _, _ in served] == [200] * MAX_WAITING_BODIES
    assert reached == 1 + MAX_WAITING_BODIES + 1  # B's, A's waiting ones and A's first


def test_turns_wait_in_a_bounded_line_for_a_bounded_time_and_are_forgotten_when_done():
    async def go():
        turns = Turns(max_waiting=1)
        end_a = await turns.take("a", 1.0)
        second = asyncio.create_task(turns.take("a", 1.0))
        await asyncio.sleep(0.05)
        with pytest.raises(Exception) as full:
            await turns.take("a", 1.0)
        end_b = await asyncio.wait_for(turns.take("b", 1.0), 1.0)  # another caller: its own line
        queued = turns.in_line("a")
        end_a()
        end_a()  # ending a turn twice is harmless
        end_second = await asyncio.wait_for(second, 1.0)
        with pytest.raises(Exception) as late:
            await turns.take("a", 0.05)  # the turn does not come in time
        end_second()
        end_b()
        return full.value, late.value, queued, turns.in_line("a"), turns.in_line("b"), turns._lines

    full, late, queued, left_a, left_b, lines = run(go(), 10)
    for e in (full, late):
        assert e.status == 429 and e.headers == {"Retry-After": "1"} and e.code == "RESOURCE_EXHAUSTED"
    assert queued == 2 and left_a == left_b == 0 and lines == {}
