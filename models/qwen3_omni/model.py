"""Qwen3-Omni: Thinker (MoE LLM over text, audio and images) -> Talker (MoE codec LM + code
predictor) -> Code2Wav, overlapping in time.

Walks (the state machine runs encode? -> prefill -> think | speak):
- ``encode`` (requests with media): Parallel(audio_encoder, vision_encoder); their rows persist
  to the Thinker;
- ``prefill``: the Thinker reads the prompt and draws the first token; the rows the Talker's
  prompt needs persist to the Talker;
- ``think`` (text only): a Loop over the Thinker; the Talker never starts;
- ``speak``: Parallel(Loop(thinker), Loop(talker)). The Thinker streams one text row per token
  into the Talker's loop, already running (a stream into a running loop: each Talker iteration
  takes the next row, waits when it has caught up, goes on with <|tts_pad|> once the Thinker has
  finished; the Thinker waits when ``talker_max_ahead`` rows are untaken). Each Talker frame
  streams to Code2Wav in chunks of ``code2wav_chunk_frames`` new frames after up to
  ``code2wav_left_context_frames`` of context (walk ``code2wav_chunk``).
Text reaches the client token by token, audio chunk by chunk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mstar.models.base import (
    Emit,
    InvalidArgument,
    MissingAssets,
    Model,
    ModelApi,
    NodeContext,
    NodeSubmodule,
    Output,
    Prompt,
    RequestState,
    WalkSeed,
)
from mstar.models.graph import (
    EMIT_TO_CLIENT,
    INPUT,
    EngineType,
    FixedChunks,
    GraphEdge,
    GraphNode,
    LeftContext,
    Loop,
    Modality,
    Parallel,
    PartitionTopology,
    SlidingWindow,
    StreamingGraphEdge,
    Walk,
)
from mstar.models.hub import CheckpointError, CheckpointSpec, resolve_checkpoint
from mstar.models.knobs import KnobError
from mstar.models.qwen3_omni.knobs import MAX_AUDIO_FRAMES, MAX_TEXT_TOKENS, OmniRequest, OmniServeConfig
from mstar.models.qwen3_omni.weights import RANDOM_MARKER

SAMPLE_RATE = 24_000
#: /v1/audio/speech's system prompt: the Thinker repeats the input and the Talker speaks it (a TTS front
#: on the model's own speech path; how faithfully it repeats is the checkpoint's doing)
READ_ALOUD = ("You are a text-to-speech voice. Repeat the user's message exactly as written, word for word, "
              "adding nothing and leaving nothing out.")
WEIGHTS_HELP = ("put the snapshot in the HF cache or --cache-dir (models--Qwen--Qwen3-Omni-30B-A3B-Instruct/snapshots/..., "
                "or <cache-dir>/Qwen/Qwen3-Omni-30B-A3B-Instruct), serve with --download, or with --random-weights "
                "for a tiny random demo checkpoint")


def codec_policy(c: OmniServeConfig) -> LeftContext | SlidingWindow:
    """Chunks of ``code2wav_chunk_frames`` new frames after up to ``code2wav_left_context_frames``;
    with ``code2wav_first_chunk_frames`` the first chunk is shorter (a sliding window whose first
    window comes early; its last window may then carry more context than the left context), and
    with ``code2wav_ramp`` the chunks after it grow from it (SlidingWindow's ``ramp``)."""
    first = c.code2wav_first_chunk_frames
    if first is None or first == c.code2wav_chunk_frames:
        return LeftContext(c.code2wav_chunk_frames, c.code2wav_left_context_frames)
    return SlidingWindow(window=c.code2wav_left_context_frames + c.code2wav_chunk_frames, stride=c.code2wav_chunk_frames,
                         first=min(first, c.code2wav_left_context_frames + c.code2wav_chunk_frames), ramp=c.code2wav_ramp)


class Qwen3OmniModel(Model):
    name = "qwen3_omni"
    nodes = (GraphNode("audio_encoder"), GraphNode("vision_encoder"), GraphNode("thinker", EngineType.KV_CACHE),
             GraphNode("talker", EngineType.KV_CACHE), GraphNode("code2wav"))
    config_schema = OmniServeConfig
    request_schema = OmniRequest

    def __init__(self, model_kwargs: dict[str, Any] | None = None, cache_dir: str | None = None):
        self.config = OmniServeConfig.parse(model_kwargs, model=self.name)
        super().__init__(model_kwargs, cache_dir)

    def build_walks(self) -> list[Walk]:
        c = self.config
        thinker_loop = Loop("thinker", max_iters=MAX_TEXT_TOKENS, stop_node="thinker", name="text")
        talker_loop = Loop("talker", max_iters=MAX_AUDIO_FRAMES + 1, stop_node="talker", name="speech")
        decode = [GraphEdge(INPUT, "thinker", "token"), GraphEdge("thinker", "thinker", "token"),
                  GraphEdge("thinker", EMIT_TO_CLIENT, "text", modality=Modality.TEXT)]
        prefill_inputs = ("prompt_ids", "positions", "delta", "talker_rows", "talker_mm", "audio_embeds", "image_embeds",
                          "deepstack")
        return [
            Walk("encode", Parallel("audio_encoder", "vision_encoder"), [
                GraphEdge(INPUT, "audio_encoder", "audio_features"), GraphEdge(INPUT, "audio_encoder", "audio_lengths"),
                GraphEdge(INPUT, "vision_encoder", "pixels"), GraphEdge(INPUT, "vision_encoder", "image_grids"),
                GraphEdge("audio_encoder", "thinker", "audio_embeds", persist=True),
                GraphEdge("vision_encoder", "thinker", "image_embeds", persist=True),
                GraphEdge("vision_encoder", "thinker", "deepstack", persist=True),
            ]),
            Walk("prefill", "thinker", [
                *(GraphEdge(INPUT, "thinker", n) for n in prefill_inputs),
                GraphEdge("thinker", "thinker", "token", persist=True),
                GraphEdge("thinker", "talker", "talker_prompt", persist=True),
                GraphEdge("thinker", EMIT_TO_CLIENT, "text", modality=Modality.TEXT),
            ]),
            Walk("think", thinker_loop, decode),
            Walk("speak", Parallel(thinker_loop, talker_loop), [
                *decode,
                StreamingGraphEdge("thinker", "talker", "text_rows", policy=FixedChunks(1), max_ahead=c.talker_max_ahead),
                GraphEdge(INPUT, "talker", "talker_prompt", once=True),
                *(GraphEdge(INPUT, "talker", n) for n in ("talker_mm", "talker_positions", "talker_delta", "speaker")),
                StreamingGraphEdge("talker", "code2wav", "codes", policy=codec_policy(c),
                                   topology=PartitionTopology("speak", "code2wav_chunk")),
            ]),
            Walk("code2wav_chunk", "code2wav", [
                GraphEdge(INPUT, "code2wav", "codes"),
                GraphEdge("code2wav", EMIT_TO_CLIENT, "audio", modality=Modality.AUDIO),
            ]),
        ]

    # -- assets --------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointSpec]:
        return [CheckpointSpec(self.config.checkpoint, required=("config.json", "tokenizer.json",
                                                                   ("model.safetensors", "model.safetensors.index.json", RANDOM_MARKER)),
                               allow_patterns=("*.json", "*.safetensors", "*.txt"))]

    def checkpoint_dir(self) -> Path:
        return resolve_checkpoint(self.config.checkpoint, cache_dir=self.cache_dir)

    def check_assets(self) -> None:
        try:
            d = self.checkpoint_dir()
        except CheckpointError as e:
            raise MissingAssets(f"qwen3_omni: {e}; {WEIGHTS_HELP}") from None
        missing = self.checkpoints()[0].missing_files(d)
        if missing:
            raise MissingAssets(f"qwen3_omni: {d} lacks {', '.join(missing)}; {WEIGHTS_HELP}")

    def write_random_weights(self, directory: str) -> list[str]:
        from mstar.models.qwen3_omni.tiny import write_tiny_checkpoint

        target = Path(directory) / self.config.checkpoint
        if (target / "config.json").exists():
            return []
        write_tiny_checkpoint(target)
        return [str(target)]

    def prepare_conductor(self) -> None:
        from tokenizers import Tokenizer

        from mstar.models.qwen3_omni.config import OmniConfig
        from mstar.models.qwen3_omni.media import MediaDecoder
        from mstar.models.qwen3_omni.prompt import MediaTokens
        from mstar.models.qwen3_omni.weights import CheckpointReader

        d = self.checkpoint_dir()
        self.omni = OmniConfig.parse(CheckpointReader(d).config())
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        ends = [self.tokenizer.token_to_id(t) for t in ("<|audio_end|>", "<|vision_end|>")]
        self.media_tokens = MediaTokens(*(e if e is not None else -1 for e in ends))
        c = self.config
        self.media = MediaDecoder(self.omni, d, c.max_audio_seconds, c.max_image_pixels, c.max_file_bytes,
                                  c.max_video_seconds)

    def api(self) -> ModelApi:
        """Chat takes audio, images and videos, and speaks (24 kHz PCM16: OpenAI's pcm16) in the checkpoint's voices."""
        if not hasattr(self, "omni"):
            self.prepare_conductor()
        return ModelApi(chat_media=("audio", "image", "video"), chat_audio_output="audio",
                        voices=tuple(sorted(self.omni.speakers)), default_voice=OmniRequest().voice,
                        audio_formats=("wav", "pcm16"), speech_kwargs={"system": READ_ALOUD, "modalities": ["text", "audio"]})

    # -- conductor side ------------------------------------------------------------------
    def validate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            return OmniRequest.parse(kwargs, model=self.name, sep=": ").given()
        except KnobError as e:
            raise InvalidArgument(e.key, e.description) from None

    def process_prompt(self, prompt: Prompt) -> RequestState:
        from mstar.models.qwen3_omni.conductor import build_request

        if not hasattr(self, "tokenizer"):
            self.prepare_conductor()
        return build_request(self, prompt)

    def next_walk(self, state: RequestState, finished: str | None) -> WalkSeed | None:
        d = state.data
        if finished is None and d["encode"] is not None:
            return WalkSeed("encode", d["encode"])
        if finished in (None, "encode"):
            return WalkSeed("prefill", d["prefill"])
        if finished == "prefill":  # (if the first token ended the answer, the loops end at once)
            return WalkSeed("speak", d["speak"]) if d["speak"] is not None else WalkSeed("think")
        return None

    def postprocess(self, state: RequestState, emit: Emit) -> list[Output]:
        d = state.data
        if emit.name == "text":
            out = []
            for t in emit.tensor.tolist():
                state.completion_tokens += 1
                if t in d["stop_ids"]:
                    state.finish_reason, d["ended"] = "stop", True
                    continue
                d["ids"].append(t)
                text = self.tokenizer.decode(d["ids"], skip_special_tokens=True)
                new, d["text"] = text[len(d["text"]):], text
                if text.endswith("\ufffd"):  # an incomplete character: wait for its other bytes
                    d["text"] = text[: -1]
                    new = new[: -1] if new.endswith("\ufffd") else new
                out.append(Output("text", Modality.TEXT, text=new, token_ids=[t]))
            if not d["ended"] and state.completion_tokens >= state.prompt.kwargs["max_tokens"]:
                state.finish_reason, d["ended"] = "length", True
            return out
        samples = emit.tensor
        if samples.numel() == 0:
            return []
        pcm = np.rint(np.clip(samples.numpy(), -1, 1) * np.float32(32767)).astype(np.int16).tobytes()
        return [Output("audio", Modality.AUDIO, data=pcm, mime_type="audio/pcm", sample_rate_hz=SAMPLE_RATE,
                       audio_seconds=samples.numel() / SAMPLE_RATE)]

    # -- node-group side -----------------------------------------------------------------
    def create_submodule(self, ctx: NodeContext) -> NodeSubmodule:
        from mstar.models.qwen3_omni import nodes

        d = self.checkpoint_dir()
        if ctx.node == "thinker":
            return nodes.ThinkerNode(d, ctx, self.max_seq_len)
        if ctx.node == "talker":
            return nodes.TalkerNode(d, ctx, self.max_seq_len)
        return {"audio_encoder": nodes.AudioEncoderNode, "vision_encoder": nodes.VisionEncoderNode,
                "code2wav": nodes.Code2WavNode}[ctx.node](d, ctx)
