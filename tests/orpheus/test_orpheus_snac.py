"""Parity of our SNAC decoder with `snac` 1.2.1 on the same random weights, fp32.

Measured: bit-identical (max abs diff 0.0) with noise on and both sides seeded identically;
asserted with atol 1e-6.
"""

import json
import shutil

import pytest
import torch

from mstar.models.orpheus.snac import SnacDecoder, load_snac_decoder
from mstar.models.orpheus.snac_config import SnacConfig

ATOL = 1e-6


def random_codes(frames: int, batch: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4096, (batch, frames * m), generator=g) for m in (1, 2, 4)]


def seeded(fn, seed=7):
    torch.manual_seed(seed)
    return fn()


@pytest.fixture(scope="module")
def ours(reference_snac):
    return load_snac_decoder(reference_snac[1])


@pytest.mark.parametrize("frames,batch", [(1, 1), (7, 1), (3, 2)])
def test_decode_matches_snac_with_identically_seeded_noise(reference_snac, ours, frames, batch):
    ref, _ = reference_snac
    codes = random_codes(frames, batch, seed=frames)
    want = seeded(lambda: ref.decode(codes))
    got = seeded(lambda: ours.decode(codes))
    assert got.dtype == torch.float32 and got.shape == want.shape == (batch, 1, frames * 2048)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # The noise is real: a different seed gives a different waveform.
    assert (seeded(lambda: ours.decode(codes), seed=8) - want).abs().max() > 1e-3


def test_noise_off_matches_snac_with_identity_noise_blocks(reference_snac, ours, monkeypatch):
    import snac.layers

    ref, _ = reference_snac
    codes = random_codes(4, seed=3)
    monkeypatch.setattr(snac.layers.NoiseBlock, "forward", lambda self, x: x)
    torch.testing.assert_close(ours.decode(codes, noise=False), ref.decode(codes), atol=ATOL, rtol=0)


def test_generator_makes_decode_reproducible(ours):
    codes = random_codes(2)
    a = ours.decode(codes, generator=torch.Generator().manual_seed(1))
    b = ours.decode(codes, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)


def test_legacy_weight_g_weight_v_keys_load_identically(reference_snac, ours, tmp_path):
    _, directory = reference_snac
    state = torch.load(directory / "pytorch_model.bin", weights_only=True)
    legacy = {
        k.replace(".parametrizations.weight.original0", ".weight_g").replace(
            ".parametrizations.weight.original1", ".weight_v"
        ): v
        for k, v in state.items()
    }
    assert any(k.endswith(".weight_g") for k in legacy)
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    torch.save(legacy, tmp_path / "pytorch_model.bin")
    codes = random_codes(2)
    old = load_snac_decoder(tmp_path).decode(codes, noise=False)
    torch.testing.assert_close(old, ours.decode(codes, noise=False), atol=0, rtol=0)


def write_variant(src, dst, *, drop=None, config=None):
    state = torch.load(src / "pytorch_model.bin", weights_only=True)
    if drop:
        del state[drop]
    torch.save(state, dst / "pytorch_model.bin")
    cfg = json.loads((src / "config.json").read_text()) | (config or {})
    (dst / "config.json").write_text(json.dumps(cfg))


def test_missing_tensor_is_named(reference_snac, tmp_path):
    key = "decoder.model.3.block.1.parametrizations.weight.original1"
    write_variant(reference_snac[1], tmp_path, drop=key)
    with pytest.raises(KeyError, match=r"pytorch_model.bin: tensor '.*model.3.block.1.parametrizations"
                       r".weight.original0' has no partner '.*original1'"):
        load_snac_decoder(tmp_path)


def test_missing_decode_tensor_is_named(reference_snac, tmp_path):
    write_variant(reference_snac[1], tmp_path, drop="quantizer.quantizers.2.codebook.weight")
    with pytest.raises(KeyError, match="pytorch_model.bin: missing tensor 'quantizer.quantizers.2.codebook.weight'"):
        load_snac_decoder(tmp_path)


def test_shape_mismatch_is_named(reference_snac, tmp_path):
    write_variant(reference_snac[1], tmp_path, config={"codebook_dim": 4})
    with pytest.raises(ValueError, match=r"tensor 'quantizer.quantizers.0.codebook.weight' has shape "
                       r"\(4096, 8\), expected \(4096, 4\)"):
        load_snac_decoder(tmp_path)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_snac_decoder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"attn_window_size": None}))
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        load_snac_decoder(tmp_path)


def test_config_rejects_attention_and_unknown_keys():
    with pytest.raises(ValueError, match="attn_window_size=32.*not supported"):
        SnacConfig.from_dict({})  # snac's defaults: the 44 kHz model with local attention
    with pytest.raises(ValueError, match=r"unknown SNAC config keys \['decoder_dims'\]"):
        SnacConfig.from_dict({"attn_window_size": None, "decoder_dims": 8})
    with pytest.raises(ValueError, match=r"config.json: SNAC encoder_dim must be an integer, got '48'"):
        SnacConfig.from_dict({"attn_window_size": None, "encoder_dim": "48"}, source="config.json")
    cfg = SnacConfig.from_dict({"attn_window_size": None, "sampling_rate": 24000, "encoder_dim": 48,
                                "encoder_rates": [2, 4, 8, 8], "decoder_rates": [8, 8, 4, 2],
                                "decoder_dim": 1024, "vq_strides": [4, 2, 1]})
    assert (cfg.latent, cfg.upsampling, cfg.samples_per_frame) == (768, 512, 2048)


def test_decode_rejects_inconsistent_codes(ours):
    codes = random_codes(2)
    with pytest.raises(ValueError, match="code levels disagree"):
        ours.decode([codes[0], codes[1][:, :-1], codes[2]])
    with pytest.raises(ValueError, match=r"codes\[1\] has values in \[4096, 4096\], outside the codebook"):
        ours.decode([codes[0], torch.full_like(codes[1], 4096), codes[2]])
    with pytest.raises(ValueError, match="needs 3 code levels"):
        ours.decode(codes[:2])


def test_state_dict_names_are_snacs_folded_names(reference_snac):
    ref, _ = reference_snac
    snac_names = {
        k.replace(".parametrizations.weight.original0", ".weight")
        for k in ref.state_dict()
        if not k.endswith(".original1")
    }
    ours = SnacDecoder(SnacConfig.from_dict(json.loads((reference_snac[1] / "config.json").read_text())))
    assert set(ours.state_dict()) <= snac_names
    assert {k for k in snac_names if k.startswith("decoder.")} <= set(ours.state_dict())


def test_half_precision_decode_stays_close_to_the_float32_reference(reference_snac, ours):
    """snac_dtype bfloat16 (a serving knob for GPUs): same weights cast, noise off.
    Measured on this tiny random decoder: relative L2 error 2.4e-2; asserted < 5e-2."""
    codes = random_codes(4, batch=2, seed=5)
    want = ours.decode(codes, noise=False)
    half = load_snac_decoder(reference_snac[1], dtype=torch.bfloat16)
    got = half.decode(codes, noise=False)
    assert got.dtype == torch.bfloat16
    err = (got.float() - want).norm() / want.norm()
    assert err < 5e-2, err


def test_snac_dtype_auto_is_bfloat16_on_cuda_and_the_reference_float32_elsewhere():
    from mstar.models.orpheus.knobs import OrpheusConfig
    from mstar.models.orpheus.snac_node import snac_dtype

    assert OrpheusConfig.parse({}).snac_dtype == "auto"
    assert snac_dtype("auto", "cuda:1") == torch.bfloat16 and snac_dtype("auto", "cpu") == torch.float32
    assert snac_dtype("float16", "cuda") == torch.float16 and snac_dtype("float32", "cuda:0") == torch.float32


def test_snac_node_names_a_bad_dtype(reference_snac):
    from pathlib import Path

    from mstar.models.base import NodeContext
    from mstar.models.orpheus.snac_node import SnacNode

    with pytest.raises(ValueError, match="model_kwargs.snac_dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"):
        SnacNode(Path(reference_snac[1]), NodeContext("snac_decoder", "cpu", None, {"snac_dtype": "fp8"}))


def _stream_through_snac_node(node, codes, kwargs):
    """Codes through the served policy's chunker and the node, as the runtime feeds it: per-frame
    audio in emission order."""
    from mstar.models.base import NodeCall
    from mstar.models.chunker import Chunker
    from mstar.models.graph import SlidingWindow
    from mstar.models.orpheus.tokens import window_plan

    plan = window_plan(kwargs)
    chunker = Chunker(SlidingWindow(plan.window, plan.stride, first=plan.first))
    state, pieces, fired = {}, [], []
    chunks = []
    for i, c in enumerate(codes):
        for chunk in chunker.push(torch.tensor([c])):
            chunks.append(chunk)
            fired.append(i + 1)
    chunks += chunker.finish()
    for info, rows in chunks:
        (out,) = node.forward([NodeCall("r", "snac_chunk", -1, {"code": rows}, {}, state, info)])
        pieces.append(out["audio"])
    return torch.cat(pieces), fired


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("stride, fired, windows", [(1, [21, 28, 35, 42, 49, 56, 63, 70], 9), (3, [21, 42, 63], 4)])
def test_snac_node_streams_every_frame_first_at_21_codes(reference_snac, ours, device, stride, fired, windows):
    """The served stream: first audio once 21 codes exist (frame 0), then ``stride`` frames per
    7 * stride codes, the rest flushed at the end; every frame exactly once, in order, close to
    the whole decode. On CUDA the first and the full windows replay CUDA graphs: same audio as
    the eager decoder, noise off (asserted 1e-4 abs: graph replay and eager run the same kernels)."""
    from pathlib import Path

    from mstar.models.base import NodeContext
    from mstar.models.orpheus.snac_node import SnacNode

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    codes = torch.randint(0, 4096, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    kw = {"snac_noise": False, "snac_stride_frames": stride}
    node = SnacNode(Path(reference_snac[1]), NodeContext("snac_decoder", device, None, kw))
    replays0 = node.graphed.stats.graph_replays  # the captures at start replay once each
    audio, got_fired = _stream_through_snac_node(node, codes, kw)
    assert got_fired == fired
    assert audio.shape == (70 // 7 * 2048,)
    whole = ours.decode([lv.to(torch.int64) for lv in _levels(codes)], noise=False)[0, 0]
    frame0 = ours.decode([lv.to(torch.int64) for lv in _levels(codes[:21])], noise=False)[0, 0, :2048]
    torch.testing.assert_close(audio[:2048].cpu(), frame0, atol=1e-4, rtol=0)
    # every frame near the whole decode (the streaming bounds of test_orpheus_streaming)
    assert (audio.cpu() - whole).abs().max() <= 0.03
    if device == "cuda":
        # every window (first, full ones, the flush: full here) replayed a graph; nothing eager
        assert node.graphed.stats.graph_replays - replays0 == windows and node.eager.stats.calls == 0
        eager = SnacNode(Path(reference_snac[1]), NodeContext("snac_decoder", device, None,
                                                             {**kw, "snac_cuda_graphs": False}))
        torch.testing.assert_close(audio, _stream_through_snac_node(eager, codes, kw)[0], atol=1e-4, rtol=0)


def _levels(codes):
    from mstar.models.orpheus.tokens import snac_codes

    s = snac_codes(codes)
    return [torch.tensor([list(level)]) for level in (s.levels[0], s.levels[1], s.levels[2])]
