"""Where the served Orpheus path spends its time on the GPU host: runs N streams through
the mesh and samples the node-group process with py-spy (all threads, native frames off).

    python bench/orpheus/profile_served.py --out $OUT/profile.txt --streams 64
"""

import argparse
import asyncio
import collections
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench_orpheus import PLACEMENTS, mstar_level, start_mesh, write_checkpoints  # noqa: I001  (same folder)


def summarize(raw: Path, top: int = 40) -> str:
    self_t, incl = collections.Counter(), collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        n = int(n)
        total += n
        frames = stack.split(";")
        self_t[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    threads = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if n.isdigit():
            threads[stack.split(";")[0]] += int(n)
    out = [f"samples: {total}", "", "## busy samples per thread"]
    out += [f"{c:6d}  {t}" for t, c in threads.most_common()]
    out += ["", "## self"]
    out += [f"{100 * c / total:5.1f}%  {f}" for f, c in self_t.most_common(top)]
    out += ["", "## inclusive (mstar code)"]
    out += [f"{100 * c / total:5.1f}%  {f}" for f, c in incl.most_common(400) if "/mstar/" in f or "main/" in f][:top]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=700)
    ap.add_argument("--tiny", action="store_true", help="tiny random model (a CPU look at the per-token overhead)")
    ap.add_argument("--root", help="checkpoint folder to reuse (written there if missing)")
    ap.add_argument("--placement", choices=PLACEMENTS, default="split")
    ap.add_argument("--model-kwargs", default="{}", help="JSON merged into the config's model_kwargs (e.g. snac_dtype)")
    ap.add_argument("--spy-args", default="", help="more py-spy record options, e.g. '--gil' (only the GIL holder) or '--idle'")
    args = ap.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="orpheus-prof-"))
    if not (root / "hubertsiuzdak").exists():
        write_checkpoints(root, tiny=args.tiny)
    mesh = start_mesh(root, args.placement, json.loads(args.model_kwargs))
    try:
        asyncio.run(mstar_level(mesh.conductor_address, 4, 64))
        pids = {s.name: s.proc.pid for s in mesh.services}
        for s in mesh.services:  # engine processes (model_kwargs.engine_process) are the services' children
            for kid in open(f"/proc/{s.proc.pid}/task/{s.proc.pid}/children").read().split():
                if "spawn_main" in open(f"/proc/{kid}/cmdline").read():
                    pids[f"{s.name}-engine"] = int(kid)
        pids["bench-client"] = os.getpid()
        out = Path(args.out)

        def spy(name: str, pid: int) -> None:
            time.sleep(3)
            subprocess.run(["py-spy", "record", "-p", str(pid), "-d", "8", "-r", "200", "-f", "raw", "--threads",
                            "-o", str(out.with_suffix(f".{name}.raw")), "--nonblocking", *args.spy_args.split()],
                           check=False, capture_output=True)

        spies = [threading.Thread(target=spy, args=item) for item in pids.items()]
        for t in spies:
            t.start()
        r = asyncio.run(mstar_level(mesh.conductor_address, args.streams, args.max_tokens))
        for t in spies:
            t.join()
        parts = [json.dumps(r), f"8 s at 200 Hz: 1,600 samples = one thread busy all the time; py-spy extra: {args.spy_args!r}"]
        for name in pids:
            raw = out.with_suffix(f".{name}.raw")
            if raw.exists():
                parts += ["", f"# process {name}", summarize(raw)]
        out.write_text("\n".join(parts))
    finally:
        mesh.stop()


if __name__ == "__main__":
    main()
