"""The action expert's joint-attention kernels (models/pi05/attn_triton.py) against ``layers.attend``
over the concatenated keys: on a CPU through Triton's interpreter in fp32 (atol 1e-5), on a GPU in
bf16 (atol 2e-2). Masked prefix keys, a whole masked split, one split and several, batch rows with
different masks, strided inputs (as the model passes them)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels in numpy
pytest.importorskip("triton", reason="the joint-attention kernels need the triton package")

from mstar.models.pi05 import attn_triton  # noqa: E402
from mstar.models.pi05.layers import additive_mask, attend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE, ATOL = (torch.bfloat16, 2e-2) if DEVICE == "cuda" else (torch.float32, 1e-5)


def case(b, heads, t, p, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    # q as the model makes it: a [B, T, H, D] tensor seen as [B, H, T, D]
    q = torch.randn(b, t, heads, d, generator=g).transpose(1, 2)
    kv = torch.randn(b, 3, 2, 1, p, d, generator=g)  # the prefix K / V of 3 layers: layer 1's is strided
    own = torch.randn(b, t, 3, 1, d, generator=g)  # k and v as slices of one qkv output
    valid = torch.rand(b, p, generator=g) < 0.7
    valid[:, 0] = True
    if p >= 192:
        valid[0, 128:256] = False  # a whole split of keys masked (at p = 300: splits of 128 keys)
    to = lambda x: x.to(DEVICE, DTYPE)  # noqa: E731
    return to(q), to(kv[:, 1, 0, 0]), to(kv[:, 1, 1, 0]), to(own[:, :, 1, 0]), to(own[:, :, 2, 0]), valid.to(DEVICE)


def reference(q, pk, pv, ok, ov, valid):
    b, t = ok.shape[:2]
    keys, values = torch.cat([pk, ok], 1)[:, None], torch.cat([pv, ov], 1)[:, None]
    allowed = torch.cat([valid, torch.ones(b, t, dtype=torch.bool, device=valid.device)], 1)
    return attend(q.float(), keys.float(), values.float(), additive_mask(allowed[:, None, None, :], torch.float32))


@pytest.mark.parametrize("b,p", [(1, 300), (2, 200), (3, 40)])
def test_joint_attention_matches_attend(b, p):
    args = case(b, heads=8, t=10, p=p, d=16, seed=p)
    got = attn_triton.joint_attention(*args)
    assert got.shape == (b, 10, 8 * 16) and got.dtype == DTYPE
    torch.testing.assert_close(got.float(), reference(*args), atol=ATOL, rtol=0)


@pytest.mark.skipif(DEVICE != "cuda", reason="the real shapes' tiles (head_dim 256) need a GPU's shared memory")
def test_the_real_shapes():
    args = case(1, heads=8, t=50, p=968, d=256)
    torch.testing.assert_close(attn_triton.joint_attention(*args).float(), reference(*args), atol=ATOL, rtol=0)


def test_one_split_and_many_agree(monkeypatch):
    args = case(1, heads=8, t=10, p=300, d=16, seed=7)
    monkeypatch.setattr(attn_triton, "TARGET_PROGRAMS", 1)  # one split: the split kernel writes the output
    assert attn_triton.splits_for(1, 2, 300) == 1
    one = attn_triton.joint_attention(*args)
    monkeypatch.setattr(attn_triton, "TARGET_PROGRAMS", 264)
    assert attn_triton.splits_for(1, 2, 300) > 1
    many = attn_triton.joint_attention(*args)
    torch.testing.assert_close(one.float(), many.float(), atol=ATOL, rtol=0)
    torch.testing.assert_close(one.float(), reference(*args), atol=ATOL, rtol=0)


def test_rejects_a_strided_last_dim():
    q, pk, pv, ok, ov, valid = case(1, heads=8, t=10, p=40, d=16)
    with pytest.raises(ValueError, match="prefix_k"):
        attn_triton.joint_attention(q, pk.transpose(1, 2).contiguous().transpose(1, 2), pv, ok, ov, valid)


def test_the_expert_step_with_the_kernels_equals_attend():
    """The kernels as the expert calls them (q, k, v from its fused qkv; the prefix K / V of a layer)."""
    from mstar.models.pi05.config import tiny_config
    from mstar.models.pi05.weights import random_policy

    cfg = tiny_config()
    policy = random_policy(cfg, DEVICE, DTYPE)
    g = torch.Generator().manual_seed(3)
    cams, n = len(cfg.cameras), cfg.max_token_len
    image_mask = torch.tensor([[True, False, True], [True, True, True]])
    token_mask = torch.arange(n)[None] < torch.tensor([[9], [n]])
    kv, valid = policy.prefix(torch.randn(2, cams * cfg.vision.tokens, cfg.prefix.width, generator=g).to(DEVICE, DTYPE),
                              image_mask.to(DEVICE), torch.randint(4, cfg.vocab, (2, n), generator=g).to(DEVICE),
                              token_mask.to(DEVICE))
    x = torch.randn(2, cfg.action_horizon, cfg.action_dim, generator=g).to(DEVICE)
    policy.expert.attention_kernel = attn_triton.joint_attention
    with torch.no_grad():
        fused = policy.expert.step(x, kv, valid, 3)
        policy.expert.attention_kernel = None
        plain = policy.expert.step(x, kv, valid, 3)
    torch.testing.assert_close(fused, plain, atol=ATOL * 10, rtol=0)
