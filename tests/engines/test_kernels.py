"""The kernel-set choice and the parts of the fused path that are plain torch (CPU).

The FlashInfer kernels themselves are checked against the torch reference in test_gpu.py."""

import pytest
import torch
from engine_helpers import make_engine

from mstar.services.engines import ForwardItem
from mstar.services.engines.kernels import (
    TORCH_OPS,
    TorchOps,
    _store_kv_fused,
    _store_kv_ref,
    make_ops,
    rms_norm_ref,
    rotate_half,
)


def test_auto_is_the_torch_reference_on_cpu_and_fused_kinds_say_why_not():
    assert make_ops("auto", "cpu", torch.float32) is TORCH_OPS
    with pytest.raises(ValueError, match="kernels='flashinfer' unavailable: device is cpu, not CUDA"):
        make_ops("flashinfer", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="Unknown kernels 'triton'. Known: auto, torch, flashinfer"):
        make_ops("triton", "cpu", torch.float32)


@pytest.mark.parametrize("n", [1, 5])
def test_one_scatter_kv_store_matches_the_reference(n):
    """K and V as views into one fused qkv output go to the cache in one scatter."""
    g = torch.Generator().manual_seed(n)
    hq, hkv, d, pages, page = 6, 2, 8, 5, 4
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g)
    _q, k, v = (t.view(n, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    slots = torch.randperm(pages * page, generator=g)[:n]
    want = torch.randn(2, pages, page, hkv, d, generator=g)
    got = want.clone()
    _store_kv_ref(want, slots, k, v)
    _store_kv_fused(got, slots, k, v)
    assert torch.equal(got, want)
    k2, v2 = k.contiguous(), v.contiguous()  # not adjacent: falls back to two copies
    _store_kv_fused(got, slots, v2, k2)
    _store_kv_ref(want, slots, v2, k2)
    assert torch.equal(got, want)


class InPlaceOps(TorchOps):
    """FlashInfer's contract in plain torch: norms and RoPE overwrite their inputs, RoPE reads
    the cos/sin table, K/V go to the cache in one scatter."""

    name, in_place, position_table = "in-place", True, True

    def add_rms_norm(self, x, residual, weight, eps):
        residual.add_(x)
        x.copy_(rms_norm_ref(residual, weight, eps))
        return x, residual

    def rope(self, rope, q, k, positions):
        cos, sin = rope.cos_sin_cache(q.device)[positions].chunk(2, dim=-1)
        cos, sin = torch.cat((cos, cos), -1)[:, None, :], torch.cat((sin, sin), -1)[:, None, :]
        for t in (q, k):
            t.copy_(t * cos + rotate_half(t) * sin)
        return q, k

    def store_kv(self, kv_layer, slots, k, v):
        _store_kv_fused(kv_layer, slots, k, v)


def test_in_place_kernel_contract_gives_the_reference_results(tiny_model, monkeypatch):
    """The layers' plumbing for in-place kernels (residual stream, RoPE inside the fused qkv
    output, one-scatter K/V store) computes exactly what the reference does, and leaves the
    caller's embeddings alone."""
    import mstar.services.engines.kv_engine as kv_engine

    ref = make_engine(tiny_model)
    monkeypatch.setattr(kv_engine, "make_ops", lambda *a: InPlaceOps())
    eng = make_engine(tiny_model)
    assert eng.runner.ops.name == "in-place" and eng.runner.max_position == 2048
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, tiny_model.config.hidden_size, generator=g)
    x0 = x.clone()
    logits = {}
    for e in (ref, eng):
        outs = [e.forward([ForwardItem("a", token_ids=torch.tensor([3, 1, 4, 1, 5])), ForwardItem("b", embeds=x)])]
        for t in (9, 2, 6):  # decode steps over the cached prefixes
            outs.append(e.forward([ForwardItem("a", token_ids=torch.tensor([t])),
                                   ForwardItem("b", token_ids=torch.tensor([t + 1]))]))
        logits[e] = [e.logits(h) for o in outs for h in o]
    for got, want in zip(logits[eng], logits[ref], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(x, x0)
    with pytest.raises(ValueError, match="position 2048 is past max_position_embeddings=2048"):
        eng.forward([ForwardItem("c", token_ids=torch.tensor([1]), positions=torch.tensor([2048]))])
