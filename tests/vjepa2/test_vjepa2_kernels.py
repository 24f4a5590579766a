"""How the blocks run on a GPU (``compile_blocks``): the first half's Triton kernel that splits and
rotates q / k / v (under the interpreter on a CPU, compiled for sm_90 without a GPU), the second
half under torch.compile (traced whole, compiled once for every block of a network and every batch
size past one); and the ``attention`` knob's kernels. The compiled runs here use dynamo with the
eager backend (the same ops): what inductor makes of them is measured on a GPU by
``bench/vjepa2/bench_vjepa2.py``."""

import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.testing import CompileCounter

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: rope_triton runs in numpy

from mstar.models.vjepa2 import rope, weights
from mstar.models.vjepa2.knobs import VJepa2Settings
from mstar.models.vjepa2.modules import attention_kernel, compile_blocks, sdpa, warm_compiled


@pytest.fixture(scope="module")
def nets(hf_model):
    enc, pred, _ = weights.build(weights.read(hf_model[1]))
    return enc, pred


def test_compiled_halves_trace_once_for_every_block(nets):
    pytest.importorskip("triton", reason="rope_triton needs the triton package")
    enc, pred = nets
    g = torch.Generator().manual_seed(0)
    clips = [torch.randn(b, 3, 4, 16, 16, generator=g) for b in (2, 3, 5)]
    ids = torch.arange(32).repeat(2, 1)
    with torch.no_grad():
        want = [enc(c) for c in clips]
        want_pred = pred(want[0], ids, ids)
    counter = CompileCounter()
    try:
        compile_blocks(enc, counter)
        compile_blocks(pred, counter)
        with torch.no_grad():
            got = [enc(c) for c in clips]
            assert counter.frame_count == 1  # the second half, for both blocks and every batch size
            got_pred = pred(got[0], ids, ids)  # another width: one more entry
            assert counter.frame_count == 2
    finally:
        compile_blocks(enc, None)
        compile_blocks(pred, None)
    for a, b in zip(got, want, strict=True):  # fp32: the fused RoPE rounds once where eager rounds thrice
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_pred, want_pred, atol=1e-5, rtol=0)


def test_attention_kernels(nets):
    enc, _ = nets
    clip = torch.randn(2, 3, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = enc(clip)
        try:
            enc.attend = attention_kernel("sdpa:math")
            torch.testing.assert_close(enc(clip), want, atol=1e-6, rtol=0)
        finally:
            enc.attend = sdpa
    assert attention_kernel(None) is sdpa and attention_kernel("sdpa") is sdpa
    with pytest.raises(ValueError, match="SDPA kernels are cudnn, flash"):
        attention_kernel("sdpa:cudnn,fast")
    with pytest.raises(ValueError, match="attention must be sdpa"):
        attention_kernel("fa3")


@pytest.mark.parametrize("spec,ok", [("sdpa", True), ("sdpa:cudnn,flash,efficient", True), ("sdpa:flash", True),
                                     ("sdpa:", False), ("cudnn,flash", False), ("fa3", False), ("sdpa ", False)])
def test_attention_knob(spec, ok):
    if ok:
        assert VJepa2Settings(attention=spec).attention == spec
    else:
        with pytest.raises(ValueError, match="attention"):
            VJepa2Settings(attention=spec)


@pytest.mark.parametrize("tables", ["shared", "per_row"])
def test_qkv_rope_kernel_matches_the_expression(tables):
    """One kernel for split + RoPE (GPU: rope_triton's reason) gives ``rope.apply`` on each part:
    fp32 here, so only rounding order differs."""
    pytest.importorskip("triton", reason="rope_triton needs the triton package")
    from mstar.models.vjepa2.rope_triton import qkv_rope

    B, N, H, hd = 2, 40, 3, 16
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(B, N, 3 * H * hd, generator=g)
    if tables == "shared":
        cos, sin = (t.unsqueeze(1) for t in rope.tables(hd, *rope.grid_positions(torch.arange(N), 4, 10)))
    else:  # a table row per token (the masked predictor, several rollouts in one batch)
        cos, sin = torch.randn(B, N, 1, hd, generator=g), torch.randn(B, N, 1, hd, generator=g)
    q, k, v = qkv_rope(qkv, cos, sin, H)
    want = qkv.view(B, N, 3, H, hd).unbind(2)
    torch.testing.assert_close(q, rope.apply(want[0], cos, sin), atol=1e-5, rtol=0)
    torch.testing.assert_close(k, rope.apply(want[1], cos, sin), atol=1e-5, rtol=0)
    assert torch.equal(v, want[2])
    # k and v straight into a cache's slots: [rows, heads, capacity, hd] seen as [rows, N, heads, hd]
    cache = torch.zeros(2, B, H, 3 * N, hd)
    slots = tuple(cache[i, :, :, N:2 * N].transpose(1, 2) for i in range(2))
    _, k2, v2 = qkv_rope(qkv, cos, sin, H, kv_out=slots)
    assert k2 is slots[0] and v2 is slots[1]
    torch.testing.assert_close(cache[0, :, :, N:2 * N], k.transpose(1, 2), atol=0, rtol=0)
    assert torch.equal(cache[1, :, :, N:2 * N], v.transpose(1, 2))
    assert not cache[:, :, :, :N].any() and not cache[:, :, :, 2 * N:].any()
    with pytest.raises(ValueError, match="RoPE tables of 7 rows for 80 tokens"):
        qkv_rope(qkv, cos.reshape(-1, hd)[:7], sin.reshape(-1, hd)[:7], H)
    with pytest.raises(ValueError, match="qkv_rope needs dense"):
        qkv_rope(qkv[:, ::2], cos, sin, H)
    with pytest.raises(ValueError, match="kv_out must be two"):
        qkv_rope(qkv, cos, sin, H, kv_out=(slots[0], slots[1][:1]))


def test_qkv_rope_kernel_compiles_for_hopper():
    """The interpreter accepts Python the GPU compiler does not (a loop over a tuple of pointers
    did): compile the kernel for sm_90, no GPU needed (Triton's bundled ptxas), in a process of its
    own (this one may run the interpreter); with aligned arguments every access is a vector one."""
    pytest.importorskip("triton", reason="rope_triton needs the triton package")
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mstar.models.vjepa2.rope_triton import BLOCK_C, BLOCK_T, _qkv_rope_kernel
names = ("qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_ptr", "v_ptr", "T", "R", "N", "kv_sb", "kv_sn", "kv_sh")
sig = {**dict.fromkeys(names[:6], "*bf16"), **dict.fromkeys(names[6:], "i32"),
       **dict.fromkeys(("C", "HD", "BLOCK_T", "BLOCK_C"), "constexpr")}
attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(names))}  # as the launcher specialises aligned args
src = ASTSource(fn=_qkv_rope_kernel, signature=sig, constexprs={"C": 1408, "HD": 64, "BLOCK_T": BLOCK_T, "BLOCK_C": BLOCK_C},
                attrs=attrs)
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
assert "ld.global.b16" not in ptx and "st.global.b16" not in ptx, "scalar loads or stores"
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_rollout_with_the_fused_first_half(ac_checkpoint):
    """The AC predictor with ``qkv_rope`` writing K/V straight into the rollout's cache (one rollout)
    and through the copy (two rollouts at different frames in one step) predicts what the eager
    blocks predict (fp32, the interpreter)."""
    pytest.importorskip("triton", reason="rope_triton needs the triton package")
    from mstar.models.vjepa2 import rollout

    loaded = weights.read(ac_checkpoint)
    pred = weights.build(loaded)[2]
    enc = loaded.config.encoder
    g = torch.Generator().manual_seed(4)
    ctx = rollout.normalize(torch.randn(2, 2, enc.tokens_per_tubelet, enc.dim, generator=g))
    acts, states = torch.randn(2, 4, 7, generator=g) * 0.05, torch.randn(2, 2, 7, generator=g) * 0.3

    def both():
        one = rollout.rollout(pred, ctx, acts, states)
        a = rollout.start(pred, ctx[:1], acts[:1], states[:1], 3)  # two rollouts, one a frame ahead
        b = rollout.start(pred, ctx[1:, :1], acts[1:], states[1:, :1], 4)
        rollout.advance(pred, b, acts[1:, 0])
        two = rollout.advance_many(pred, [a, b], [acts[:1, 1], acts[1:, 1]])
        return one, two

    with torch.no_grad():
        want = both()
        try:
            compile_blocks(pred, "eager")
            got = both()
        finally:
            compile_blocks(pred, None)
    for w, o in zip(torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got), strict=True):
        torch.testing.assert_close(o, w, atol=1e-5, rtol=0)


def test_warmed_networks_compile_nothing_when_served(nets, ac_checkpoint):
    """After ``warm_compiled`` (a node group's start) clips of other sizes, another predictor split,
    rollouts of several rows and two rollouts at different frames in one step compile nothing."""
    pytest.importorskip("triton", reason="rope_triton needs the triton package")
    from mstar.models.vjepa2 import rollout

    enc, pred = nets
    loaded = weights.read(ac_checkpoint)
    ac = weights.build(loaded)[2]
    counter = CompileCounter()
    try:
        for m in (enc, pred, ac):
            compile_blocks(m, counter)
        warm_compiled(enc, pred, ac)
        warmed = counter.frame_count
        assert warmed >= 2
        g = torch.Generator().manual_seed(8)
        P, E = loaded.config.encoder.tokens_per_tubelet, loaded.config.encoder.dim
        with torch.inference_mode():
            tokens = enc(torch.randn(3, 3, 4, 16, 16, generator=g))
            pred(tokens[:, :20], torch.arange(20).expand(3, -1), torch.arange(20, 32).expand(3, -1))
            ctx = rollout.normalize(torch.randn(3, 1, P, E, generator=g))
            rollout.rollout(ac, ctx, torch.randn(3, 3, 7, generator=g) * 0.05, torch.zeros(3, 1, 7))
            a = rollout.start(ac, ctx[:1], torch.zeros(1, 2, 7), torch.zeros(1, 1, 7), 2)
            b = rollout.start(ac, ctx[1:], torch.zeros(2, 3, 7), torch.zeros(2, 1, 7), 3)
            rollout.advance(ac, b, torch.zeros(2, 7))
            rollout.advance_many(ac, [a, b], [torch.zeros(1, 7), torch.zeros(2, 7)])
        assert counter.frame_count == warmed
    finally:
        for m in (enc, pred, ac):
            compile_blocks(m, None)


@pytest.mark.parametrize("device,flag,on", [("cpu", None, False), ("cpu", True, False), ("cuda:0", None, True),
                                           ("cuda:1", True, True), ("cuda:0", False, False)])
def test_the_compile_knob(device, flag, on):
    """``model_kwargs.compile`` (``NodeContext.compile``): on by default on a GPU, never on a CPU."""
    from mstar.models.base import NodeContext

    kwargs = {} if flag is None else {"compile": flag}
    assert NodeContext("n", device, None, kwargs).compile is on
