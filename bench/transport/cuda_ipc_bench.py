"""GB/s of a GPU tensor between two processes on one GPU host, through the real Link / gRPC
Exchange path: CUDA IPC (Protocol.AUTO picks it for a GPU tensor to a GPU peer on the same
host) against the host round trip (Protocol.SHM forced: device → host, shared memory,
host → device), 64 KiB to 256 MiB.

The sending process owns one ``Link`` per protocol; the receiving process (spawned)
serves an Exchange like a node group's: it decodes each tensor with ``TensorReceiver``,
puts it on its GPU (a no-op for CUDA IPC, a host-to-device copy after shared memory),
waits for the device, takes the time, then checks a checksum of the bytes and
acknowledges the buffer. One tensor is in flight at a time, the two protocols taking
turns. A transfer's time runs from before ``Link.send`` (which encodes: the copy into the
pooled buffer) to the tensor being complete in the receiver's GPU memory (CLOCK_MONOTONIC,
one clock for both processes). Also measured, in the sending process: one
device-to-device ``copy_`` of the same size (CUDA events), the ceiling of a transport
that copies twice.

    python bench/transport/cuda_ipc_bench.py --out bench/results/transport/cuda_ipc.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import queue
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import torch

from mstar.services.links import SERVER_OPTIONS, Link
from mstar.services.transport import Protocol, TensorReceiver
from mstar.services.transport.location import local_location
from mstar.v1 import node_group_pb2, node_group_pb2_grpc

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
RUNS = {"cuda_ipc": (Protocol.AUTO, "cuda_ipc"), "host_shm": (Protocol.SHM, "shm")}


def checksum(t: torch.Tensor) -> int:
    return int(t.view(torch.int32).sum(dtype=torch.int64).item())


class Exchange(node_group_pb2_grpc.NodeGroupServicer):
    def __init__(self, reports, device: str):
        self.reports, self.device = reports, torch.device(device)

    async def Exchange(self, request_iterator, context):
        receiver = TensorReceiver()
        yield node_group_pb2.Ack(receiver=local_location("receiver", str(self.device)))
        try:
            async for batch in request_iterator:
                acks: list[int] = []
                for frame in batch.frames:
                    for msg in frame.tensors:
                        t = receiver.decode(msg, acks).to(self.device)
                        torch.cuda.current_stream(self.device).synchronize()
                        t1 = time.perf_counter()
                        self.reports.put({"t1": t1, "checksum": checksum(t), "payload": msg.WhichOneof("payload"),
                                          "device": str(t.device)})
                if acks:
                    yield node_group_pb2.Ack(released_buffer_ids=acks)
        finally:
            receiver.close()


async def serve(reports, device: str) -> None:
    torch.cuda.init()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    node_group_pb2_grpc.add_NodeGroupServicer_to_server(Exchange(reports, device), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    reports.put({"port": port})
    await server.wait_for_termination()


def receiver_main(reports, device: str) -> None:
    asyncio.run(serve(reports, device))


async def next_report(reports) -> dict:
    def get():
        try:
            return reports.get(timeout=120)
        except queue.Empty:
            raise RuntimeError("the receiving process sent nothing for 120 s") from None

    return await asyncio.get_running_loop().run_in_executor(None, get)


async def until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0)


class Lane:
    """One Link to the receiver under one protocol, counting the acks that come back."""

    def __init__(self, name: str, address: str, reports):
        self.name, self.reports = name, reports
        self.protocol, self.payload = RUNS[name]
        self.link = Link("bench", "receiver", address, "exchange", self.protocol, lambda *_: None)
        self.acked = 0

    async def open(self) -> None:
        self.link.send(node_group_pb2.Frame(request_id="hello"))
        await until(lambda: self.link._tensors.peer is not None, "the receiver's location")
        release = self.link._tensors.release

        def counting_release(ids):
            self.acked += len(ids)
            release(ids)

        self.link._tensors.release = counting_release

    async def transfer(self, src: torch.Tensor, want: int, tag: str) -> tuple[float, float]:
        """(send → in the receiver's GPU memory, encode) in seconds, for one tensor."""
        torch.cuda.synchronize(src.device)
        sent = self.acked
        frame = node_group_pb2.Frame(request_id=tag)
        t0 = time.perf_counter()
        self.link.send(frame, [("x", src)])
        t_enc = time.perf_counter()
        got = frame.tensors[0].WhichOneof("payload")
        if got != self.payload:
            raise RuntimeError(f"{self.name}: {src.numel()} B went as {got}, not {self.payload}")
        r = await next_report(self.reports)
        if r["checksum"] != want or r["payload"] != self.payload:
            raise RuntimeError(f"{self.name}: {src.numel()} B arrived wrong: {r} (checksum {want} sent)")
        await until(lambda: self.acked > sent, "the ack")
        return r["t1"] - t0, t_enc - t0


async def run_all(address: str, reports, device: torch.device, sizes, warmup: int, repeats: int) -> dict:
    """Both protocols, alternating transfer by transfer, so that neither gets the quieter moments."""
    lanes = [Lane(name, address, reports) for name in RUNS]
    for lane in lanes:
        await lane.open()
    runs: dict[str, list[dict]] = {lane.name: [] for lane in lanes}
    try:
        for nbytes in sizes:
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
            want = checksum(src)
            times: dict[str, tuple[list, list]] = {lane.name: ([], []) for lane in lanes}
            for i in range(warmup + repeats):
                for lane in lanes:
                    total, enc = await lane.transfer(src, want, f"{lane.name}-{nbytes}-{i}")
                    if i >= warmup:
                        times[lane.name][0].append(total)
                        times[lane.name][1].append(enc)
            for lane in lanes:
                totals, encodes = times[lane.name]
                med = statistics.median(totals)
                p = {"bytes": nbytes, "median_s": med, "min_s": min(totals), "gb_per_s": nbytes / med / 1e9,
                     "encode_median_s": statistics.median(encodes), "repeats": repeats}
                runs[lane.name].append(p)
                print(f"{lane.name:9s} {nbytes:>10d} B  {p['gb_per_s']:8.2f} GB/s  ({med * 1e3:.3f} ms, encode "
                      f"{p['encode_median_s'] * 1e3:.3f} ms)", flush=True)
            del src
    finally:
        for lane in lanes:
            await lane.link.close()
    return runs


def d2d_copy(device: torch.device, sizes, repeats: int) -> list[dict]:
    points = []
    for nbytes in sizes:
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        times = []
        for i in range(repeats + 3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            if i >= 3:
                times.append(a.elapsed_time(b) / 1e3)
        med = statistics.median(times)
        points.append({"bytes": nbytes, "median_s": med, "gb_per_s": nbytes / med / 1e9})
    return points


def device_line() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        return out.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return torch.cuda.get_device_name(0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes, comma-separated")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    proc = ctx.Process(target=receiver_main, args=(reports, args.device), daemon=True)
    proc.start()
    result = {"command": " ".join(["python", *sys.argv]), "device": device_line(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "python": platform.python_version(), "host": platform.node(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "sizes": sizes, "warmup": args.warmup,
              "repeats": args.repeats, "runs": {}}
    print(result["device"], "| torch", result["torch"], flush=True)
    try:
        address = f"127.0.0.1:{reports.get(timeout=120)['port']}"

        result["runs"] = asyncio.run(run_all(address, reports, device, sizes, args.warmup, args.repeats))
    finally:
        proc.terminate()
        proc.join(10)
    result["d2d_copy"] = d2d_copy(device, sizes, args.repeats)
    result["ratio_cuda_ipc_over_host_shm"] = [
        {"bytes": a["bytes"], "ratio": a["gb_per_s"] / b["gb_per_s"]}
        for a, b in zip(result["runs"]["cuda_ipc"], result["runs"]["host_shm"], strict=True)]
    for r, c in zip(result["ratio_cuda_ipc_over_host_shm"], result["d2d_copy"], strict=True):
        print(f"{r['bytes']:>10d} B  cuda_ipc / host_shm = {r['ratio']:6.1f}x   (one D2D copy_: "
              f"{c['gb_per_s']:.0f} GB/s)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
