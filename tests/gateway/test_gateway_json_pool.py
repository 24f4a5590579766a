"""The JSON worker pool (json_pool.py) replaces a worker that keeps its memory, dies or hangs (that
request: 503), stops an idle one, and a worker's answers are json_bounds.parse's."""

import asyncio
import json
import os
import signal

from gateway_harness import run

from mstar.gateway.json_bounds import Refused
from mstar.gateway.json_pool import JsonPool

#: a body whose parse takes tens of milliseconds (it is refused at its 65,537th value)
SLOW = json.dumps({"model": "toy", "m": [[]] * 300_000}).encode()


def test_the_pool_replaces_a_worker_that_keeps_its_memory_dies_or_hangs():
    async def go():
        pool = JsonPool(workers=1, max_rss=1 << 40)
        try:
            first = await pool.parse(b'{"a": [1, 2]}', "value")
            [pid] = pool.pids()
            pool.max_rss = 1  # the worker's memory is now "too high": the next parse gets a new one
            second = await pool.parse(b'{"a": NaN}', "value")
            [pid2] = pool.pids()
            os.kill(pid2, signal.SIGKILL)  # dead while idle: replaced when next taken
            await asyncio.sleep(0.2)
            pool.max_rss = 1 << 40
            third = await pool.parse(b"[3]", "value")
            [pid3] = pool.pids()
            pool.timeout_s = 0.001  # a parse that takes longer: the worker is killed, the request 503
            try:
                await pool.parse(SLOW, "generate")
                hung = None
            except Exception as e:
                hung = e
            after = pool.pids()
            pool.timeout_s = 30.0
            fourth = await pool.parse(b'"ok"', "value")
            return first, second, third, fourth, (pid, pid2, pid3), hung, after, pool.recycled
        finally:
            await asyncio.to_thread(pool.close)

    first, second, third, fourth, pids, hung, after, recycled = run(go(), 60)
    assert first == {"a": [1, 2]} and third == [3] and fourth == "ok"
    assert second == Refused("a", "must be a finite number, got nan")
    assert len(set(pids)) == 3 and recycled == 2
    assert getattr(hung, "status", None) == 503 and after == []


def test_an_idle_worker_is_stopped_and_the_next_body_starts_another():
    async def go():
        pool = JsonPool(workers=1, idle_s=0.2)
        try:
            await pool.parse(b"[1]", "value")
            [pid] = pool.pids()
            kept = await asyncio.to_thread(pool.retire_idle)  # not idle long enough yet
            await asyncio.sleep(0.3)
            stopped = await asyncio.to_thread(pool.retire_idle)
            gone = pool.pids()
            again = await pool.parse(b"[2]", "value")
            return pid, kept, stopped, gone, again, pool.pids()
        finally:
            await asyncio.to_thread(pool.close)

    pid, kept, stopped, gone, again, now = run(go(), 30)
    assert (kept, stopped, gone, again) == (0, 1, [], [2])
    assert not os.path.exists(f"/proc/{pid}") and len(now) == 1 and now != [pid]
