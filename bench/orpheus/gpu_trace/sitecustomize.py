"""Bench-only: a GPU kernel trace of every process of a served run, started by a file.

Put this folder first on PYTHONPATH and set MSTAR_GPU_TRACE=DIR,SECONDS. Every Python
process that starts (services, the engine's spawned child) then runs a thread that waits
for DIR/start-0; when it appears, a process that holds a CUDA context records its kernels
and copies with torch.profiler for SECONDS and writes DIR/0/trace-<pid>.json.gz, then waits
for DIR/start-1, and so on. Kineto
puts device timestamps on the host clock, so the processes' traces share one time axis.
Used by trace_served.py; nothing in the product imports it.
"""

import os
import sys
import threading
import time


def _watch(out: str, seconds: float) -> None:
    k = 0
    while True:
        while not os.path.exists(os.path.join(out, f"start-{k}")):
            time.sleep(0.02)
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                time.sleep(seconds)
                torch.cuda.synchronize()
            sub = os.path.join(out, str(k))
            os.makedirs(sub, exist_ok=True)
            prof.export_chrome_trace(os.path.join(sub, f"trace-{os.getpid()}.json.gz"))
            with open(os.path.join(sub, f"argv-{os.getpid()}.txt"), "w") as f:
                f.write(" ".join(sys.argv))
        k += 1


_spec = os.environ.get("MSTAR_GPU_TRACE")
if _spec:
    _dir, _secs = _spec.split(",")
    threading.Thread(target=_watch, args=(_dir, float(_secs)), daemon=True, name="gpu-trace").start()
