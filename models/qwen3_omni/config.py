"""Qwen3-Omni's shapes and token ids, read once from the checkpoint's ``config.json``.

Names follow transformers' ``Qwen3OmniMoe*Config``. Both spellings of the rotary settings are read:
``rope_parameters`` (what transformers 5 writes) and ``rope_theta`` + ``rope_scaling`` (what the
released ``Qwen/Qwen3-Omni-30B-A3B-Instruct`` holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _rope(cfg: dict[str, Any], default_theta: float) -> tuple[float, tuple[int, ...]]:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", default_theta))
    section = params.get("mrope_section", scaling.get("mrope_section", (24, 20, 20)))
    return float(theta), tuple(int(s) for s in section)


@dataclass(frozen=True)
class DecoderConfig:
    """A Qwen3-style decoder: the Thinker's text model, the Talker's, the code predictor's."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # the Talker's MoE has a gated shared expert
    max_position_embeddings: int = 32768

    @classmethod
    def parse(cls, c: dict[str, Any], default_theta: float = 1_000_000.0) -> DecoderConfig:
        theta, section = _rope(c, default_theta)
        heads = int(c.get("num_attention_heads", 16))
        hidden = int(c["hidden_size"])
        return cls(
            vocab_size=int(c["vocab_size"]), hidden_size=hidden, num_layers=int(c["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads), intermediate_size=int(c.get("intermediate_size", 0)),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=theta, mrope_section=section,
            num_experts=int(c.get("num_experts") or c.get("num_local_experts") or 0), num_experts_per_tok=int(c.get("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(c.get("moe_intermediate_size", 0) or 0),
            norm_topk_prob=bool(c.get("norm_topk_prob", True)), decoder_sparse_step=int(c.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(c.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=int(c.get("shared_expert_intermediate_size", 0) or 0),
            max_position_embeddings=int(c.get("max_position_embeddings", 32768)))

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class AudioConfig:
    num_mel_bins: int
    d_model: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    output_dim: int
    n_window: int
    n_window_infer: int
    downsample_hidden_size: int
    max_source_positions: int

    @classmethod
    def parse(cls, c: dict[str, Any]) -> AudioConfig:
        return cls(int(c.get("num_mel_bins", 128)), int(c.get("d_model", 1280)), int(c.get("encoder_layers", 32)),
                   int(c.get("encoder_attention_heads", 20)), int(c.get("encoder_ffn_dim", 5120)),
                   int(c.get("output_dim", 3584)), int(c.get("n_window", 50)), int(c.get("n_window_infer", 800)),
                   int(c.get("downsample_hidden_size", 480)), int(c.get("max_source_positions", 1500)))


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    rope_theta: float

    @classmethod
    def parse(cls, c: dict[str, Any]) -> VisionConfig:
        theta, _ = _rope(c, 10000.0)
        return cls(int(c.get("depth", 27)), int(c.get("hidden_size", 1152)), int(c.get("intermediate_size", 4304)),
                   int(c.get("num_heads", 16)), int(c.get("in_channels", 3)), int(c.get("patch_size", 16)),
                   int(c.get("temporal_patch_size", 2)), int(c.get("spatial_merge_size", 2)),
                   int(c.get("out_hidden_size", 3584)), int(c.get("num_position_embeddings", 2304)),
                   tuple(c.get("deepstack_visual_indexes", (8, 16, 24))), theta)


@dataclass(frozen=True)
class Code2WavConfig:
    codebook_size: int
    num_quantizers: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    sliding_window: int
    rms_norm_eps: float
    rope_theta: float
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    decoder_dim: int

    @classmethod
    def parse(cls, c: dict[str, Any]) -> Code2WavConfig:
        theta, _ = _rope(c, 10000.0)
        heads = int(c.get("num_attention_heads", 16))
        hidden = int(c.get("hidden_size", 1024))
        return cls(int(c.get("codebook_size", 2048)), int(c.get("num_quantizers", 16)), hidden,
                   int(c.get("num_hidden_layers", 8)), heads, int(c.get("num_key_value_heads") or heads),
                   int(c.get("head_dim") or hidden // heads), int(c.get("intermediate_size", 3072)),
                   int(c.get("sliding_window", 72)), float(c.get("rms_norm_eps", 1e-5)), theta,
                   tuple(c.get("upsample_rates", (8, 5, 4, 3))), tuple(c.get("upsampling_ratios", (2, 2))),
                   int(c.get("decoder_dim", 1536)))

    @property
    def samples_per_frame(self) -> int:
        n = 1
        for r in self.upsample_rates + self.upsampling_ratios:
            n *= r
        return n


@dataclass(frozen=True)
class TokenIds:
    """Every special id the prompt format, the placeholders and the Talker use."""

    im_start: int
    im_end: int
    system: int
    user: int
    assistant: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    audio: int
    image: int
    video: int
    audio_start: int
    vision_start: int
    # the Talker's codec vocabulary
    codec_pad: int
    codec_bos: int
    codec_eos: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int


@dataclass(frozen=True)
class OmniConfig:
    text: DecoderConfig
    audio: AudioConfig
    vision: VisionConfig
    talker: DecoderConfig
    code_predictor: DecoderConfig
    code2wav: Code2WavConfig
    ids: TokenIds
    num_code_groups: int
    accept_hidden_layer: int
    thinker_hidden_size: int
    position_id_per_seconds: int
    talker_position_id_per_seconds: int
    speakers: dict[str, int] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, c: dict[str, Any]) -> OmniConfig:
        th, tk = c["thinker_config"], c["talker_config"]
        ids = TokenIds(
            im_start=int(c.get("im_start_token_id", 151644)), im_end=int(c.get("im_end_token_id", 151645)),
            system=int(c.get("system_token_id", 8948)), user=int(c.get("user_token_id", 872)),
            assistant=int(c.get("assistant_token_id", 77091)), tts_pad=int(c.get("tts_pad_token_id", 151671)),
            tts_bos=int(c.get("tts_bos_token_id", 151672)), tts_eos=int(c.get("tts_eos_token_id", 151673)),
            audio=int(th.get("audio_token_id", 151646)), image=int(th.get("image_token_id", 151655)),
            video=int(th.get("video_token_id", 151656)), audio_start=int(th.get("audio_start_token_id", 151647)),
            vision_start=int(th.get("vision_start_token_id", 151652)),
            codec_pad=int(tk.get("codec_pad_id", 4196)), codec_bos=int(tk.get("codec_bos_id", 4197)),
            codec_eos=int(tk.get("codec_eos_token_id", 4198)), codec_nothink=int(tk.get("codec_nothink_id", 4203)),
            codec_think_bos=int(tk.get("codec_think_bos_id", 4204)),
            codec_think_eos=int(tk.get("codec_think_eos_id", 4205)))
        return cls(
            text=DecoderConfig.parse(th["text_config"]), audio=AudioConfig.parse(th.get("audio_config") or {}),
            vision=VisionConfig.parse(th.get("vision_config") or {}), talker=DecoderConfig.parse(tk["text_config"]),
            code_predictor=DecoderConfig.parse(tk["code_predictor_config"], default_theta=10000.0),
            code2wav=Code2WavConfig.parse(c.get("code2wav_config") or {}), ids=ids,
            num_code_groups=int(tk.get("num_code_groups", 32)), accept_hidden_layer=int(tk.get("accept_hidden_layer", 18)),
            thinker_hidden_size=int(tk.get("thinker_hidden_size", 2048)),
            position_id_per_seconds=int(th.get("position_id_per_seconds", 25)),
            talker_position_id_per_seconds=int(tk.get("position_id_per_seconds", 25)),
            speakers={str(k).lower(): int(v) for k, v in (tk.get("speaker_id") or {}).items()}, raw=c)
