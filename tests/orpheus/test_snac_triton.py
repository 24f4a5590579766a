"""The fused channels-last SNAC decode (snac_triton.py, ``snac_kernels: triton``) against our
module decoder, which is bit-identical to `snac` 1.2.1 (test_orpheus_snac.py): same weights,
float32, noise on with the same seed and noise off. On a CPU the kernels run under Triton's
interpreter (larger time tiles there: fewer interpreted programs; one case keeps the GPU's).
Measured on CPU: max abs difference 3e-7 on outputs of magnitude ~0.5; asserted 1e-5."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels in numpy
pytest.importorskip("triton", reason="the fused SNAC decode needs the triton package (pip install triton)")

from mstar.models.base import NodeContext  # noqa: E402
from mstar.models.orpheus.snac import load_snac_decoder  # noqa: E402
from mstar.models.orpheus.snac_node import SnacNode, snac_kernels  # noqa: E402
from mstar.models.orpheus.snac_triton import SnacTritonDecoder  # noqa: E402

ATOL = 1e-5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def codes_for(frames: int, batch: int, seed: int = 0, device: str = DEVICE):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4096, (batch, frames * m), generator=g).to(device) for m in (1, 2, 4)]


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    """On a GPU both sides in true float32 (cuDNN's convolutions default to TF32)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module")
def module_decoder(reference_snac):
    return load_snac_decoder(reference_snac[1], device=DEVICE)


@pytest.mark.parametrize("frames, batch, block_t", [(1, 1, 64), (2, 2, 256), (3, 1, 512)])
def test_fused_decode_matches_the_module_decoder_with_the_same_noise(module_decoder, frames, batch, block_t):
    fused = SnacTritonDecoder(module_decoder, block_t=block_t if DEVICE == "cpu" else None)
    codes = codes_for(frames, batch, seed=frames)
    torch.manual_seed(5)
    want = module_decoder.decode(codes)
    torch.manual_seed(5)
    got = fused.decode(codes)
    assert got.shape == want.shape == (batch, 1, frames * 2048) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # the noise is drawn and added: without it the audio differs
    assert (fused.decode(codes, noise=False) - want).abs().max() > 1e-3


def test_fused_decode_without_noise_and_with_a_generator(module_decoder):
    fused = SnacTritonDecoder(module_decoder, block_t=256 if DEVICE == "cpu" else None)
    codes = codes_for(2, 1, seed=9)
    torch.testing.assert_close(fused.decode(codes, noise=False), module_decoder.decode(codes, noise=False), atol=ATOL, rtol=0)
    g = [torch.Generator(device=DEVICE).manual_seed(3) for _ in range(2)]
    torch.testing.assert_close(fused.decode(codes, generator=g[0]), module_decoder.decode(codes, generator=g[1]),
                               atol=ATOL, rtol=0)


def test_snac_kernels_knob():
    assert snac_kernels({}, "cpu") == "torch"  # auto: fused on CUDA only
    assert snac_kernels({"snac_kernels": "torch"}, "cuda:0") == "torch"
    if os.environ.get("TRITON_INTERPRET") == "1":  # this module runs the interpreter on CPU-only hosts
        assert snac_kernels({"snac_kernels": "triton"}, "cpu") == "triton"
    with pytest.raises(ValueError, match="model_kwargs.snac_kernels must be one of auto, triton, torch, got 'cuda'"):
        snac_kernels({"snac_kernels": "cuda"}, "cpu")


def test_snac_kernels_triton_on_a_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="snac_kernels is triton but the device is cpu"):
        snac_kernels({"snac_kernels": "triton"}, "cpu")


def test_snac_kernels_without_triton(monkeypatch, caplog):
    """auto falls back to the module decoder with a warning naming why; triton refuses."""
    import mstar.services.engines.cuda_graphs as cg

    monkeypatch.setattr(cg, "triton_unavailable_reason", lambda: "triton does not import (test)")
    with caplog.at_level("WARNING"):
        assert snac_kernels({}, "cuda:0") == "torch"
    assert "triton does not import (test)" in caplog.text
    with pytest.raises(ValueError, match=r"snac_kernels is triton but triton does not import \(test\)"):
        snac_kernels({"snac_kernels": "triton"}, "cuda:0")


def test_the_fused_decoder_needs_a_depthwise_snac(module_decoder):
    import dataclasses

    from mstar.models.orpheus.snac import SnacDecoder

    cfg = dataclasses.replace(module_decoder.config, depthwise=False)
    with pytest.raises(ValueError, match="depthwise"):
        SnacTritonDecoder(SnacDecoder(cfg))


def test_snac_node_decodes_with_the_fused_kernels(reference_snac, module_decoder, monkeypatch):
    """The node with ``snac_kernels: triton`` serves a first window (21 codes) through the fused
    decoder: the same frame 0 as the module decoder's node."""
    import mstar.models.orpheus.snac_triton as st
    from mstar.models.base import ChunkInfo, NodeCall

    if DEVICE == "cpu":
        monkeypatch.setattr(st, "BLOCK_T", 512)
    codes = torch.randint(0, 4096, (21,), generator=torch.Generator().manual_seed(4))
    out = {}
    for kernels in ("triton", "torch"):
        node = SnacNode(Path(reference_snac[1]), NodeContext("snac_decoder", DEVICE, None,
                                                             {"snac_kernels": kernels, "snac_noise": False}))
        assert (node.fused is not None) == (kernels == "triton")
        (res,) = node.forward([NodeCall("r", "snac_chunk", -1, {"code": codes}, {}, {}, ChunkInfo(0, 0, 0, False))])
        out[kernels] = res["audio"]
    assert out["triton"].shape == (2048,)
    torch.testing.assert_close(out["triton"], out["torch"], atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_full_size_fused_decode_on_cuda(tmp_path):
    """hubertsiuzdak/snac_24khz's shapes (random weights), batch 4 windows of 5 frames: float32
    fused vs the float32 module decoder (relative L2 < 1e-4), bfloat16 fused (the serving dtype)
    vs float32 (< 5e-2; the bfloat16 module decoder measures 2.4e-2)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from mstar.models.orpheus.demo_checkpoint import write_random_snac
    from mstar.models.orpheus.snac_config import SnacConfig

    cfg = SnacConfig(sampling_rate=24000, encoder_dim=48, encoder_rates=(2, 4, 8, 8), decoder_dim=1024,
                     decoder_rates=(8, 8, 4, 2), attn_window_size=None, codebook_size=4096, codebook_dim=8,
                     vq_strides=(4, 2, 1), noise=True, depthwise=True)
    write_random_snac(tmp_path, cfg)
    ref = load_snac_decoder(tmp_path, device="cuda")
    codes = codes_for(5, 4, seed=1, device="cuda")
    want = ref.decode(codes, noise=False).float()
    for dtype, bound in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        got = SnacTritonDecoder(load_snac_decoder(tmp_path, device="cuda", dtype=dtype)).decode(codes, noise=False).float()
        err = ((got - want).norm() / want.norm()).item()
        assert err < bound, (dtype, err)
