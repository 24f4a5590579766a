"""A/B of two versions of the sampler's draw (``Sampler._draw``), e.g. before and after the
blocked cumsum, on one GPU: random logits over a 128,256-id vocabulary, plain sampling
(temperature 1) and top-p 0.8, CUDA events, medians after warm-up.

    git show 6fb522a:services/engines/sampling.py > /tmp/sampling_old.py
    cp services/engines/sampling.py /tmp/sampling_new.py
    python bench/engines/sampler_ab.py OUT.json /tmp/sampling_old.py /tmp/sampling_new.py [reps]
"""
import importlib.util
import inspect
import json
import statistics
import sys

import torch


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m  # dataclasses look their module up
    spec.loader.exec_module(m)
    return m


def draw(mod, x, rows, sort):
    kw = {"any_greedy": False} if "any_greedy" in inspect.signature(mod.Sampler._draw).parameters else {}
    return mod.Sampler._draw(x, rows, sort=sort, min_p=False, **kw)


old, new = load("sampling_old", sys.argv[2]), load("sampling_new", sys.argv[3])
dev = torch.device("cuda")
V = 128256
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 200
res = {"device": torch.cuda.get_device_name(), "vocab": V, "reps": reps, "old": sys.argv[2], "new": sys.argv[3],
       "rows": []}


def timeit(fn):
    for _ in range(10):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return statistics.median(ts)


for B in (1, 16, 64, 128):
    x = torch.randn(B, V, device=dev) * 3
    for case, top_p in (("plain_t1", 1.0), ("top_p_0.8", 0.8)):
        rows = torch.tensor([[1.0] * B, [top_p] * B, [0.0] * B, [0.0] * B, [0.0] * B, [0.37] * B],
                            dtype=torch.float64, device=dev)
        sort = top_p < 1
        o = timeit(lambda: draw(old, x, rows, sort))  # noqa: B023 - called within the iteration
        n = timeit(lambda: draw(new, x, rows, sort))  # noqa: B023
        po, pn = draw(old, x, rows, sort), draw(new, x, rows, sort)
        r = dict(batch=B, case=case, old_us=round(o, 1), new_us=round(n, 1), old_over_new=round(o / n, 2),
                 same_picks=int((po == pn).sum()))
        print(r, flush=True)
        res["rows"].append(r)
with open(sys.argv[1], "w") as f:
    json.dump(res, f, indent=1)
