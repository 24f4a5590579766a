"""Decode steps without RMSNorm kernels (``ForwardContext.fused_norms``): the norm weights folded
into the projections, each row's 1/rms applied by the fused decode kernel and the SiLU·mul
kernel, residual adds inside the o_proj / down GEMMs. On a CPU the Triton kernels run under the
interpreter in fp32 (atol 1e-4 on O(1) values); the GPU path is covered in test_gpu.py."""

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels in numpy
pytest.importorskip("triton", reason="the fused-norm kernels need the triton package (pip install triton)")

from engine_helpers import PAGE_SIZE, make_engine, tiny_hf_llama  # noqa: E402
from test_attn_triton import PS, _case, _reference  # noqa: E402

from mstar.services.engines import EngineConfig, ForwardItem, LlamaForCausalLM  # noqa: E402
from mstar.services.engines.attention import HeadShape  # noqa: E402
from mstar.services.engines.attn_triton import TritonGraphDecode  # noqa: E402
from mstar.services.engines.batch import SeqSlice, build_step_inputs  # noqa: E402
from mstar.services.engines.gemm_triton import MAX_ROWS, linear, linear_add_  # noqa: E402
from mstar.services.engines.kernels import TORCH_OPS, rms_scale_ref  # noqa: E402
from mstar.services.engines.layers import ForwardContext, RotaryEmbedding  # noqa: E402
from mstar.services.engines.rowscale_triton import silu_mul_rowscale, silu_mul_rowscale_ref  # noqa: E402

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test; test_gpu.py covers CUDA")


@CPU_ONLY
@pytest.mark.parametrize("n,inter,hidden", [(1, 64, 48), (5, 1500, 96), (3, 2048, 64)])  # partial blocks, odd widths
def test_silu_mul_rowscale_matches_the_reference(n, inter, hidden):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 2 * inter, generator=g) * 3
    src = torch.randn(n, hidden, generator=g) * 5  # far from unit RMS, so a missing scale shows
    want = silu_mul_rowscale_ref(x, src, 1e-5)
    torch.testing.assert_close(silu_mul_rowscale(x, src, 1e-5), want, atol=1e-5, rtol=1e-5)
    # = SiLU·mul of the rows scaled first, which is what the GEMM of normalised rows would give
    r = rms_scale_ref(src, 1e-5)
    gate, up = (r * x).chunk(2, dim=-1)
    torch.testing.assert_close(want, torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)


@CPU_ONLY
def test_silu_mul_rowscale_refuses_mismatched_rows():
    with pytest.raises(ValueError, match="dense rows"):
        silu_mul_rowscale(torch.zeros(3, 8), torch.zeros(2, 4), 1e-5)


@CPU_ONLY
@pytest.mark.parametrize("splits", [1, 4])
def test_fused_decode_scales_q_k_v_by_each_rows_rms(splits):
    """q, k, v of row b computed from un-normalised x[b] and scaled in the kernel equal the
    reference fed the scaled q, k, v (the new K in the cache included)."""
    heads = HeadShape(6, 2, 16)
    kv_lens = [1, 3, PS + 1, 70]
    kv, batch, q, k, v, positions, slots = _case(kv_lens, heads, "cpu", torch.float32, seed=5)
    x = torch.randn(len(kv_lens), 40, generator=torch.Generator().manual_seed(1)) * 4
    r = rms_scale_ref(x, 1e-6)
    rope = RotaryEmbedding(heads.head_dim, 10000.0, max_positions=128)
    want, want_kv = _reference(kv, batch, q * r[:, :, None], k * r[:, :, None], v * r[:, :, None],
                               positions, slots, rope, heads)
    dec = TritonGraphDecode(heads, torch.device("cpu"), torch.float32, PS, len(kv_lens), kv.shape[1])
    dec.block_n = 16
    dec.set_splits(splits)
    dec.min_split_tokens = 0
    dec.plan(batch)
    got_kv = kv.clone()
    got = dec.run_rope_store(q, k, v, positions, slots, got_kv, rope.cos_sin_cache(torch.device("cpu")),
                             row_rms=(x, 1e-6))
    torch.testing.assert_close(got_kv, want_kv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="row_rms"):
        dec.run_rope_store(q, k, v, positions, slots, got_kv, rope.cos_sin_cache(torch.device("cpu")),
                           row_rms=(x[:2], 1e-6))


def test_folding_the_norms_keeps_the_model_s_outputs(tiny_model):
    """fold_norms moves the norm weights into qkv / gate_up: the eager forward is unchanged."""
    folded = copy.deepcopy(tiny_model)
    assert folded.fused_norms_unavailable_reason() is not None and "fold_norms" in folded.fused_norms_unavailable_reason()
    folded.fold_norms()
    folded.fold_norms()  # idempotent
    assert folded.norms_folded and folded.fused_norms_unavailable_reason() is None
    layer = folded.model.layers[0]
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    assert not torch.equal(layer.self_attn.qkv_proj.weight, tiny_model.model.layers[0].self_attn.qkv_proj.weight)
    items = [ForwardItem("a", token_ids=torch.arange(3, 12))]
    want = make_engine(tiny_model).forward(items)[0]
    torch.testing.assert_close(make_engine(folded).forward(items)[0], want, atol=1e-5, rtol=1e-5)


@CPU_ONLY
def test_a_decode_step_without_norm_kernels_matches_the_reference(tiny_model):
    """Prefill three sequences, then one decode row each: the folded model with fused norms
    (Triton decode kernel + row-scaled SiLU·mul, residual in place) vs the original model on the
    torch path, same cache, same slots."""
    folded = copy.deepcopy(tiny_model)
    folded.fold_norms()
    eng = make_engine(tiny_model)
    gen = torch.Generator().manual_seed(2)
    seqs = {f"r{i}": torch.randint(0, 256, (n,), generator=gen) for i, n in enumerate((5, 9, 2))}
    eng.forward([ForwardItem(rid, token_ids=ids) for rid, ids in seqs.items()])
    cache = eng.cache
    slices = []
    for rid, ids in seqs.items():
        cache.reserve(rid, "main", len(ids) + 1)
        slices.append(SeqSlice(rid, "main", len(ids), 1))
    inputs = build_step_inputs(cache, slices)
    ids = torch.tensor([7, 100, 255])
    eng.runner.backend.plan(inputs.attn)
    ref_ctx = ForwardContext(eng.runner.backend, cache.kv, inputs.attn.slots, TORCH_OPS)
    want = tiny_model(tiny_model.embed(ids), inputs.positions, ref_ctx)
    want_kv = cache.kv.clone()
    with pytest.raises(ValueError, match="row scales"):  # only the fused decode backend applies them
        x = folded.embed(ids)
        folded.model.layers[0].self_attn.attend(x, inputs.positions, ref_ctx, row_rms=(x, 1e-5))
    dec = TritonGraphDecode(tiny_model.config.heads, torch.device("cpu"), torch.float32, PAGE_SIZE, 3,
                            cache.allocator.num_pages)
    dec.plan(inputs.attn)
    for model, fused, down, proj in ((folded, True, False, False), (folded, True, True, False),
                                     (folded, True, True, True), (folded, False, False, False),
                                     (tiny_model, False, False, False)):
        ctx = ForwardContext(dec, cache.kv, inputs.attn.slots, TORCH_OPS, fused_norms=fused, triton_down=down,
                             triton_proj=proj)
        got = model(model.embed(ids), inputs.positions, ctx)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cache.kv, want_kv, atol=1e-5, rtol=1e-5)


@CPU_ONLY
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (5, 70, 300), (16, 32, 256), (MAX_ROWS, 100, 520)])
def test_triton_down_projection_adds_x_w_t_into_h(m, n, k):
    """Partial column / K blocks and every row tile (16, 32): h + x @ w.T in fp32 (atol 1e-4
    on O(10) sums), in place."""
    g = torch.Generator().manual_seed(m)
    h, x, w = torch.randn(m, n, generator=g), torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.2
    want = h + x @ w.T
    got = linear_add_(h, x, w)
    assert got is h
    torch.testing.assert_close(h, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(linear(x, w), x @ w.T, atol=1e-4, rtol=1e-4)  # the same kernel without the add


@CPU_ONLY
def test_triton_down_projection_refuses_what_it_cannot_run():
    h, x, w = torch.zeros(4, 8), torch.zeros(4, 16), torch.zeros(8, 16)
    with pytest.raises(ValueError, match="at most 32 rows"):
        linear_add_(torch.zeros(33, 8), torch.zeros(33, 16), w)
    with pytest.raises(ValueError, match="unit inner strides"):
        linear_add_(h, x, torch.zeros(16, 8).t())  # column-major w
    with pytest.raises(ValueError, match="one dtype"):
        linear_add_(h, x.double(), w)
    with pytest.raises(ValueError, match=r"h \[M, N\]"):
        linear_add_(torch.zeros(4, 9), x, w)


def test_fused_norms_are_refused_where_they_do_not_apply(tmp_path):
    with pytest.raises(ValueError, match="fused_norms"):
        EngineConfig(fused_norms="yes")
    with pytest.raises(ValueError, match="down_gemm"):
        EngineConfig(down_gemm="cutlass")
    with pytest.raises(ValueError, match="EngineConfig.pdl: 'yes' is not one of auto, on, off"):
        EngineConfig(pdl="yes")
    with pytest.raises(ValueError, match="EngineConfig.proj_gemm: 'cutlass' is not one of auto, triton, cublas"):
        EngineConfig(proj_gemm="cutlass")
    with pytest.raises(ValueError, match="EngineConfig.prefill_attention: 'fa4' is not one of fa2, fa3, auto"):
        EngineConfig(prefill_attention="fa4")
    torch.manual_seed(0)
    tiny_hf_llama(attention_bias=True).save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    model.fold_norms()  # folding is still exact with biases; the fused path is not
    assert "bias" in model.fused_norms_unavailable_reason()


def test_programmatic_dependent_launch_says_why_not_off_an_sm90_gpu():
    from mstar.services.engines import pdl

    assert pdl.pdl_unavailable_reason(torch.device("cpu")) == "device is cpu, not CUDA"
    assert pdl.launch_options(False) == {}  # an ordinary launch passes nothing (the interpreter has no such option)
    assert pdl.launch_options(True) == {"launch_pdl": True}
    with pytest.raises(AttributeError, match="no attribute 'gdc_nothing'"):
        pdl.gdc_nothing  # noqa: B018


def test_fused_norms_are_refused_under_tensor_parallelism():
    """o_proj / down all-reduce their partial sums before the residual add, which the fused path
    does inside the GEMM: a layer built with a tensor-parallel rank (size 2) says so."""
    from types import SimpleNamespace

    from mstar.services.engines.layers import (
        DecoderLayer,
        GatedMLP,
        PagedAttention,
        fused_norms_unavailable_reason,
    )

    tp = SimpleNamespace(size=2, rank=0)  # only its size is read at construction
    heads = HeadShape(2, 1, 16)
    rope = RotaryEmbedding(16, 10000.0, max_positions=64)
    for attn_tp, mlp_tp in ((tp, None), (None, tp)):
        layer = DecoderLayer(PagedAttention(0, 32, heads, rope, tp=attn_tp), GatedMLP(32, 64, tp=mlp_tp), 32, 1e-5)
        assert "tensor parallel" in fused_norms_unavailable_reason(layer, folded=True)
        assert "fold_norms" in fused_norms_unavailable_reason(layer, folded=False)
    plain = DecoderLayer(PagedAttention(0, 32, heads, rope), GatedMLP(32, 64), 32, 1e-5)
    assert fused_norms_unavailable_reason(plain, folded=True) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_norm_kernels_on_gpu_in_bf16():
    """bf16 on the device vs the fp32 reference from the same bf16 inputs (relative error 1e-2)."""
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(16, 2 * 8192, device=dev, generator=g) * 3).to(bf)
    src = (torch.randn(16, 3072, device=dev, generator=g) * 5).to(bf)
    got, want = silu_mul_rowscale(x, src, 1e-5).float(), silu_mul_rowscale_ref(x.float(), src.float(), 1e-5)
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    heads = HeadShape(24, 8, 128)
    kv_lens = [1, 17, 300, 1000]
    kv, batch, q, k, v, positions, slots = _case(kv_lens, heads, dev, bf, seed=3)
    xs = (torch.randn(len(kv_lens), 3072, device=dev, generator=g) * 4).to(bf)
    r = rms_scale_ref(xs, 1e-5)
    rope = RotaryEmbedding(128, 500000.0, max_positions=4096).to(dev)
    want, want_kv = _reference(kv, batch, (q.float() * r[:, :, None]).to(bf), (k.float() * r[:, :, None]).to(bf),
                               (v.float() * r[:, :, None]).to(bf), positions, slots, rope, heads)
    dec = TritonGraphDecode(heads, dev, bf, PS, len(kv_lens), kv.shape[1])
    dec.plan(batch)
    got_kv = kv.clone()
    got = dec.run_rope_store(q, k, v, positions, slots, got_kv, rope.cos_sin_cache(dev), row_rms=(xs, 1e-5)).float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    assert ((got_kv.float() - want_kv.float()).norm() / want_kv.float().norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16, 24, 32])
def test_triton_down_projection_on_gpu_matches_addmm(m):
    """bf16 at the Llama-3.2-3B down shape against cuBLAS' h.addmm_(x, w.t()) (the graphs'
    alternative): relative error 1e-2 against the fp32 sum, and no worse than cuBLAS' own."""
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(m)
    h = (torch.randn(m, 3072, device=dev, generator=g) * 4).to(bf)
    x = torch.randn(m, 8192, device=dev, generator=g).to(bf)
    w = (torch.randn(3072, 8192, device=dev, generator=g) * 0.02).to(bf)
    exact = h.float() + x.float() @ w.float().T
    cublas = h.clone().addmm_(x, w.t()).float()
    got = linear_add_(h.clone(), x, w).float()
    err, err_cublas = ((got - exact).norm() / exact.norm()).item(), ((cublas - exact).norm() / exact.norm()).item()
    assert err < 1e-2 and err <= 1.2 * err_cublas + 1e-6, (err, err_cublas)
