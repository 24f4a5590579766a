"""Qwen3-Omni's knobs, typed: the placement YAML's ``model_kwargs`` (``OmniServeConfig``) and a
request's ``model_kwargs`` (``OmniRequest``). Imports no torch (the gateway reads these)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mstar.models.knobs import Knobs

DEFAULT_CHECKPOINT = "Qwen/Qwen3-Omni-30B-A3B-Instruct"
MAX_TEXT_TOKENS = 8192
MAX_AUDIO_FRAMES = 8192  # 12.5 frames a second: ~11 minutes
Modalities = Literal["text", "audio"]


class OmniServeConfig(Knobs):
    """``model_kwargs`` of a Qwen3-Omni placement YAML."""

    checkpoint: str = Field(DEFAULT_CHECKPOINT, description="the checkpoint (repo id in the caches, or a directory)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="auto: bfloat16 on CUDA, float32 on a CPU")
    max_num_seqs: int = Field(32, ge=1, le=1024, description="sequences the Thinker and the Talker each hold at once")
    max_prefill_tokens: int = Field(8192, ge=1, description="prompt tokens the Thinker prefills in one step")
    cuda_graphs: bool = Field(True, description="the Thinker's and the Talker's decode steps and the code "
                              "predictor's frame replay CUDA graphs (on CUDA)")
    compile: bool | None = Field(None, description="the Thinker's and the Talker's layers under torch.compile around "
                                 "their GEMMs and attention, compiled at start (default: on a GPU; never on a CPU)")
    code2wav_chunk_frames: int = Field(10, ge=1, le=300, description="new codec frames per Code2Wav decode "
                                       "(12.5 a second); the reference decodes 300 at a time")
    code2wav_left_context_frames: int = Field(25, ge=0, le=300, description="earlier frames decoded as context "
                                              "(the reference's 25)")
    code2wav_first_chunk_frames: int | None = Field(4, ge=1, le=300, description="frames of the first decode "
                                                    "(fewer: earlier first audio; 4 frames are 0.32 s of audio); "
                                                    "None: code2wav_chunk_frames")
    code2wav_ramp: bool = Field(True, description="after a shorter first chunk, each chunk brings at most as many "
                                "new frames as all before it (4, 4, 8, then code2wav_chunk_frames): no silence "
                                "between chunks while the speech is made faster than real time")
    talker_gather_ms: float = Field(5.0, ge=0, le=100, description="a Talker step waits up to this long for the "
                                    "next rows of its other running streams (their last frames are being routed), "
                                    "so that they join it instead of making a step of their own; 0: step at once")
    talker_max_ahead: int = Field(16, ge=1, le=4096, description="Thinker tokens the Talker may lag behind "
                                  "before the Thinker waits (back-pressure)")
    max_audio_seconds: float = Field(300.0, gt=0, le=3600, description="longest audio input")
    max_video_seconds: float = Field(120.0, gt=0, le=3600, description="longest video input (sampled at 2 fps)")
    max_image_pixels: int = Field(1280 * 28 * 28 * 4, ge=1, description="largest image input, in pixels after resizing")
    max_file_bytes: int = Field(64 << 20, ge=1, description="largest media file")

    RENAMED = {"max_seq_len": "set max_seq_len at the top level of the placement YAML"}


class OmniRequest(Knobs):
    """A request's ``model_kwargs`` for Qwen3-Omni."""

    modalities: list[Modalities] = Field(["text", "audio"],
                                         description='what to answer with: ["text"] or ["text", "audio"]')
    voice: str = Field("ethan", min_length=1, max_length=64, description="the speaker (one of the checkpoint's)")
    system: str | None = Field(None, max_length=32768, description="a system message")
    max_tokens: int = Field(512, ge=1, le=MAX_TEXT_TOKENS, description="text tokens at most")
    temperature: float = Field(0.7, ge=0, le=2, description="the Thinker's temperature (0: greedy)")
    top_p: float = Field(0.8, gt=0, le=1, description="the Thinker's nucleus sampling")
    top_k: int = Field(20, ge=0, le=1000, description="the Thinker's top-k (0: off)")
    max_audio_frames: int = Field(2048, ge=1, le=MAX_AUDIO_FRAMES, description="codec frames at most (12.5 a second)")
    talker_temperature: float = Field(0.9, ge=0, le=2, description="the Talker's temperature (0: greedy)")
    talker_top_k: int = Field(50, ge=0, le=1000, description="the Talker's top-k (0: off)")
    talker_top_p: float = Field(1.0, gt=0, le=1, description="the Talker's nucleus sampling")
    talker_repetition_penalty: float = Field(1.05, ge=1, le=2, description="penalty on codes the Talker drew")
    seed: int | None = Field(None, ge=0, lt=2**62, description="sampling seed; None: random")
    ignore_eos: bool = Field(False, description="benchmarks: run to max_tokens / max_audio_frames, never stopping early")

    RENAMED = {"max_output_tokens": "M* calls it max_tokens", "max_new_tokens": "M* calls it max_tokens",
               "speaker": "M* calls it voice", "return_audio": 'M* says modalities: ["text", "audio"]'}
