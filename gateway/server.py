"""``python -m mstar.gateway``: serve the REST gateway until SIGTERM/SIGINT, then drain."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import errno
import logging
import os
import signal

import uvloop
from aiohttp import web

from mstar import auth
from mstar.gateway.app import DRAINING, create_app
from mstar.gateway.uploads import UploadSettings
from mstar.limits import MAX_REQUEST_BYTES
from mstar.ports import EXIT_PORT_IN_USE

log = logging.getLogger("mstar.gateway")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mstar-gateway", description="Serve the REST gateway in front of a conductor.")
    p.add_argument("--conductor", required=True, metavar="HOST:PORT", help="the conductor's gRPC address")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000; 0 picks a free port)")
    p.add_argument("--port-file", metavar="PATH", help="write the bound port number to PATH once listening")
    p.add_argument("--max-upload-mb", type=float, default=32.0, help="largest request body in MiB (default 32)")
    p.add_argument("--upload-dir", metavar="DIR", help="spill uploaded files larger than --upload-spill-mb to DIR "
                   "(default: keep them in memory)")
    p.add_argument("--upload-spill-mb", type=float, default=1.0, help="a file part larger than this goes to "
                   "--upload-dir, MiB (default 1)")
    p.add_argument("--upload-dir-max-mb", type=float, default=1024.0, help="the most spilled uploads kept in "
                   "--upload-dir at once, MiB; past it a request gets 413 (default 1024)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="longest a request may run and largest timeout_s a client may ask for, seconds (default 300)")
    p.add_argument("--shutdown-grace", type=float, default=4.0,
                   help="seconds in-flight responses get to finish after SIGTERM before they are cut (default 4)")
    p.add_argument("--drain-delay", type=float, default=0.0,
                   help="seconds between SIGTERM and closing the port, answering /health with 503 meanwhile, so that "
                        "a load balancer polling it stops sending first (default 0)")
    p.add_argument("--api-keys-file", metavar="PATH", help=auth.API_KEYS_HELP)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if not 0 < args.max_upload_mb <= MAX_REQUEST_BYTES / 2**20:
        p.error(f"--max-upload-mb must be > 0 and at most {MAX_REQUEST_BYTES / 2**20:g}: the conductor's public "
                "API reads no larger request (mstar/limits.py)")
    if args.upload_spill_mb < 0 or args.upload_dir_max_mb <= 0:
        p.error("--upload-spill-mb must be >= 0 and --upload-dir-max-mb > 0")
    if args.request_timeout <= 0:
        p.error("--request-timeout must be > 0")
    if args.shutdown_grace <= 0:  # aiohttp reads a shutdown timeout of 0 as "wait forever"
        p.error("--shutdown-grace must be > 0")
    return args


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _write_port_file(path: str, port: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)  # readers never see a half-written file


async def serve(args: argparse.Namespace) -> None:
    uploads = None if args.upload_dir is None else UploadSettings(
        args.upload_dir, int(args.upload_spill_mb * 2**20), int(args.upload_dir_max_mb * 2**20))
    api_keys = auth.ApiKeys.load(args.api_keys_file)
    if not api_keys.enabled and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("gateway on %s has NO API KEYS: anyone who reaches it may run requests (--api-keys-file or "
                    "MSTAR_API_KEYS)", args.host)
    app = create_app(args.conductor, max_upload_bytes=int(args.max_upload_mb * 2**20), request_timeout_s=args.request_timeout,
                     uploads=uploads, api_keys=api_keys)
    # handler_cancellation: a client that disconnects cancels its handler, hence its gRPC call.
    # shutdown_timeout: aiohttp waits it twice for an in-flight handler (to finish, then to notice its
    # request was cancelled) before cancelling the handler; half the grace each keeps the total bounded.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=args.shutdown_grace / 2)
    await runner.setup()
    try:
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1]
        if args.port_file:
            _write_port_file(args.port_file, port)
        log.info("gateway listening on %s", _url(args.host, port))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        if args.drain_delay > 0:
            app[DRAINING].set()
            log.info("gateway answering /health with 503 for %g s before it stops accepting", args.drain_delay)
            await asyncio.sleep(args.drain_delay)
        log.info("gateway draining (up to %g s for in-flight responses)", args.shutdown_grace)
    finally:
        await runner.cleanup()  # stop accepting, let handlers finish (bounded), close the channel
    log.info("gateway stopped")


#: glibc's mallopt parameter
M_MMAP_THRESHOLD = -3


def unmap_large_buffers() -> None:
    """Request bodies (up to 32 MiB) are large and short-lived. glibc raises its mmap threshold to
    the largest block freed, so after the first large body the next ones come from the heap, which
    does not shrink: the gateway kept ~40 MiB for 20 s after a flood, until a later free trimmed
    it. A fixed threshold (128 KiB, glibc's default start) maps each large buffer on its own and
    hands it back when freed. A no-op without glibc."""
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 << 10)
    except (OSError, AttributeError):
        pass


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s [gateway] %(name)s: %(message)s")
    unmap_large_buffers()
    try:
        uvloop.run(serve(args))  # as the other services (services/grpc_server.run_service)
    except auth.ApiKeyError as e:
        log.error("%s", e)
        return 2
    except OSError as e:  # typically the port is taken
        log.error("gateway cannot serve on %s:%s: %s", args.host, args.port, e)
        return EXIT_PORT_IN_USE if e.errno == errno.EADDRINUSE else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
