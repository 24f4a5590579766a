"""Orpheus TTS: a Llama-3.2-3B speech LLM emitting SNAC codes, and the SNAC 24 kHz decoder.

Walks:
- ``prefill``: the LLM reads the prompt and samples the first token (kept for ``decode``);
- ``decode``: a Loop over the LLM, one token per iteration, ending at end-of-speech or
  ``max_tokens`` (which one, and the tokens sampled, reach the conductor at the loop's end:
  ``finish_reason`` ``stop`` / ``length``, ``usage.completion_tokens``); every valid audio
  code streams to the SNAC decoder over a sliding
  window of 28 codes (4 frames) advancing 7 (1 frame), the first window at 21 codes
  (frame 0 and its two frames of right context; ``first_window_frames: 4`` waits for 28;
  ``snac_stride_frames: n`` decodes n frames a window, see ``tokens.window_plan``);
- ``snac_chunk``: one window -> the PCM of the frames it completes -> the client.
"""

from __future__ import annotations

from typing import Any

import torch

from mstar.models.base import (
    Emit,
    InvalidArgument,
    MissingAssets,
    Model,
    NodeContext,
    NodeSubmodule,
    Output,
    Prompt,
    RequestState,
    WalkSeed,
)
from mstar.models.graph import (
    EMIT_TO_CLIENT,
    EMIT_TO_CONDUCTOR,
    INPUT,
    EngineType,
    GraphEdge,
    GraphNode,
    Loop,
    Modality,
    PartitionTopology,
    SlidingWindow,
    StreamingGraphEdge,
    Walk,
)
from mstar.models.hub import CheckpointError, CheckpointSpec, resolve_checkpoint
from mstar.models.knobs import KnobError
from mstar.models.orpheus.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    TOKENIZER_FILE,
    load_tokenizer,
    open_checkpoint,
)
from mstar.models.orpheus.knobs import MAX_DECODE_ITERS, OrpheusConfig, OrpheusRequest
from mstar.models.orpheus.snac_weights import WEIGHT_FILE as SNAC_WEIGHT_FILE
from mstar.models.orpheus.tokens import FINISH_STOP, build_prompt_ids, window_plan
from mstar.models.tokens import encode_ids

SAMPLE_RATE = 24_000
WEIGHTS_HELP = ("put the Hugging Face snapshots in the HF cache or --cache-dir (layout models--org--name/snapshots/..., "
                "or plain <cache-dir>/org/name directories), serve with --download to fetch them, or with "
                "--random-weights for a tiny random demo checkpoint")

class OrpheusModel(Model):
    name = "orpheus"
    nodes = (GraphNode("llm", EngineType.KV_CACHE), GraphNode("snac_decoder"))
    config_schema = OrpheusConfig
    request_schema = OrpheusRequest

    def __init__(self, model_kwargs: dict[str, Any] | None = None, cache_dir: str | None = None):
        self.config = OrpheusConfig.parse(model_kwargs, model=self.name)  # before the walks, which read it
        super().__init__(model_kwargs, cache_dir)

    def build_walks(self) -> list[Walk]:
        plan = window_plan(self.model_kwargs)
        return [
            Walk("prefill", "llm", [
                GraphEdge(INPUT, "llm", "prompt_ids"),
                GraphEdge("llm", "llm", "token", persist=True),  # the first sampled token, for decode
                # the KV hand-off: where decode runs in another node group (the pd_disaggregated
                # layout), the prompt's K/V and their token ids go there; empty where it runs here
                GraphEdge("llm", "llm", "kv", persist=True),
                GraphEdge("llm", "llm", "kv_tokens", persist=True),
            ]),
            Walk("decode", Loop("llm", max_iters=MAX_DECODE_ITERS, stop_node="llm", name="tokens"), [
                GraphEdge(INPUT, "llm", "token"),
                GraphEdge(INPUT, "llm", "kv", once=True),
                GraphEdge(INPUT, "llm", "kv_tokens", once=True),
                GraphEdge("llm", "llm", "token"),
                StreamingGraphEdge("llm", "snac_decoder", "code", policy=SlidingWindow(plan.window, plan.stride, first=plan.first),
                                   topology=PartitionTopology("decode", "snac_chunk")),
                GraphEdge("llm", EMIT_TO_CONDUCTOR, "finish", at_loop_end=True),  # end-of-speech or max_tokens
            ]),
            Walk("snac_chunk", "snac_decoder", [
                GraphEdge(INPUT, "snac_decoder", "code"),
                GraphEdge("snac_decoder", EMIT_TO_CLIENT, "audio", modality=Modality.AUDIO),
            ]),
        ]

    # -- assets --------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointSpec]:
        return [CheckpointSpec(self.config.llm, required=("config.json", TOKENIZER_FILE, (INDEX_FILE, SINGLE_FILE)),
                               allow_patterns=("*.json", "*.safetensors")),
                CheckpointSpec(self.config.snac, required=("config.json", SNAC_WEIGHT_FILE),
                               allow_patterns=("config.json", SNAC_WEIGHT_FILE))]

    def checkpoint_dirs(self):
        return (resolve_checkpoint(self.config.llm, cache_dir=self.cache_dir),
                resolve_checkpoint(self.config.snac, cache_dir=self.cache_dir))

    def check_assets(self) -> None:
        try:
            llm, _ = self.checkpoint_dirs()
            open_checkpoint(llm)
        except CheckpointError as e:
            raise MissingAssets(f"orpheus: {e}; {WEIGHTS_HELP}") from None

    def write_random_weights(self, directory: str) -> list[str]:
        from pathlib import Path

        from mstar.models.orpheus.demo_checkpoint import DemoSpec, write_random_llm, write_random_snac

        spec, root, written = DemoSpec(), Path(directory), []
        llm = root / self.config.llm
        snac = root / self.config.snac
        if not (llm / "config.json").exists():
            write_random_llm(llm, spec)
            written.append(str(llm))
        if not (snac / "config.json").exists():
            write_random_snac(snac, spec.snac, seed=spec.seed)
            written.append(str(snac))
        return written

    def prepare_conductor(self) -> None:
        llm, _ = self.checkpoint_dirs()
        self._tokenizer = load_tokenizer(open_checkpoint(llm))

    # -- conductor side ------------------------------------------------------------------
    def validate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            return OrpheusRequest.parse(kwargs, model=self.name, sep=": ").given()
        except KnobError as e:
            raise InvalidArgument(e.key, e.description) from None

    def process_prompt(self, prompt: Prompt) -> RequestState:
        if not prompt.text.strip():
            raise InvalidArgument("text", "must not be empty")
        if not hasattr(self, "_tokenizer"):
            self.prepare_conductor()
        encode = lambda s: encode_ids(self._tokenizer, s)  # noqa: E731
        ids = build_prompt_ids(encode, prompt.text, prompt.kwargs["voice"])
        limit = self.max_seq_len - prompt.kwargs["max_tokens"]  # the placement YAML's max_seq_len
        if len(ids) > limit:
            raise InvalidArgument("text", f"prompt is {len(ids)} tokens; with max_tokens={prompt.kwargs['max_tokens']} "
                                          f"at most {limit} fit in max_seq_len={self.max_seq_len}")
        state = RequestState(prompt, prompt_tokens=len(ids))
        state.data["prompt_ids"] = torch.tensor(ids, dtype=torch.int64)
        return state

    def next_walk(self, state: RequestState, finished: str | None) -> WalkSeed | None:
        if finished is None:
            return WalkSeed("prefill", {"prompt_ids": state.data["prompt_ids"]})
        if finished == "prefill":
            return WalkSeed("decode")
        return None

    def postprocess(self, state: RequestState, emit: Emit) -> list[Output]:
        if emit.name == "finish":  # the decode loop's end: why (end-of-speech, else max_tokens) and tokens sampled
            why, sampled = emit.tensor.tolist()  # the last iteration always says why (max_tokens <= MAX_DECODE_ITERS)
            state.finish_reason = "stop" if why == FINISH_STOP else "length"
            state.completion_tokens = sampled
            return []
        samples = emit.tensor
        if samples.numel() == 0:
            return []
        pcm = (samples.clamp(-1, 1) * 32767).to(torch.int16).numpy().tobytes()  # truncation, as Orpheus does
        return [Output("audio", Modality.AUDIO, data=pcm, mime_type="audio/pcm", sample_rate_hz=SAMPLE_RATE,
                       audio_seconds=samples.numel() / SAMPLE_RATE)]

    # -- node-group side -----------------------------------------------------------------
    def create_submodule(self, ctx: NodeContext) -> NodeSubmodule:
        llm, snac = self.checkpoint_dirs()
        if ctx.node == "llm":
            from mstar.models.orpheus.llm_node import OrpheusLLM

            return OrpheusLLM(llm, ctx, max_seq_len=self.max_seq_len)
        from mstar.models.orpheus.snac_node import SnacNode

        return SnacNode(snac, ctx)
