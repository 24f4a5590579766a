"""Each part's forward against transformers' Qwen3OmniMoe* on the same tiny random checkpoint
(fp32, CPU). Tolerance: max |ours - reference| <= 1e-4 * max |reference| (RTOL) unless stated."""

import pytest
import torch

from mstar.models.qwen3_omni.audio import output_lengths
from mstar.models.qwen3_omni.cache import NoCache
from mstar.models.qwen3_omni.layers import SparseMoe, grouped_mm_ok
from mstar.models.qwen3_omni.positions import mrope_positions

RTOL = 1e-4


def close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> None:
    assert ours.shape == ref.shape
    err, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol} x {scale:.3g}"


def multimodal_prompt(parts, n_audio_frames=437, grid=(1, 4, 6), text=(72, 105, 33)):
    """ids with one audio and one image (placeholders sized as the encoders make them)."""
    i = parts.cfg.ids
    rows_a = int(output_lengths(torch.tensor(n_audio_frames)))
    rows_i = grid[0] * grid[1] * grid[2] // 4
    ids = [i.im_start, i.user, 10, i.audio_start, *[i.audio] * rows_a, i.audio_start + 1, i.vision_start,
           *[i.image] * rows_i, i.vision_start + 1, *text, i.im_end, 10, i.im_start, i.assistant, 10]
    return ids, rows_a


def test_thinker_text_logits_and_captured_layer(parts, reference):
    ids = torch.randint(0, 256, (1, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = reference.thinker(input_ids=ids, output_hidden_states=True)
        pos, _ = mrope_positions(ids[0].tolist(), audio_id=-1, image_id=-2, video_id=-3)
        h, cap = parts.thinker(parts.thinker.embed(ids[0]), pos, NoCache(), capture=parts.cfg.accept_hidden_layer)
        close(parts.thinker.logits(h), ref.logits[0])
        close(cap, ref.hidden_states[parts.cfg.accept_hidden_layer][0])


def test_thinker_with_audio_and_image(parts, reference):
    """Encoders, placeholder merge, DeepStack and 3-D M-RoPE positions at once."""
    ids, _ = multimodal_prompt(parts)
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(parts.cfg.audio.num_mel_bins, 437, generator=g)
    grid = torch.tensor([[1, 4, 6]])
    px = torch.randn(24, 3 * 2 * 4 * 4, generator=g)
    with torch.no_grad():
        ref = reference.thinker(input_ids=torch.tensor([ids]), input_features=feats[None],
                                feature_attention_mask=torch.ones(1, 437, dtype=torch.long), pixel_values=px,
                                image_grid_thw=grid, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        i = parts.cfg.ids
        audio = parts.audio(feats, torch.tensor([437]))
        merged, deep = parts.vision(px, grid)
        ids_t = torch.tensor(ids)
        pos, delta = mrope_positions(ids, audio_id=i.audio, image_id=i.image, video_id=i.video,
                                     audio_rows=[audio.shape[0]], image_grids=[[1, 4, 6]])
        assert delta != 0  # the image's rows share positions: decoding continues past their max
        embeds = parts.thinker.prompt_embeds(ids_t, {i.audio: audio, i.image: merged})
        h, _ = parts.thinker(embeds, pos, NoCache(), deepstack=parts.thinker.deepstack_rows(ids_t, (i.image,), deep))
        close(parts.thinker.logits(h), ref.logits[0])


def test_audio_encoder(parts, reference):
    lens = torch.tensor([437, 150])  # several chunks and windows, a partial last chunk
    feats = torch.randn(parts.cfg.audio.num_mel_bins, int(lens.sum()), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = reference.thinker.model.audio_tower(feats, feature_lens=lens).last_hidden_state
        close(parts.audio(feats, lens), ref)


def test_vision_encoder(parts, reference):
    grid = torch.tensor([[1, 4, 6], [2, 2, 2]])  # an image and a two-frame clip
    px = torch.randn(32, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = reference.thinker.model.visual(px, grid_thw=grid)
        merged, deep = parts.vision(px, grid)
        close(merged, ref.pooler_output)
        close(deep[0], ref.deepstack_features[0])


@pytest.mark.parametrize("path", ["grouped_mm", "gather", "loop"])
def test_moe_paths_match_the_reference_block(parts, reference, path):
    """Every expert path (one grouped GEMM pair over tokens sorted by expert; gathered weights;
    a loop over the experts hit) equals transformers' MoE block (its per-expert loop)."""
    ours: SparseMoe = parts.thinker.model.layers[0].mlp
    if path == "grouped_mm" and not grouped_mm_ok(*ours.experts.down.shape[1:]):
        pytest.skip("this torch has no torch._grouped_mm")
    ref = reference.thinker.model.language_model.layers[0].mlp
    x = torch.randn(2, 7, parts.cfg.text.hidden_size, generator=torch.Generator().manual_seed(7))
    ours.path = path
    try:
        with torch.no_grad():
            close(ours(x.reshape(14, -1)), ref(x).reshape(14, -1))
    finally:
        ours.path = "auto"


def test_talker_codec_logits(parts, reference):
    x = torch.randn(1, 11, parts.cfg.talker.hidden_size, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = reference.talker(inputs_embeds=x, attention_mask=torch.ones(1, 11, dtype=torch.long))
        h = parts.talker(x[0], torch.arange(11).expand(3, -1), NoCache())
        close(parts.talker.codec_head(h), ref.logits[0])
        # the projections the prompt is made of
        t = torch.randn(5, parts.cfg.thinker_hidden_size, generator=torch.Generator().manual_seed(9))
        close(parts.talker.text_projection(t), reference.talker.text_projection(t))
        close(parts.talker.hidden_projection(t), reference.talker.hidden_projection(t))


def test_code_predictor_greedy(parts, reference):
    g = torch.Generator().manual_seed(10)
    hidden = torch.randn(3, parts.cfg.talker.hidden_size, generator=g)
    e0 = parts.talker.codec_embed(torch.randint(0, 64, (3,), generator=g))
    with torch.no_grad():
        ref = reference.talker.code_predictor.generate(inputs_embeds=torch.stack([hidden, e0], 1), do_sample=False,
                                                       max_new_tokens=parts.cfg.num_code_groups - 1)
        codes, total = parts.talker.code_predictor.predict(hidden, e0)
    assert torch.equal(codes, ref)
    emb = parts.talker.code_predictor.model.codec_embedding
    assert torch.allclose(total, sum(emb[j](codes[:, j]) for j in range(codes.shape[1])))


@pytest.mark.parametrize("chunk,left", [(300, 25), (10, 25), (7, 3)])
def test_code2wav_whole_and_chunked(parts, reference, chunk, left):
    """Whole and chunked decodes equal transformers'. The served stream (the runtime's chunker
    under LeftContext, and the default short first chunk and ramp) has every sample of the whole
    decode: each chunk starts where the one before it stopped, where ``chunked_decode`` (as
    transformers') drops each chunk's last samples; with the reference's 25 frames of context its
    samples equal the whole decode's."""
    from mstar.models.graph import LeftContext
    from mstar.models.qwen3_omni.direct import stream_decode
    from mstar.models.qwen3_omni.knobs import OmniServeConfig
    from mstar.models.qwen3_omni.model import codec_policy

    codes = torch.randint(0, 64, (1, 4, 47), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        whole = reference.code2wav(codes)
        close(parts.code2wav(codes), whole)
        ref = reference.code2wav.chunked_decode(codes, chunk_size=chunk, left_context_size=left)
        close(parts.code2wav.chunked_decode(codes, chunk, left), ref)
        for policy in (LeftContext(chunk, left), codec_policy(OmniServeConfig(code2wav_chunk_frames=chunk,
                                                                              code2wav_left_context_frames=left))):
            stream = stream_decode(parts.code2wav, codes[0].T, policy)
            assert stream.shape == whole[0, 0].shape, policy
            if left == 25:
                close(stream, whole[0, 0])


def test_code2wav_chunks_padded_to_a_graph_length_keep_their_samples(parts):
    """``ChunkGraphs`` right-pads a chunk's new frames to the next of 1, 2, 4, 8... or the full
    chunk (a stream's partial last chunk replays a full chunk's graph) and cuts the padding's
    samples: the decoder is causal, so the samples equal the unpadded decode's (here eager: no
    CUDA). Past ``max_shapes`` shapes a chunk decodes at its own length."""
    from mstar.models.qwen3_omni.code2wav import ChunkGraphs

    dec = parts.code2wav
    graphs = ChunkGraphs(dec, "cpu", chunk=10, max_shapes=4)
    assert graphs.sizes == [1, 2, 4, 8, 10] and [graphs.padded(n) for n in (1, 3, 5, 9, 10, 12)] == [1, 4, 8, 10, 10, 12]
    codes = torch.randint(0, 64, (2, 4, 35), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        for context, new in ((0, 4), (25, 3), (25, 9), (16, 10), (4, 5), (7, 2)):
            chunk = codes[..., : context + new]
            close(graphs.decode(chunk, context), dec.decode_chunk(chunk, context), rtol=1e-5)
    assert graphs.shapes == {(0, 4), (25, 4), (25, 10), (16, 10)}  # (4, 8) and (7, 2): past max_shapes
    assert sorted(graphs.loops) == [0, 16, 25]


def test_code2wav_warms_the_chunk_shapes_its_policy_cuts():
    """The shapes the Code2Wav node makes graphs for at start: each chunk of one stream as the
    runtime's chunker cuts it, with and without a short first chunk and its ramp."""
    from mstar.models.qwen3_omni.knobs import OmniServeConfig
    from mstar.models.qwen3_omni.model import codec_policy
    from mstar.models.qwen3_omni.nodes import chunk_shapes

    flat = codec_policy(OmniServeConfig(code2wav_first_chunk_frames=None))
    assert chunk_shapes(flat, 65) == [(0, 10), (10, 10), (20, 10), (25, 10), (25, 10), (25, 10)]
    ramp = codec_policy(OmniServeConfig())  # the default: a 4-frame first chunk, then the ramp
    assert chunk_shapes(ramp, 46) == [(0, 4), (4, 4), (8, 8), (16, 10), (25, 10), (25, 10)]


def test_thinker_with_image_and_video(parts, reference):
    """A video's temporal positions (seconds per temporal patch x position_id_per_seconds) and the
    joint DeepStack rows of an image and a video (prompt order)."""
    i = parts.cfg.ids
    g = torch.Generator().manual_seed(13)
    img_grid, vid_grid, seconds = [1, 4, 4], [2, 4, 6], [1.0]
    n_img, n_vid = 4, 2 * 2 * 3
    ids = [i.im_start, i.user, 10, i.vision_start, *[i.image] * n_img, i.vision_start + 1, i.vision_start,
           *[i.video] * n_vid, i.vision_start + 1, 72, 105, i.im_end, 10, i.im_start, i.assistant, 10]
    img_px = torch.randn(16, 96, generator=g)
    vid_px = torch.randn(48, 96, generator=g)
    with torch.no_grad():
        ref = reference.thinker(input_ids=torch.tensor([ids]), pixel_values=img_px, image_grid_thw=torch.tensor([img_grid]),
                                pixel_values_videos=vid_px, video_grid_thw=torch.tensor([vid_grid]),
                                video_second_per_grid=torch.tensor(seconds), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        merged, deep = parts.vision(torch.cat([img_px, vid_px]), torch.tensor([img_grid, vid_grid]))
        pos, _ = mrope_positions(ids, audio_id=i.audio, image_id=i.image, video_id=i.video, image_grids=[img_grid],
                                 video_grids=[vid_grid], video_seconds=seconds, per_second=parts.cfg.position_id_per_seconds)
        ids_t = torch.tensor(ids)
        embeds = parts.thinker.prompt_embeds(ids_t, {i.image: merged[:n_img], i.video: merged[n_img:]})
        h, _ = parts.thinker(embeds, pos, NoCache(), deepstack=parts.thinker.deepstack_rows(ids_t, (i.image, i.video), deep))
        close(parts.thinker.logits(h), ref.logits[0])


def test_code_predictor_sampling_is_seeded_per_row(parts):
    """Sampled rows repeat with their generator's seed whatever else shares the batch; greedy
    rows in the same batch stay greedy."""
    g = torch.Generator().manual_seed(14)
    hidden = torch.randn(3, parts.cfg.talker.hidden_size, generator=g)
    e0 = parts.talker.codec_embed(torch.randint(0, 64, (3,), generator=g))
    cp = parts.talker.code_predictor

    def seeded(s):
        return torch.Generator().manual_seed(s)

    with torch.no_grad():
        greedy, _ = cp.predict(hidden, e0)
        mixed, _ = cp.predict(hidden, e0, torch.tensor([True, False, False]), [None, seeded(1), seeded(2)])
        alone, _ = cp.predict(hidden[1:2], e0[1:2], torch.tensor([False]), [seeded(1)])
    assert torch.equal(mixed[0], greedy[0]) and torch.equal(mixed[1], alone[0])
