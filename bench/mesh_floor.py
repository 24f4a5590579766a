"""The floor under bench/mesh.py on this machine: the toy request's gRPC message pattern between
the same five processes (client, conductor, three node groups), with no runtime in between.

Each process is a bare Python gRPC service on uvloop with the services' grpc settings
(mstar/grpc_env.py). They exchange the real wire messages (``FrameBatch`` of ``Frame`` over
``NodeGroup/Exchange`` streams, ``GenerateResponse`` to the client) through the mesh's own
``services.links.Link``, so frames coalesce into messages as in the mesh. What a request does,
for k = min(len(text), max_tokens) tokens:

    client --Generate--> conductor --START encode--> encoder --DONE--> conductor
    conductor --START generate--> decoder: k text EMITs -> conductor, one chunk frame per cut of
    each streaming edge (every 4, 4 and 3 tokens, as the toy's three chunk policies) -> audio
    audio: one EMIT per chunk frame -> conductor; decoder and audio DONE -> conductor
    conductor --events, then a final event--> client

That is the toy's critical path and no more traffic than it (its RELEASE frames, summary emit,
walk bookkeeping and all Python work of the runtime and the model are left out), so what this
mesh cannot do, the real one cannot either. Same client loops as bench/mesh.py; the streamed
events also through the real gateway process (``python -m mstar.gateway``) in front of it.

    python bench/mesh_floor.py --out bench/results/mesh-floor/floor.json [--quick] [--chained] [--uds DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mstar import grpc_env  # the services' grpc settings, for this process too

grpc_env.apply()  # before grpc is imported

import grpc

from mstar.services.grpc_server import run_service
from mstar.services.links import SERVER_OPTIONS, Link
from mstar.services.transport import Protocol
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc, node_group_pb2_grpc
from mstar.v1 import node_group_pb2 as npb

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("conductor", "encoder", "decoder", "audio")
START, DATA, EMIT, DONE = npb.FRAME_KIND_START_WALK, npb.FRAME_KIND_DATA, npb.FRAME_KIND_EMIT, npb.FRAME_KIND_FRAGMENT_DONE
CUTS = (4, 4, 3)  # tokens per chunk of the toy's three streaming edges


class Request:
    def __init__(self, tokens: int):
        self.events: asyncio.Queue = asyncio.Queue()  # output chunks for the client; None: finished
        self.tokens = tokens
        self.pending = 2  # DONEs to come: the decoder's and the audio group's


class Role(node_group_pb2_grpc.NodeGroupServicer, conductor_pb2_grpc.ConductorServicer):
    def __init__(self, name: str, chained: bool):
        """``chained``: the encoder seeds the generate walk on the decoder itself (walk chaining,
        a hop the conductor no longer sits in), as the best design of this topology would."""
        self.name, self.chained = name, chained
        self.links: dict[str, Link] = {}
        self.requests: dict[str, Request] = {}  # conductor's
        self.tasks: set[asyncio.Task] = set()  # decoder's loops
        self.ids = itertools.count()

    def connect(self, peers: dict[str, str]) -> None:
        def down(link, reason, requests):  # a failed request shows as the client's timeout
            pass

        self.links = {name: Link(self.name, name, address, "exchange", Protocol.TCP, down)
                      for name, address in peers.items()}

    async def Exchange(self, request_iterator, context):
        async for batch in request_iterator:
            for f in batch.frames:
                self.on_frame(f)
        return
        yield  # an async generator: the stream of Acks, never written

    def on_frame(self, f: npb.Frame) -> None:
        if self.name == "encoder":  # encode walk: done at once
            if self.chained:  # start the next walk itself; the conductor only hears of it
                self.links["decoder"].send(npb.Frame(kind=START, request_id=f.request_id, walk="generate",
                                                     iteration=f.iteration))
                self.links["conductor"].send(npb.Frame(kind=DONE, request_id=f.request_id, walk="encode", done=True))
            else:
                self.links["conductor"].send(npb.Frame(kind=DONE, request_id=f.request_id, walk="encode"))
        elif self.name == "decoder":
            self.tasks.add(t := asyncio.ensure_future(self.decode(f.request_id, f.iteration)))
            t.add_done_callback(self.tasks.discard)
        elif self.name == "audio":  # one chunk walk per chunk frame, each with one client output
            self.links["conductor"].send(npb.Frame(kind=EMIT, request_id=f.request_id, node="audio", edge=f.edge))
            if f.done:
                self.links["conductor"].send(npb.Frame(kind=DONE, request_id=f.request_id, walk="chunks"))
        else:
            self.conductor_frame(f)

    async def decode(self, rid: str, k: int) -> None:
        """The generate walk: k loop iterations, each its own event-loop pass, as the runtime's
        rounds are (so a lone stream's frames leave iteration by iteration)."""
        to_c, to_audio = self.links["conductor"], self.links["audio"]
        for i in range(k):
            to_c.send(npb.Frame(kind=EMIT, request_id=rid, node="decoder", edge="text", iteration=i))
            for edge, cut in enumerate(CUTS):
                if (i + 1) % cut == 0 or i == k - 1:
                    to_audio.send(npb.Frame(kind=DATA, request_id=rid, edge=str(edge), iteration=i,
                                            done=i == k - 1 and edge == len(CUTS) - 1))
            await asyncio.sleep(0)
        to_c.send(npb.Frame(kind=DONE, request_id=rid, walk="generate"))

    def conductor_frame(self, f: npb.Frame) -> None:
        r = self.requests.get(f.request_id)
        if r is None:
            return
        if f.kind == EMIT:
            r.events.put_nowait(cpb.OutputChunk(name=f.edge, text="x"))
        elif f.walk == "encode":
            if f.done:  # chained: the encoder started the next walk
                return
            self.links["decoder"].send(npb.Frame(kind=START, request_id=f.request_id, walk="generate",
                                                 iteration=r.tokens))
        else:
            r.pending -= 1
            if not r.pending:
                r.events.put_nowait(None)

    async def ListModels(self, request, context):  # what the gateway asks before each Generate
        return cpb.ListModelsResponse(models=[cpb.ModelInfo(name="toy")])

    async def Generate(self, request, context):
        rid = f"r{next(self.ids)}"
        kwargs = json.loads(request.model_kwargs_json or "{}")
        r = self.requests[rid] = Request(min(len(request.text.encode()), int(kwargs.get("max_tokens", 256))))
        self.links["encoder"].send(npb.Frame(kind=START, request_id=rid, walk="encode", iteration=r.tokens))
        try:
            while True:
                chunks = [await r.events.get()]
                while not r.events.empty():
                    chunks.append(r.events.get_nowait())
                done = chunks[-1] is None
                chunks = [c for c in chunks if c is not None]
                if chunks:
                    yield cpb.GenerateResponse(request_id=rid, chunks=chunks)
                if done:
                    yield cpb.GenerateResponse(request_id=rid, final=cpb.FinalEvent(finish_reason="stop"))
                    return
        finally:
            del self.requests[rid]


PEERS = {"conductor": ("encoder", "decoder"), "encoder": ("conductor", "decoder"), "decoder": ("conductor", "audio"),
         "audio": ("conductor",)}


def address(role: str, ports: dict[str, int], uds: str) -> str:
    """``uds``: a folder whose Unix sockets the services listen on instead of loopback TCP."""
    return f"unix:{uds}/{role}.sock" if uds else f"127.0.0.1:{ports[role]}"


async def serve(name: str, chained: bool, uds: str) -> None:
    """Serve one role on a free loopback port (or a Unix socket in ``uds``); print the port, read
    the peers' ports (a JSON line on stdin), connect, then run until stdin closes."""
    role = Role(name, chained)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    node_group_pb2_grpc.add_NodeGroupServicer_to_server(role, server)
    if name == "conductor":
        conductor_pb2_grpc.add_ConductorServicer_to_server(role, server)
    port = server.add_insecure_port(address(name, {name: 0}, uds))
    await server.start()
    print(port, flush=True)
    loop = asyncio.get_running_loop()
    ports = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
    role.connect({peer: address(peer, ports, uds) for peer in PEERS[name]})
    print("connected", flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until stdin closes
    for link in role.links.values():
        link.draining = True
    await server.stop(None)
    await asyncio.gather(*(link.close() for link in role.links.values()))


def launch_gateway(conductor: str, port_file: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "mstar.gateway", "--conductor", conductor, "--port", "0",
                             "--port-file", str(port_file), "--log-level", "WARNING"], cwd=ROOT)
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the gateway did not start")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}"


def launch(chained: bool = False, uds: str = "") -> tuple[list[subprocess.Popen], str]:
    env = dict(os.environ, GRPC_VERBOSITY="ERROR")  # no INFO lines from grpc core at shutdown
    extra = [*(["--chained"] if chained else []), *(["--uds", uds] if uds else [])]
    procs = {r: subprocess.Popen([sys.executable, __file__, "--role", r, *extra],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for r in ROLES}
    ports = {r: int(p.stdout.readline()) for r, p in procs.items()}
    for p in procs.values():
        p.stdin.write(json.dumps(ports) + "\n")
        p.stdin.flush()
    for p in procs.values():
        assert p.stdout.readline().strip() == "connected"
    return list(procs.values()), address("conductor", ports, uds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "mesh-floor" / "floor.json"))
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run, not for the record)")
    ap.add_argument("--chained", action="store_true",
                    help="the encoder starts the generate walk itself (walk chaining: one conductor hop fewer)")
    ap.add_argument("--uds", metavar="DIR", help="serve on Unix sockets in DIR instead of loopback TCP")
    ap.add_argument("--role", choices=ROLES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        run_service(serve(args.role, args.chained, args.uds or ""))
        return
    sys.path.insert(0, str(ROOT / "bench"))
    import mesh  # the same client loops, machine description and bare-call baseline

    scale = 0.1 if args.quick else 1.0
    counts = [(c, int(n * scale)) for c, n in ((1, 1000), (16, 4000), (64, 8000))]
    result: dict = {"command": " ".join(["python", "bench/mesh_floor.py", *sys.argv[1:]]), "machine": mesh.machine(),
                    "workload": __doc__.split("\n\n")[2], "raw_grpc": mesh.raw_grpc(counts)}
    procs, conductor = launch(args.chained, args.uds or "")
    try:
        t0 = time.time()
        result["latency"] = [asyncio.run(mesh.latency(conductor, c, n)) for c, n in counts]
        prompt = ("The quick brown fox jumps over the lazy dog. " * 100)[:4096]
        with tempfile.TemporaryDirectory() as tmp:
            gateway, url = launch_gateway(conductor, Path(tmp) / "port")
            pids = [p.pid for p in procs] + [gateway.pid, os.getpid()]  # the gateway idles in the gRPC runs
            try:
                result["events"] = [mesh.with_cpu(pids, lambda s=s: asyncio.run(mesh.events_grpc(conductor, s, prompt)))
                                    for s in (1, 8)]
                result["events"] += [mesh.with_cpu(pids, lambda s=s: asyncio.run(mesh.events_gateway(url, s, prompt)))
                                     for s in (1, 8)]
            finally:
                gateway.terminate()
                gateway.wait(10)
        result["elapsed_s"] = time.time() - t0
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            p.wait(10)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for key in ("raw_grpc", "latency", "events"):
        for row in result[key]:
            print(key, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
