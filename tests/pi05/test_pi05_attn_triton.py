"""The expert's Triton attention (models/pi05/attn_triton.py: RoPE on load, prefix cache read in place,
key splits merged) against the torch path it replaces on GPUs (``rope`` + concatenation + ``attend``):
on a CPU through Triton's interpreter in fp32 (atol 1e-5); on a GPU in bf16 (max error within 2x the
torch bf16 path's own error against fp32 on the same inputs)."""

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels in numpy
pytest.importorskip("triton", reason="the expert's attention kernel needs the triton package")

from mstar.models.pi05 import attn_triton  # noqa: E402
from mstar.models.pi05.layers import additive_mask, attend, rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(b, t, h, hkv, d, p, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, t, h + 2 * hkv, d, generator=g).to(DEVICE, dtype)  # the projection's layout: q, k, v heads side by side
    q, k, v = qkv.split([h, hkv, hkv], dim=2)
    angles = torch.rand(b, t, d // 2, generator=g) * 6.0
    cos, sin = (torch.cat([f(angles)] * 2, -1)[:, :, None].to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    q, k = rope(q, cos, sin), rope(k, cos, sin)  # as the expert hands them over
    prefix = torch.randn(b, 2, hkv, p, d, generator=g).to(DEVICE, dtype)  # [B, K / V, Hkv, P, D]: a layer's cache
    valid = torch.rand(b, p, generator=g) > 0.3
    valid[:, 0] = True
    return q, k, v, prefix[:, 0], prefix[:, 1], valid.to(DEVICE)


def _torch_path(q, k, v, pk, pv, valid):
    """velocity_core's torch attention: prefix + own keys concatenated, masked attend."""
    b, t = q.shape[:2]
    keys, values = torch.cat([pk, k.transpose(1, 2)], dim=2), torch.cat([pv, v.transpose(1, 2)], dim=2)
    allowed = torch.cat([valid, valid.new_ones(b, t)], dim=1)
    return attend(q, keys, values, additive_mask(allowed[:, None, None, :], q.dtype))


@pytest.mark.parametrize("shape,kw", [
    ((2, 5, 8, 1, 16, 37), {}),  # one split
    ((2, 5, 8, 1, 16, 37), {"splits": 3, "block_n": 16, "block_m": 16}),  # splits, a key block across prefix / own
    ((1, 7, 8, 2, 32, 50), {"splits": 2, "block_n": 16, "block_m": 16}),  # two KV heads of 4 query heads each
    ((3, 4, 8, 1, 16, 20), {"splits": 8, "block_n": 16, "block_m": 32}),  # more splits than key blocks: trimmed
])
def test_matches_the_torch_path(shape, kw):
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    args = _case(*shape, dtype=dtype)
    got = attn_triton.attention(*args, **kw)
    want = _torch_path(*args)
    assert got.shape == want.shape == (shape[0], shape[1], shape[2] * shape[4])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # bf16: no further from fp32 than the torch bf16 path, within a factor 2
        ref = _torch_path(*(a.float() if a.is_floating_point() else a for a in args))  # the same bf16 inputs
        assert (got.float() - ref).abs().max() <= 2 * (want.float() - ref).abs().max() + 1e-3


def test_padded_prefix_keys_change_nothing():
    """A prefix key marked invalid is not attended to, whatever its values."""
    q, k, v, pk, pv, valid = _case(1, 4, 8, 1, 16, 24, dtype=torch.float32 if DEVICE == "cpu" else torch.bfloat16)
    valid[:, 10:] = False
    base = attn_triton.attention(q, k, v, pk, pv, valid, splits=2, block_n=16, block_m=16)
    pk2, pv2 = pk.clone(), pv.clone()
    pk2[:, :, 10:], pv2[:, :, 10:] = 1e3, -1e3
    torch.testing.assert_close(attn_triton.attention(q, k, v, pk2, pv2, valid, splits=2, block_n=16, block_m=16),
                               base, atol=0, rtol=0)


def test_bad_shapes_are_named():
    q, k, v, pk, pv, valid = _case(1, 4, 8, 1, 16, 24)
    with pytest.raises(ValueError, match="attention shapes"):
        attn_triton.attention(q, k[:, :3], v, pk, pv, valid)


@pytest.mark.skipif(DEVICE != "cuda", reason="the expert takes the kernel on GPUs only (CPUs run the torch path)")
def test_expert_velocity_with_the_kernel_equals_the_torch_path():
    """A whole Euler step of a tiny bf16 expert, eager and under torch.compile (the op opaque to it),
    with the kernel against the torch attention."""
    from mstar.models.pi05.config import tiny_config
    from mstar.models.pi05.weights import random_policy
    from mstar.services.engines.layers import fuse_projections

    cfg = tiny_config()
    e = cfg.expert
    expert = random_policy(cfg, DEVICE, torch.bfloat16).expert
    ref_expert = fuse_projections(copy.deepcopy(expert).float())  # the same bf16 weights, in fp32
    b, p = 2, 40
    x = torch.randn(b, cfg.action_horizon, cfg.action_dim, device=DEVICE)
    kv = torch.randn(b, e.depth, 2, e.kv_heads, p, e.head_dim, device=DEVICE, dtype=torch.bfloat16)
    valid = torch.rand(b, p, device=DEVICE) > 0.2
    with torch.no_grad():
        ref = ref_expert.velocity(x, kv.float(), valid, 3)
        expert.fused_attention = False
        want = expert.velocity(x, kv, valid, 3)
        expert.fused_attention = True
        got = expert.velocity(x, kv, valid, 3)
        expert.compile(dynamic=False)
        compiled = expert.velocity(x, kv, valid, 3)
    bound = 2 * (want - ref).abs().max() + 1e-2
    assert (got - ref).abs().max() <= bound
    assert (compiled - ref).abs().max() <= bound
