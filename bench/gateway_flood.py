"""Gateway flood (issue 49, hole 1): one API key's chat latency and the gateway's memory while another
key floods the gateway with the worst JSON body, against the old code and the new in one run.

Each run serves the toy model (``mstar serve toy`` with two API keys, real processes) from a source
tree: ``git archive`` of ``--old`` and of ``--new`` (default HEAD: committed code only, not the
working tree's edits), extracted outside the repository and started with PYTHONPATH pointing at it
(the record names the file ``mstar.gateway.body`` is imported from there, and the flood's answers
differ: the old code serves the body, the new one refuses it). Phases: the victim key's small chat
requests (``--rate`` a second, each on schedule: open loop), idle; then with ``--flooders`` connections of the other key each
sending ~900k one-character messages (29 MiB, under the 32 MiB body limit) back to back; then after.
The RSS of the gateway and of its descendants (JSON workers) is sampled throughout.

    python bench/gateway_flood.py --out bench/results/gateway-flood   # flood.json, samples.json, flood.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mesh import ROOT, machine  # noqa: E402

VICTIM_KEY, FLOOD_KEY = "victim-key-0123456789abcdef", "flooder-key-0123456789abcdef"
SMALL = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CHAT = "/v1/chat/completions"
WAIT_S = 120.0  # every HTTP wait


def flood_body() -> bytes:
    return json.dumps({"model": "toy", "messages": [{"role": "user", "content": "a"}] * 900_000}).encode()


# --- processes ----------------------------------------------------------------------------------
def source_tree(rev: str) -> Path:
    """``rev``'s files in a fresh folder outside the repository."""
    out = Path(tempfile.mkdtemp(prefix=f"gateway-flood-{rev[:10]}-"))
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def tree_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def imported_from(tree: Path) -> str:
    """Where a process started like the tree's services imports the gateway's body reader from."""
    return subprocess.run([sys.executable, "-c", "import mstar.gateway.body as b; print(b.__file__)"], cwd=tree,
                          env=tree_env(tree), capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(tree: Path, keys: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mstar.cli", "serve", "toy", "--port", str(port), "--grpc-port",
                             str(free_port()), "--api-keys-file", str(keys), "--log-level", "WARNING"], cwd=tree,
                            env=tree_env(tree), stdout=log.open("w"), stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mstar serve exited {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the mesh did not answer /health within 180 s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _stat(pid: int) -> tuple[int, int]:
    """(parent pid, RSS bytes) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[21]) * os.sysconf("SC_PAGE_SIZE")


def _processes() -> dict[int, tuple[int, int]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                out[int(name)] = _stat(int(name))
            except (OSError, IndexError):
                pass
    return out


def gateway_pid(launcher: int) -> int:
    for pid, (ppid, _) in _processes().items():
        if ppid == launcher and b"mstar.gateway" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise RuntimeError("no gateway process under the launcher")


def tree_rss(root: int) -> tuple[float, float, int]:
    """MiB of RSS of ``root`` and of its descendants (JSON workers), and how many processes they are."""
    procs = _processes()
    members = {root}
    for _ in range(4):  # descendants a few levels down
        members |= {pid for pid, (ppid, _) in procs.items() if ppid in members}
    own = procs[root][1] if root in procs else 0
    others = sum(procs[p][1] for p in members - {root} if p in procs)
    return own / 2**20, others / 2**20, len(members & procs.keys())


class Sampler(threading.Thread):
    def __init__(self, pid: int, t0: float):
        super().__init__(daemon=True)
        self.pid, self.t0, self.samples, self.done = pid, t0, [], threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.25):
            own, others, n = tree_rss(self.pid)
            self.samples.append((round(time.monotonic() - self.t0, 2), round(own + others, 1), round(own, 1), n))


# --- clients ------------------------------------------------------------------------------------
async def victim(url: str, seconds: float, t0: float, rate: float) -> list[tuple[float, float, int]]:
    """(start, latency s, status) of small chats sent at ``rate`` a second for ``seconds``, each on
    schedule whether or not the earlier ones were answered (open loop: a client sending one after
    another would send few requests during a stall, and its percentiles would hide the stall)."""

    async def one(s: aiohttp.ClientSession) -> tuple[float, float, int]:
        start = time.monotonic()
        async with s.post(url + CHAT, json=SMALL) as r:
            await r.read()
        return round(start - t0, 3), time.monotonic() - start, r.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S),
                                     connector=aiohttp.TCPConnector(limit=0),
                                     headers={"Authorization": f"Bearer {VICTIM_KEY}"}) as s:
        begin, sent = time.monotonic(), []
        while time.monotonic() < begin + seconds:
            sent.append(asyncio.create_task(one(s)))
            await asyncio.sleep(max(0.0, begin + len(sent) / rate - time.monotonic()))
        return list(await asyncio.gather(*sent))


async def flood(url: str, connections: int, seconds: float) -> dict:
    """Each connection sends the body back to back until ``seconds`` have passed (its last one ends)."""
    body, statuses, durations = flood_body(), {}, []
    print("ready", flush=True)

    async def one_connection(end: float) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S), headers={
                "Authorization": f"Bearer {FLOOD_KEY}", "Content-Type": "application/json"}) as s:
            while time.monotonic() < end:
                start = time.monotonic()
                async with s.post(url + CHAT, data=body) as r:
                    await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1
                durations.append(time.monotonic() - start)

    end = time.monotonic() + seconds
    await asyncio.gather(*(one_connection(end) for _ in range(connections)))
    return {"connections": connections, "body_bytes": len(body), "statuses": statuses,
            "request_s_p50": round(statistics.median(durations), 3) if durations else None}


def stats(rows: list) -> dict:
    lat = sorted(r[1] * 1e3 for r in rows)
    if not lat:
        return {"n": 0}
    q = statistics.quantiles(lat, n=10) if len(lat) > 1 else [lat[0]] * 9
    return {"n": len(lat), "p50_ms": round(statistics.median(lat), 2), "p90_ms": round(q[8], 2),
            "max_ms": round(lat[-1], 2), "errors": sum(r[2] != 200 for r in rows)}


def one_run(name: str, tree: Path, keys: Path, work: Path, args) -> dict:
    launcher, url = serve(tree, keys, work / f"{name}.log")
    try:
        gw = gateway_pid(launcher.pid)
        load = {"start": os.getloadavg()}  # the machine is shared: how busy it was
        t0 = time.monotonic()
        sampler = Sampler(gw, t0)
        sampler.start()
        asyncio.run(victim(url, 2.0, t0, args.rate))  # warm-up, not kept
        phases = {"idle": asyncio.run(victim(url, args.idle_s, t0, args.rate))}
        t_flood = time.monotonic() - t0
        flooder = subprocess.Popen([sys.executable, __file__, "--flood", url, str(args.flooders), str(args.flood_s)],
                                   stdout=subprocess.PIPE, text=True)
        assert flooder.stdout.readline().strip() == "ready"
        phases["flood"] = asyncio.run(victim(url, args.flood_s, t0, args.rate))
        flooded = json.loads(flooder.communicate(timeout=WAIT_S + args.flood_s)[0])
        t_after = time.monotonic() - t0
        phases["after"] = asyncio.run(victim(url, args.after_s, t0, args.rate))
        sampler.done.set()
        sampler.join()
        load["end"] = os.getloadavg()
    finally:
        stop(launcher)
    mem = sampler.samples

    def mib(lo: float, hi: float, col: int = 1) -> list[float]:
        return [s[col] for s in mem if lo <= s[0] < hi]

    end = mem[-1][0]
    return {"code": name, "tree": str(tree), "mstar.gateway.body imported from": imported_from(tree),
            "phases_s": {"flood_start": round(t_flood, 2), "after_start": round(t_after, 2), "end": end},
            "loadavg_1_5_15": load,
            "victim": {k: stats(v) for k, v in phases.items()}, "flood": flooded,
            "memory_mib": {"before": statistics.median(mib(0, t_flood)), "during_max": max(mib(t_flood, t_after)),
                           "after": statistics.median(mib(end - 3, end + 1)),
                           "gateway_alone": {"before": statistics.median(mib(0, t_flood, 2)),
                                             "during_max": max(mib(t_flood, t_after, 2)),
                                             "after": statistics.median(mib(end - 3, end + 1, 2))},
                           "processes_max": max(s[3] for s in mem)},
            "samples": {"victim": {k: [(round(t, 2), round(lat * 1e3, 1), s) for t, lat, s in v]
                                   for k, v in phases.items()}, "memory": mem}}


def plot(runs: list[dict], samples: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 6), sharex="col", squeeze=False)
    for col, run in enumerate(runs):
        lat, mem, series = axes[0][col], axes[1][col], samples[run["code"]]
        for phase, rows in series["victim"].items():
            lat.plot([r[0] for r in rows], [r[1] for r in rows], ".", ms=3, label=phase)
        lat.set_yscale("log")
        lat.set_ylabel("victim chat latency, ms")
        lat.set_title(f"{run['code']} code")
        lat.legend(loc="upper left")
        mem.plot([m[0] for m in series["memory"]], [m[1] for m in series["memory"]], label="gateway + JSON workers")
        mem.plot([m[0] for m in series["memory"]], [m[2] for m in series["memory"]], label="gateway")
        mem.set_ylabel("RSS, MiB")
        mem.legend(loc="upper left")
        mem.set_xlabel("s")
        for ax in (lat, mem):
            ax.axvspan(run["phases_s"]["flood_start"], run["phases_s"]["after_start"], color="red", alpha=0.08)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    from PIL import Image  # stored as a 64-colour PNG, as bench/results/README.md asks

    Image.open(path).convert("RGB").quantize(64).save(path, optimize=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gateway-flood"))
    ap.add_argument("--old", default="c60cad7", help="the code before the fix (a git revision)")
    ap.add_argument("--new", default="HEAD", help="the code with it (a git revision)")
    ap.add_argument("--flooders", type=int, default=2, help="concurrent flood connections")
    ap.add_argument("--rate", type=float, default=20.0, help="the victim's requests a second (open loop)")
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--flood-s", type=float, default=30.0)
    ap.add_argument("--after-s", type=float, default=90.0, help="long enough for idle JSON workers to stop "
                    "(mstar/limits.py JSON_WORKER_IDLE_S, checked every quarter of it)")
    ap.add_argument("--flood", nargs=3, metavar=("URL", "CONNECTIONS", "SECONDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.flood:
        url, n, seconds = args.flood
        print(json.dumps(asyncio.run(flood(url, int(n), float(seconds)))))
        return
    work = Path(tempfile.mkdtemp(prefix="gateway-flood-"))
    keys = work / "keys"
    keys.write_text(f"{VICTIM_KEY}\n{FLOOD_KEY}\n")
    revs = {name: subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.strip() for name, rev in (("old", args.old), ("new", args.new))}
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(), **revs}
    trees = {name: source_tree(rev) for name, rev in revs.items()}
    try:
        runs = [one_run(name, tree, keys, work, args) for name, tree in trees.items()]
    finally:
        for folder in trees.values():
            shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(work)  # kept when a run fails: the meshes' logs are there
    for run, tree in zip(runs, trees.values(), strict=True):
        if not run["mstar.gateway.body imported from"].startswith(str(tree)):
            raise RuntimeError(f"the {run['code']} run imported {run['mstar.gateway.body imported from']}")
    result |= {"workload": f"toy model (mstar serve toy, API keys); victim: POST {CHAT} {json.dumps(SMALL)} "
                          f"{args.rate:g} a second, open loop; flood: {args.flooders} connections of another key, each POSTing "
                          "900,000 one-character user messages (29 MiB) back to back",
              "runs": runs}
    samples = {run["code"]: run.pop("samples") for run in runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flood.json").write_text(json.dumps(result, indent=1))
    (out / "samples.json").write_text(json.dumps(samples, separators=(",", ":")))  # victim (t s, ms, status),
    plot(runs, samples, out / "flood.png")  # memory (t s, MiB with workers, MiB gateway alone, processes)
    for run in runs:
        print(run["code"], json.dumps({k: run[k] for k in ("victim", "flood", "memory_mib")}))


if __name__ == "__main__":
    main()
