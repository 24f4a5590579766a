"""Orpheus' knobs, typed: the placement YAML's ``model_kwargs`` (``OrpheusConfig``, fixed at
start) and a request's ``model_kwargs`` (``OrpheusRequest``). Defaults and ranges live here
only; the gateway's OpenAPI document shows ``OrpheusRequest``. Imports no torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mstar.models.knobs import Knobs
from mstar.models.orpheus.tokens import (
    FIRST_WINDOW_FRAMES,
    MAX_STRIDE_FRAMES,
    OFFICIAL_WINDOW_FRAMES,
    TOKENS_PER_FRAME,
    VOICES,
)

DEFAULT_LLM = "canopylabs/orpheus-3b-0.1-ft"
DEFAULT_SNAC = "hubertsiuzdak/snac_24khz"
MAX_DECODE_ITERS = 8192
Auto3 = Literal["auto", "on", "off"]
Gemm = Literal["auto", "triton", "cublas"]


class OrpheusConfig(Knobs):
    """``model_kwargs`` of an Orpheus placement YAML."""

    # checkpoints: a Hugging Face repo id (found in the caches, models/hub.py) or a directory
    llm: str = Field(DEFAULT_LLM, description="the speech LLM's checkpoint")
    snac: str = Field(DEFAULT_SNAC, description="the SNAC 24 kHz decoder's checkpoint")
    # the SNAC decoder
    snac_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the codec's dtype; auto: bfloat16 on CUDA (within 30 dB SNR of the float32 reference: "
                            "the bar in docs/models/orpheus.md), float32 elsewhere, as the reference")
    snac_kernels: Literal["auto", "triton", "torch"] = Field(
        "auto", description="auto: the fused Triton decode on CUDA, the module decoder elsewhere")
    snac_noise: bool = Field(True, description="SNAC's decoder adds Gaussian noise each decode, as the reference")
    snac_cuda_graphs: bool = Field(True, description="full and first windows replay CUDA graphs on CUDA")
    first_window_frames: Literal[FIRST_WINDOW_FRAMES, OFFICIAL_WINDOW_FRAMES] = Field(  # type: ignore[valid-type]
        FIRST_WINDOW_FRAMES, description="3: frame 0's audio at 21 tokens; 4: at 28, as the official decoder")
    snac_stride_frames: int = Field(1, ge=1, le=MAX_STRIDE_FRAMES,
                                    description="frames decoded per window: an (n+3)-frame window every n frames")
    # the LLM's KV-cache engine (services/engines/kv_engine.EngineConfig)
    engine_process: Literal["auto"] | bool = Field(
        "auto", description="the engine in a child process; auto: on CUDA without tensor parallelism")
    constrain_codes: bool = Field(True, description="sample only the SNAC code of each frame position (or end)")
    page_size: int = Field(16, ge=1, description="tokens per KV page")
    kv_cache_bytes: int | None = Field(None, ge=1, description="KV cache size; None: gpu_memory_fraction on CUDA, "
                                                               "256 MiB on a CPU")
    gpu_memory_fraction: float = Field(0.85, gt=0, le=1, description="of free GPU memory, for the KV cache")
    max_num_seqs: int | None = Field(None, ge=1, description="sequences decoded together; None: 512 on CUDA, "
                                                               "128 on a CPU")
    max_num_batched_tokens: int = Field(4096, ge=1, description="tokens in one engine step (prefill chunks)")
    cuda_graphs: bool = Field(True, description="decode steps replay CUDA graphs")
    graph_attention: Literal["auto", "flashinfer", "triton"] = Field("auto", description="decode attention in graphs")
    fused_sampler: Auto3 = Field("auto", description="one Triton launch samples every row")
    fused_norms: Auto3 = Field("auto", description="RMSNorm folded into the projections in decode graphs")
    down_gemm: Gemm = Field("auto", description="down projection + residual add as one Triton kernel")
    proj_gemm: Gemm = Field("auto", description="qkv and o_proj as Triton kernels")
    pdl: Auto3 = Field("auto", description="programmatic dependent launch of the graphs' Triton kernels (sm_90+)")

    RENAMED = {"max_seq_len": "set max_seq_len at the top level of the placement YAML"}


class OrpheusRequest(Knobs):
    """A request's ``model_kwargs`` for Orpheus (also the OpenAI fields of the same names)."""

    voice: Literal[VOICES] = Field("tara", description="the speaker")  # type: ignore[valid-type]
    temperature: float = Field(0.6, ge=0, le=2, description="sampling temperature")
    top_p: float = Field(0.8, gt=0, le=1, description="nucleus sampling")
    repetition_penalty: float = Field(1.3, ge=1, le=2, description="penalty on tokens already generated")
    # fewer than one frame's 7 tokens can never make audio: refused on every route, not a 5xx later
    max_tokens: int = Field(1200, ge=TOKENS_PER_FRAME, le=MAX_DECODE_ITERS,
                            description="speech tokens at most (7 per 85 ms frame; at least one frame)")
    seed: int | None = Field(None, ge=0, lt=2**63, description="sampling seed; None: random")

    RENAMED = {"max_output_tokens": "M* calls it max_tokens", "max_new_tokens": "M* calls it max_tokens",
               "speaker": "M* calls it voice"}
