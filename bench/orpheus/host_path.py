"""Orpheus' host path on this CPU: the mesh as served on a GPU (LLM and SNAC as two node
groups, the LLM's engine in a child process, streams through the REST gateway), with the
compute faked so that only the Python per token and per frame is left.

- the KV-cache engine is ``FakeEngine``: each step sleeps ``--step-ms`` (the GPU's step) and
  samples, for every running sequence, the next valid SNAC code of its frame position; a
  sequence ends at its ``max_tokens``;
- the SNAC decoder's window decode returns silence of the right length at once.

Both are patched in every process of the mesh by a ``sitecustomize`` (this file, on the
services' PYTHONPATH with ``MSTAR_BENCH_FAKE_COMPUTE=1``). ``--trees`` runs the same levels
on other source trees (``git archive`` of a commit, as bench/gateway_flood.py), one after the
other in one invocation: tokens/s and CPU microseconds per token of every process.

    python bench/orpheus/host_path.py --trees HEAD~1,HEAD --streams 256 --repeats 3 --out OUT.json
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time
from collections import namedtuple
from types import SimpleNamespace

# -- the fake compute (imported by sitecustomize in every service process) ---------------------
Event = namedtuple("Event", "request_id token_id status")
STEP_S = float(os.environ.get("MSTAR_BENCH_STEP_MS", "2")) / 1e3


class FakeEngine:
    """The part of ``KVCacheEngine`` that ``LocalSeqEngine`` uses; steps take ``STEP_S``."""

    cuda_graphs = False

    def __init__(self, max_num_seqs: int):
        from mstar.models.orpheus.tokens import AUDIO_TOKEN_OFFSET, CODES_PER_POSITION

        self.base, self.width = AUDIO_TOKEN_OFFSET, CODES_PER_POSITION
        self.max_num_seqs = max_num_seqs
        self.seqs: dict[str, list[int]] = {}  # request -> [tokens made, max_tokens]
        self.cache = SimpleNamespace(allocator=SimpleNamespace(num_used=0, num_free=1 << 20))
        self.stats = SimpleNamespace(preemptions=0)

    def add_request(self, request_id, prompt_ids, params, key=None):
        self.seqs[request_id] = [0, params.max_tokens]

    def import_request(self, request_id, token_ids, kv, params, key=None, num_output_tokens=0):
        self.seqs[request_id] = [num_output_tokens, params.max_tokens]

    def release(self, request_id):
        self.seqs.pop(request_id, None)

    @property
    def has_work(self) -> bool:
        return bool(self.seqs)

    def step(self) -> list:
        from mstar.services.engines.sequence import SeqStatus

        time.sleep(STEP_S)
        out = []
        for rid in list(self.seqs)[: self.max_num_seqs]:
            s = self.seqs[rid]
            token = self.base + (s[0] % 7) * self.width + (s[0] * 31) % self.width
            s[0] += 1
            done = s[0] >= s[1]
            out.append(Event(rid, token, SeqStatus.FINISHED_LENGTH if done else SeqStatus.RUNNING))
            if done:
                del self.seqs[rid]
        return out

    def close(self):
        pass


def fake_build_engine(checkpoint, device, config, tp=None):
    return FakeEngine(config.max_num_seqs)


def _silence(self, packed):
    import torch

    return torch.zeros(packed.shape[0], 1, packed.shape[1] // 7 * self.samples_per_frame)


PATCHES = {"mstar.models.orpheus.llm_node": lambda m: setattr(m, "build_engine", fake_build_engine),
           "mstar.models.orpheus.snac_node": lambda m: setattr(m.SnacNode, "_decode_packed", _silence)}


class _Patcher(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if os.environ.get("MSTAR_BENCH_FAKE_COMPUTE") == "1":
        sys.meta_path.insert(0, _Patcher())


# -- the measurement --------------------------------------------------------------------------
def _procs() -> dict[int, tuple[int, str]]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                out[int(d)] = (int(rest[1]), rest)
            except OSError:
                pass
    return out


def cpu_by_service(mesh) -> dict[str, float]:
    """CPU seconds of each service process and its children (the engine process), and of this one."""
    procs, tick = _procs(), os.sysconf("SC_CLK_TCK")
    cpu = lambda pid: (int(procs[pid][1][11]) + int(procs[pid][1][12])) / tick  # noqa: E731
    out = {}
    for s in mesh.services:
        pid = s.proc.pid
        out[s.name] = cpu(pid)
        for child, (ppid, _) in procs.items():
            if ppid == pid:
                out[f"{s.name}.engine"] = out.get(f"{s.name}.engine", 0.0) + cpu(child)
    out["client"] = cpu(os.getpid())
    return out


def counters(url: str) -> dict[str, float]:
    """A node group's link messages and frames by peer, and its node's batches (calls per batch)."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name.startswith(("mstar_link_messages", "mstar_link_frames")):
                key = f"{smp.name.split('_')[2]}->{smp.labels['dst']}"
            elif smp.name in ("mstar_node_group_batch_size_count", "mstar_node_group_batch_size_sum"):
                key = f"{smp.labels['node']}.{smp.name.rsplit('_', 1)[1]}"
            else:
                continue
            out[key] = out.get(key, 0.0) + smp.value
    return out


def run_tree(args) -> list[dict]:
    """In a process whose PYTHONPATH starts with the tree (and this folder, for sitecustomize)."""
    import asyncio
    import json
    import subprocess
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_orpheus import mstar_level, start_mesh

    import mstar

    mesh = start_mesh(Path(args.root), "split", {"engine_process": True, "max_num_seqs": args.max_num_seqs,
                                                 "snac_noise": False})
    address = mesh.url if args.rest else mesh.conductor_address
    rows = []
    try:
        asyncio.run(mstar_level(address, args.streams, 28))  # warm-up
        for rep in range(args.repeats):
            spies = []
            for name in args.py_spy.split(",") if args.py_spy and rep == 0 else []:
                pid = next(s.proc.pid for s in mesh.services if s.name == name)
                spies.append(subprocess.Popen(["py-spy", "record", "-r", "500", "--threads", "--gil", "--nonblocking", "-f", "raw", "-o",
                                               f"{args.spy_out}.{args.tree_name}.{name}.txt", "-p", str(pid)],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            if spies:
                time.sleep(1.0)
            url = mesh.metrics_urls()["llm"]
            b, cb = cpu_by_service(mesh), counters(url)
            r = asyncio.run(mstar_level(address, args.streams, args.max_tokens))
            a, ca = cpu_by_service(mesh), counters(url)
            for spy in spies:
                spy.send_signal(2)
                spy.wait()
            tokens = args.streams * args.max_tokens
            cpu = {k: round(1e6 * (a[k] - b.get(k, 0.0)) / tokens, 1) for k in a}
            rows.append({"tree": args.tree_name, "mstar_from": mstar.__file__, "streams": args.streams,
                         "tokens": tokens, "wall_s": round(r["wall_s"], 3), "tokens_per_s": round(tokens / r["wall_s"]),
                         "stopped_early": r["stopped_early"], "ttfa_p50_s": round(r["ttfa_p50_s"], 3),
                         "cpu_us_per_token": {**cpu, "total": round(sum(cpu.values()), 1)},
                         "llm_group_counts": {k: ca[k] - cb.get(k, 0.0) for k in ca}})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        mesh.stop()
    return rows


def main() -> None:
    import argparse
    import json
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", default="", help="commits to run, in turn (git archive); empty: this checkout")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=140)  # 20 frames
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="the trees in turn this many times (ABAB...)")
    ap.add_argument("--rest", action=argparse.BooleanOptionalAction, default=True, help="through the REST gateway")
    ap.add_argument("--root", default="/tmp/orpheus-host-path", help="tiny checkpoint folder (written if missing)")
    ap.add_argument("--py-spy", default="", help="services to sample, comma-separated (py-spy raw) in each tree's first repeat")
    ap.add_argument("--spy-out", default="/tmp/host_path")
    ap.add_argument("--out")
    ap.add_argument("--tree-name", default="", help=argparse.SUPPRESS)  # set for the child runs
    args = ap.parse_args()
    if args.tree_name:
        rows = run_tree(args)
        Path(args.out).write_text(json.dumps(rows))
        return
    here, repo = Path(__file__).resolve().parent, Path(__file__).resolve().parents[2]
    if not (Path(args.root) / "hubertsiuzdak").exists():
        subprocess.run([sys.executable, str(here / "bench_orpheus.py"), "--tiny", "--root", args.root, "--streams", "",
                        "--baseline-streams", "", "--out", "/dev/null"], check=False)
    work = Path(tempfile.mkdtemp(prefix="host-path-"))
    (work / "sitecustomize.py").write_text("import host_path\nhost_path.install()\n")
    trees = {}
    for rev in [t for t in args.trees.split(",") if t] or [""]:
        if not rev:
            trees["checkout"] = repo
            continue
        sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
        tree = trees[sha] = work / sha
        tree.mkdir()
        archive = subprocess.run(["git", "archive", sha], cwd=repo, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    rows = []
    try:
        for _ in range(args.rounds):
            for name, tree in trees.items():
                env = {**os.environ, "PYTHONPATH": f"{tree}:{here}:{work}", "MSTAR_BENCH_FAKE_COMPUTE": "1",
                       "MSTAR_BENCH_STEP_MS": str(args.step_ms)}
                out = work / f"{name}.json"
                argv = [a for a in sys.argv[1:]]
                subprocess.run([sys.executable, __file__, *argv, "--tree-name", name, "--out", str(out)], env=env, check=True)
                rows += json.loads(out.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for name in trees:
        tps = [r["tokens_per_s"] for r in rows if r["tree"] == name]
        llm = [r["cpu_us_per_token"]["llm"] for r in rows if r["tree"] == name]
        summary[name] = {"tokens_per_s": tps, "llm_cpu_us_per_token": llm}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv[1:], "cpus": os.cpu_count(), "step_ms": args.step_ms,
                                              "summary": summary, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
