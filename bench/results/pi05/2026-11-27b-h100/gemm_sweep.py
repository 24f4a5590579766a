"""Kernel-only timing: split-K Triton skinny GEMM configs vs cuBLAS (F.linear), CUDA graphs."""
import json, sys, torch
import torch.nn.functional as F
import triton.testing as tt
from mstar.services.engines import splitk_triton as S

SHAPES = {"qkv": (2560, 1024), "o_proj": (1024, 2048), "gate_up": (8192, 1024), "down": (1024, 4096)}
CFGS = [(64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (64, 64, 256, 3, 4), (64, 128, 128, 3, 4), (64, 64, 64, 5, 4),
        (64, 128, 64, 4, 4), (64, 32, 256, 4, 4), (64, 32, 64, 6, 4)]
out = []
def rec(**kw):
    out.append(kw); print(kw, flush=True)
def bench(fn):
    return round(tt.do_bench_cudagraph(fn, rep=25) * 1e3, 2)
for m in (50, 200):
    for name, (n, k) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        ref = F.linear(x, w)
        mb = n * k * 2 / 1e6
        us = bench(lambda: F.linear(x, w))
        rec(m=m, gemm=name, impl="cublas", us=us, tb_s=round(mb / us, 2))
        best = (1e9, None)
        for cfg in CFGS:
            for splits in (1, 2, 4, 8, None):
                fn = lambda: S.linear(x, w, config=cfg, splits=splits)
                try:
                    err = (fn().float() - ref.float()).abs().max().item()
                    us = bench(fn)
                except Exception as e:
                    rec(m=m, gemm=name, cfg=cfg, splits=splits, error=repr(e)[:160]); continue
                rec(m=m, gemm=name, cfg=cfg, splits=splits, us=us, tb_s=round(mb / us, 2), err=round(err, 4))
                best = min(best, (us, (cfg, splits)))
        rec(m=m, gemm=name, best=best)
json.dump(out, open(sys.argv[1], "w"), indent=1)
