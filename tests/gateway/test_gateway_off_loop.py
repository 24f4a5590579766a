"""Issue 49, hole 1: a large JSON body is parsed off the gateway's event loop (json_pool.py), so that
while the worst body is read and refused, another connection's requests are still answered."""

import asyncio
import json
import time

import aiohttp
from gateway_harness import gateway, run

#: the issue's body: ~900k one-character messages, 29 MiB (under the 32 MiB body limit); parsing it
#: on the loop held it 3.2 s on the CI VM
FLOOD = json.dumps({"model": "toy", "messages": [{"role": "user", "content": "a"}] * 900_000}).encode()
SMALL = json.dumps({"model": "toy", "messages": [{"role": "user", "content": "hi"}]}).encode()
JSON = {"Content-Type": "application/json"}
#: small requests answered within these while the flood is processed (idle: ~15 ms; the old code held
#: the loop for the whole parse, 3.2-3.9 s on the CI VM). The max has room for a CPU-starved moment
#: on a loaded 2-core machine (1.5 s seen once under the full suite); the median does not.
MAX_SMALL_S, MEDIAN_SMALL_S = 2.5, 0.25


def test_other_requests_are_answered_while_the_worst_body_is_parsed():
    async def go():
        async with gateway() as env:
            url = str(env.client.make_url("/v1/chat/completions"))
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(timeout=timeout) as flooder, aiohttp.ClientSession(timeout=timeout) as other:
                async def post(session, body):
                    async with session.post(url, data=body, headers=JSON) as r:
                        return r.status, await r.json()

                assert (await post(other, SMALL))[0] == 200
                flood = asyncio.create_task(post(flooder, FLOOD))
                latencies = []
                while not flood.done():
                    t0 = time.perf_counter()
                    status, _ = await post(other, SMALL)
                    latencies.append(time.perf_counter() - t0)
                    assert status == 200
                return await flood, latencies

    (status, body), latencies = run(go(), 90)
    assert len(latencies) >= 3, latencies  # the flood was in flight over several of them
    assert max(latencies) < MAX_SMALL_S and sorted(latencies)[len(latencies) // 2] < MEDIAN_SMALL_S, latencies
    assert status == 400 and body["error"]["field"] == "messages", body
