"""A JSON worker process (json_pool.py): ``python -m mstar.gateway.json_worker FD``.

Reads a shape name and a body from the socket FD, answers json_bounds.parse's result pickled, one
at a time, until the socket closes. It runs at a lower CPU priority than serving (a flood of large
bodies gets the CPU that serving leaves), dies with the gateway (mstar.lifetime), and after each
parse hands the freed memory back to the OS: glibc keeps it mapped otherwise (36 MiB after a
29 MiB body), and the pool replaces a worker whose memory stays high.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import sys
from multiprocessing.connection import Connection

from mstar import lifetime
from mstar.gateway.json_bounds import parse

#: the worker's niceness
NICE = 10


def main(fd: int) -> None:
    lifetime.adopt()
    os.nice(NICE)
    trim = _malloc_trim()
    conn = Connection(fd)
    while True:
        try:
            shape = conn.recv_bytes().decode()
            raw = conn.recv_bytes()
        except EOFError:
            return
        result = pickle.dumps(parse(raw, shape), pickle.HIGHEST_PROTOCOL)
        del raw
        conn.send_bytes(result)
        del result
        trim()


def _malloc_trim():
    """glibc's malloc_trim(0); a no-op elsewhere."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: fn(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
