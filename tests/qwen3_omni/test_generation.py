"""A whole greedy text+speech request on our engines (no runtime) against transformers'
``Qwen3OmniMoeForConditionalGeneration.generate`` on the same tiny checkpoint (fp32, CPU):
the Thinker's tokens and the Talker's codes (all code groups) equal, the waveform within 1e-4 of
its peak."""

import pytest
import torch
from test_parts import close, multimodal_prompt

from mstar.models.qwen3_omni.direct import generate
from mstar.models.qwen3_omni.prompt import MediaTokens, build_prompt


def reference_generate(reference, ids, **kw):
    """(thinker tokens after the prompt, codes [frames, groups], waveform) from transformers."""
    seen = {}
    decode = reference.code2wav.chunked_decode

    def grab(codes, **k):
        seen["codes"] = codes
        return decode(codes, **k)

    reference.code2wav.chunked_decode = grab
    try:
        with torch.no_grad():
            seq, wav = reference.generate(input_ids=torch.tensor([ids]), speaker="ethan", thinker_do_sample=False,
                                          talker_do_sample=False, **kw)
    finally:
        reference.code2wav.chunked_decode = decode
    return seq[0, len(ids):].tolist(), seen["codes"][0].T, wav.reshape(-1)


@pytest.mark.parametrize("max_tokens,frames", [(20, 40), (4, 24)])
def test_text_prompt(parts, reference, tokenizer, max_tokens, frames):
    """(4, 24): the text ends early, the Talker goes on with <|tts_pad|> rows after <|tts_eos|>."""
    i = parts.cfg.ids
    ids = build_prompt(lambda s: tokenizer.encode(s, add_special_tokens=False).ids, i, MediaTokens(-1, -1),
                       "Hello there, how are you?", system="Be brief.")
    tokens, codes, wav = reference_generate(reference, ids, thinker_max_new_tokens=max_tokens, talker_max_new_tokens=frames,
                                            thinker_eos_token_id=i.im_end)
    ours = generate(parts, ids, max_tokens=max_tokens, talker_max_tokens=frames)
    assert ours.tokens == tokens
    assert codes.shape[0] > 0 and torch.equal(ours.codes, codes)
    close(ours.audio, wav)


@pytest.mark.parametrize("media", ["audio", "image"])
def test_media_prompt(parts, reference, media):
    """Media in the user turn: the Talker's prompt reads their Thinker states (hidden_projection);
    with an image its M-RoPE positions are 3-D. (Audio and image together go through the Thinker in
    test_parts; transformers' Talker cannot take both: its get_rope_index reads a talker
    ``audio_config`` that does not exist.)"""
    i = parts.cfg.ids
    ids, _ = multimodal_prompt(parts)
    if media == "audio":  # drop the image's placeholders
        ids = [t for t in ids if t not in (i.vision_start, i.image, i.vision_start + 1)]
    else:
        ids = [t for t in ids if t not in (i.audio_start, i.audio, i.audio_start + 1)]
    g = torch.Generator().manual_seed(12)
    feats = torch.randn(parts.cfg.audio.num_mel_bins, 437, generator=g)
    grid = torch.tensor([[1, 4, 6]])
    px = torch.randn(24, 3 * 2 * 4 * 4, generator=g)
    kw = dict(input_features=feats[None], feature_attention_mask=torch.ones(1, 437, dtype=torch.long)) if media == "audio" \
        else dict(pixel_values=px, image_grid_thw=grid)
    tokens, codes, wav = reference_generate(reference, ids, thinker_max_new_tokens=12, talker_max_new_tokens=24,
                                            thinker_eos_token_id=i.im_end,
                                            attention_mask=torch.ones(1, len(ids), dtype=torch.long), **kw)
    with torch.no_grad():
        if media == "audio":
            audio = parts.audio(feats, torch.tensor([437]))
            mine = dict(audio_embeds=audio, audio_rows=[audio.shape[0]])
        else:
            merged, deep = parts.vision(px, grid)
            mine = dict(image_embeds=merged, deepstack=deep, image_grids=[[1, 4, 6]])
    ours = generate(parts, ids, max_tokens=12, talker_max_tokens=24, **mine)
    assert ours.tokens == tokens
    assert torch.equal(ours.codes, codes)
    close(ours.audio, wav)
