"""Kernel-only timing: the expert attention (Triton configs) vs the compiled torch path, CUDA graphs."""
import json, sys, torch
import triton.testing as tt
from mstar.models.pi05 import attn_triton as A
from mstar.models.pi05.policy import expert_attention
from mstar.models.pi05.layers import additive_mask, attend, rope
import torch.nn.functional as F

def case(b, t=50, h=8, hkv=1, d=256, p=968):
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(b, t, h + 2 * hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = qkv.split([h, hkv, hkv], dim=2)
    ang = torch.rand(b, t, d // 2, device="cuda", generator=g) * 6
    cos = torch.cat([ang.cos()] * 2, -1).bfloat16()[:, :, None]; sin = torch.cat([ang.sin()] * 2, -1).bfloat16()[:, :, None]
    kv = torch.randn(b, 2, hkv, p, d, device="cuda", dtype=torch.bfloat16, generator=g)
    valid = torch.ones(b, p, dtype=torch.bool, device="cuda")
    return q, k, v, cos, sin, kv[:, 0], kv[:, 1], valid

def torch_path(q, k, v, cos, sin, pk, pv, valid):
    b, t = q.shape[:2]
    q, k, v = rope(q, cos, sin), rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)
    pad = -(pk.shape[2] + t) % 64
    keys = torch.cat([pk, F.pad(k, (0, 0, 0, pad))], 2); values = torch.cat([pv, F.pad(v, (0, 0, 0, pad))], 2)
    allowed = torch.cat([valid, valid.new_ones(b, t), valid.new_zeros(b, pad)], 1)
    return attend(q, keys, values, additive_mask(allowed[:, None, None, :], q.dtype))

def op_path(q, k, v, cos, sin, pk, pv, valid):
    return expert_attention(rope(q, cos, sin), rope(k, cos, sin), v, pk, pv, valid)

out = []
tp, op = torch.compile(torch_path), torch.compile(op_path)
def rec(**kw):
    out.append(kw); print(kw, flush=True)
for b in (1, 4, 16):
    args = case(b)
    ref = tp(*args)
    rec(b=b, impl="torch_compiled", us=round(tt.do_bench_cudagraph(lambda: tp(*args), rep=200) * 1e3, 2))
    got = op(*args)
    rec(b=b, impl="rope+kernel_compiled", us=round(tt.do_bench_cudagraph(lambda: op(*args), rep=200) * 1e3, 2),
        max_err=(got.float() - ref.float()).abs().max().item())
    q, k = rope(args[0], args[3], args[4]), rope(args[1], args[3], args[4])
    kargs = (q, k, args[2], args[5], args[6], args[7])
    for bm, bn, warps in ((32, 64, 8), (32, 32, 4), (64, 64, 8), (64, 32, 4), (16, 64, 4)):
        for splits in (1, 2, 4, 8, 16):
            fn = lambda: A.attention(*kargs, block_m=bm, block_n=bn, splits=splits, num_warps=warps)
            try:
                err = (fn().float() - ref.float()).abs().max().item()
                rec(b=b, bm=bm, bn=bn, warps=warps, splits=splits, us=round(tt.do_bench_cudagraph(fn, rep=100) * 1e3, 2), max_err=err)
            except Exception as e:
                rec(b=b, bm=bm, bn=bn, warps=warps, splits=splits, error=repr(e)[:200])
json.dump(out, open(sys.argv[1], "w"), indent=1)
