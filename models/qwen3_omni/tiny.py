"""A tiny random Qwen3-Omni in the real checkpoint layout (demo mode and tests), written with
transformers' ``Qwen3OmniMoeForConditionalGeneration`` (``pip install transformers``), plus a
byte-level tokenizer whose special tokens sit at the tiny config's ids.

Shapes are tiny, structure is not: MoE layers and a dense one in the Thinker, the audio tower with
its real windowing (n_window 50), a vision tower with a DeepStack merger, a Talker with shared
experts and 4 code groups, a Code2Wav with sliding-window attention and the causal conv stack.
Weights the reference initialises to constants (norms, layer scales, Snake alphas/betas, ConvNeXt
gammas) are randomised too, so a loader that skipped one would not match.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

# text ids: 0..255 bytes, then the specials in this order
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|audio_pad|>", "<|image_pad|>", "<|video_pad|>", "<|tts_pad|>", "<|tts_bos|>",
            "<|tts_eos|>", "<|endoftext|>")
ROLES = ("system", "user", "assistant")  # single tokens, as in Qwen's vocabulary
TEXT_VOCAB = 320
SPECIAL_ID = {name: 256 + i for i, name in enumerate(SPECIALS)}
ROLE_ID = {name: 256 + len(SPECIALS) + i for i, name in enumerate(ROLES)}
CODEBOOK = 64
TALKER_VOCAB = CODEBOOK + 1024  # the reference suppresses the top 1024 ids but codec_eos
SPEAKERS = {"ethan": 1070, "chelsie": 1071, "aiden": 1072}


def tiny_config() -> dict[str, Any]:
    s, r = SPECIAL_ID, ROLE_ID
    mm = dict(audio_token_id=s["<|audio_pad|>"], image_token_id=s["<|image_pad|>"], video_token_id=s["<|video_pad|>"],
              audio_start_token_id=s["<|audio_start|>"], vision_start_token_id=s["<|vision_start|>"])
    return dict(
        thinker_config=dict(
            text_config=dict(vocab_size=TEXT_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                             num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], initializer_range=0.1,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                              "interleaved": True}),
            audio_config=dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                              d_model=32, output_dim=64, n_window=50, n_window_infer=200, downsample_hidden_size=8,
                              max_source_positions=64, initializer_range=0.1),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4,
                               spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                               num_position_embeddings=16, deepstack_visual_indexes=[0], initializer_range=0.1),
            user_token_id=r["user"], initializer_range=0.1, **mm),
        talker_config=dict(
            text_config=dict(vocab_size=TALKER_VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                             shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                             initializer_range=0.1,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                              "interleaved": True}),
            code_predictor_config=dict(vocab_size=CODEBOOK, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_code_groups=4,
                                       initializer_range=0.1),
            num_code_groups=4, spatial_merge_size=2, thinker_hidden_size=64, accept_hidden_layer=2,
            codec_pad_id=1064, codec_bos_id=1065, codec_eos_token_id=1066, codec_nothink_id=1067,
            codec_think_bos_id=1068, codec_think_eos_id=1069, speaker_id=dict(SPEAKERS), initializer_range=0.1, **mm),
        code2wav_config=dict(codebook_size=CODEBOOK, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, sliding_window=8, intermediate_size=64, num_quantizers=4,
                             upsample_rates=[4, 2], upsampling_ratios=[2, 2], decoder_dim=32, initializer_range=0.1),
        im_start_token_id=s["<|im_start|>"], im_end_token_id=s["<|im_end|>"], tts_pad_token_id=s["<|tts_pad|>"],
        tts_bos_token_id=s["<|tts_bos|>"], tts_eos_token_id=s["<|tts_eos|>"], system_token_id=r["system"],
        user_token_id=r["user"], assistant_token_id=r["assistant"])


def _known_rope_keys(record: logging.LogRecord) -> bool:
    """transformers' Talker text config, unlike its Thinker's, does not list ``mrope_section`` and
    ``interleaved`` among the rope keys it expects, though the released checkpoint's Talker has both
    and its model reads them: building the config would warn "Unrecognized keys in
    `rope_parameters`" at every --random-weights start. Only that warning is dropped."""
    msg = record.getMessage()
    return not (msg.startswith("Unrecognized keys in `rope_parameters`") and "mrope_section" in msg)


def build_reference(seed: int = 0):
    """transformers' model on the tiny config, constants randomised (eval mode, fp32)."""
    import torch
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    torch.manual_seed(seed)
    rope_log = logging.getLogger("transformers.modeling_rope_utils")
    rope_log.addFilter(_known_rope_keys)
    try:
        config = Qwen3OmniMoeConfig(**tiny_config())
    finally:
        rope_log.removeFilter(_known_rope_keys)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("talker.") and ".experts." in name:  # left uninitialised by transformers
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.numel() > 1 and bool((p == p.reshape(-1)[0]).all()):
                if name.endswith((".alpha", ".beta")):  # Snake: exp() of these
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(0.5 + torch.rand(p.shape, generator=g))
        last = model.code2wav.decoder[-1].conv  # keep the waveform inside [-1, 1] (clamped there)
        last.weight.mul_(0.02)
        last.bias.zero_()
    return model


def build_tokenizer(special_ids: dict[str, int] | None = None, role_ids: dict[str, int] | None = None):
    """Byte-level (one id per UTF-8 byte, no merges), specials and role words at the given ids
    (default: the tiny config's; the benchmark passes the released checkpoint's)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from mstar.models.orpheus.demo_tokenizer import _byte_alphabet

    special_ids = special_ids or SPECIAL_ID
    role_ids = role_ids or ROLE_ID
    vocab = {ch: b for b, ch in enumerate(_byte_alphabet())}
    first = min(special_ids.values())
    vocab |= {name: i for name, i in role_ids.items() if i < first}
    taken = set(vocab.values())
    vocab |= {f"<|unused_{i}|>": i for i in range(256, first) if i not in taken}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    by_id = {i: n for n, i in special_ids.items()}
    names = [by_id.get(i, f"<|special_{i}|>") for i in range(first, max(special_ids.values()) + 1)]
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    tok.add_tokens([AddedToken(n, normalized=False, single_word=True) for n, i in role_ids.items() if i >= first])
    for name, i in {**special_ids, **role_ids}.items():
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"demo tokenizer: {name} got id {tok.token_to_id(name)}, expected {i}")
    return tok


def write_tiny_checkpoint(directory: str | Path, seed: int = 0) -> Path:
    """The tiny model, its tokenizer.json and a generation_config in ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_reference(seed).save_pretrained(directory)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tiny.json").write_text(json.dumps({"seed": seed, "note": "random demo weights"}))
    return directory
