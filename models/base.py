"""The interfaces a model author implements: Model (conductor side) and
NodeSubmodule (node-group side)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from mstar.models.engine import Engine, check_engine
from mstar.models.graph import GraphError, GraphNode, Modality, Walk
from mstar.models.plan import WalkPlan, plan_walk


class InvalidArgument(ValueError):
    """A request field is wrong. Becomes INVALID_ARGUMENT (gRPC) / 400 (REST)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.description = message


class MissingAssets(RuntimeError):
    """Weights or tokenizers are not where the model looks; the message says where to put them."""


@dataclass(frozen=True)
class InputFile:
    name: str
    content_type: str
    data: bytes


@dataclass
class Prompt:
    """A validated request as the model sees it."""

    text: str
    files: list[InputFile]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class WalkSeed:
    """The next walk to run and its inputs (walk-input name -> tensor)."""

    walk: str
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class RequestState:
    """Per-request state the model's state machine reads and writes."""

    prompt: Prompt
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"
    walks_done: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # the model's own


@dataclass(frozen=True)
class Emit:
    """A value a node sent to EMIT_TO_CLIENT or EMIT_TO_CONDUCTOR (``postprocess`` tells them apart by ``name``)."""

    name: str
    walk: str
    node: str
    iteration: int
    chunk_index: int
    tensor: torch.Tensor


@dataclass
class Output:
    """One client-bound chunk, before it becomes an OutputChunk on the wire."""

    name: str
    modality: Modality
    text: str = ""
    data: bytes = b""
    tensor: torch.Tensor | None = None
    mime_type: str = ""
    sample_rate_hz: int = 0
    token_ids: list[int] = field(default_factory=list)
    audio_seconds: float = 0.0


@dataclass(frozen=True)
class ChunkInfo:
    """Where a stream chunk sits in its stream (items are producer iterations)."""

    index: int  # chunk number from 0
    start: int  # stream position of the chunk's first item
    new_from: int  # stream position of the first item not delivered in an earlier chunk
    final: bool  # cut when the producer finished: no chunk follows


@dataclass
class NodeCall:
    """One firing of a node for one request."""

    request_id: str
    walk: str
    iteration: int  # -1 outside loops
    inputs: dict[str, torch.Tensor]
    kwargs: dict[str, Any]  # the request's validated model kwargs
    state: dict[str, Any]  # this node's scratch space for this request, kept until release
    chunk: ChunkInfo | None = None


class NodeSubmodule:
    """The code behind one graph node, living in a node-group service.

    The runtime calls ``prepare_inputs`` and ``forward`` once per batch of calls at
    the same node and walk, then ``check_stop`` per call when the node ends a loop.
    """

    #: run forward in a worker thread (heavy compute) instead of the event loop
    blocking: bool = False
    #: most calls batched into one forward
    max_batch: int = 64

    def is_blocking(self, calls: list[NodeCall]) -> bool:
        """Whether this batch's forward must leave the event loop (a worker thread runs it)."""
        return self.blocking

    def prepare_inputs(self, calls: list[NodeCall]) -> Any:
        return calls

    def forward(self, batch: Any) -> list[dict[str, torch.Tensor]]:
        raise NotImplementedError

    def check_stop(self, call: NodeCall, outputs: dict[str, torch.Tensor]) -> bool:
        return False

    def release(self, request_id: str) -> None:
        """Free everything held for the request (caches, pages)."""

    # -- several ranks (a node group with tp_size > 1) ----------------------------------------
    #: the ``TensorParallel`` ranks this node joined when created with ``NodeContext.tp``; a
    #: node that leaves it None runs on one rank. How it splits its work is its own (Megatron
    #: tensor parallelism for the LLM engines, rows of a pass for BAGEL's flow)
    tensor_parallel: Any = None

    def follow(self) -> None:
        """Ranks past 0: mirror rank 0 until its ``close``."""
        raise TypeError(f"{type(self).__name__} does not run on several ranks")

    def close(self) -> None:
        """The service is stopping (rank 0 releases ranks 1.. here); after the node's last call."""


class LoopBodyNode(NodeSubmodule):
    """A node that is the whole body of a fixed-count Loop (no stop_node) and whose iteration
    is a fixed-shape, row-independent tensor function: a flow-matching Euler step, an action
    step, a rollout step. The runtime runs every iteration of a batch of requests in one call
    (``services/engines/loop_graph.py``): on CUDA one CUDA graph replay per batch bucket,
    eagerly on a CPU or past the largest bucket.

    ``step`` sees each input with the batch (one row per request) prepended as dim 0; the
    inputs named like a carried edge of the loop (x -> x) are fed back each iteration, the
    others are constants. Everything it derives from ``iteration`` on the host is frozen into
    the graph. Only the loop's exits and at-loop-end emits leave it (the loop is one call), so
    its other out-edges must be carried ones.
    """

    blocking = True
    #: batch sizes graphs are captured for (one graph each; larger batches run eagerly)
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    device: str = "cpu"

    def step(self, inputs: dict[str, torch.Tensor], iteration: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def example_inputs(self) -> dict[str, torch.Tensor] | None:
        """One request's loop inputs (no batch dim), or None: the node group warms the loop on them at
        start-up (``LoopGraphs.warm``: on CUDA once per bucket of ``graph_buckets``), so no request
        waits for a compile or a capture."""
        return None

    def forward(self, batch: Any) -> list[dict[str, torch.Tensor]]:
        raise TypeError("a LoopBodyNode runs its whole loop through step(), not forward")


class EngineNode(NodeSubmodule):
    """A node whose calls are served by a sequence engine that batches across requests and
    steps on its own schedule (a KV-cache engine: continuous batching, chunked prefill,
    preemption), typically the body of a decode Loop.

    The node group's ``EngineDriver`` owns everything between the runtime and ``engine``
    (inbox, releases, the step in flight, calls waiting, outputs that came before their call),
    on the event loop's thread; the engine steps on a thread (or process) of its own. The
    node only says what a call asks of the engine (``prepare``), what an output means for the
    call (``outputs``) and when its loop ends (``check_stop``): no locks, no maps.

    Each call of a request takes one output of the request's sequence, in order. The call
    whose ``prepare`` returns work (``StartSeq`` / ``ImportSeq`` from
    ``mstar.services.engines.seq_engine``) takes the new sequence's first output; a call for
    which it returns None takes the next one (which may have come before the call). Once
    the sequence has finished and its outputs are taken, or where the request has none
    here, ``outputs(call, None)`` answers at once.
    """

    blocking = True  # step on the driver's engine thread (False: on the event loop; tests)
    #: for an engine each of whose steps serves only the calls that came (a loop fed a row an
    #: iteration: the Talker): before stepping, wait up to this long (seconds) for the next calls
    #: of its other running sequences (their last outputs are being routed), so that their rows
    #: join this step instead of making the next one; 0: step at once
    gather_s = 0.0
    #: the sequence engine (``LocalSeqEngine`` or ``EngineProcess``: seq_engine.py; or a model's
    #: own), held to the engine contract (``mstar.models.engine.Engine``) when the node sets it
    engine: Engine[Any] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "engine" and value is not None:  # an engine missing a method is refused here, not at its first call
            value = check_engine(value, f"engine node {type(self).__name__}")
        super().__setattr__(name, value)

    def prepare(self, call: NodeCall) -> Any:
        """The engine work this call starts (``StartSeq`` / ``ImportSeq``), or None."""
        return None

    def outputs(self, call: NodeCall, output: Any) -> dict[str, torch.Tensor]:
        """The call's outputs from the sequence's next ``SeqOutput``, or from None once the
        request has no sequence here (finished, or never started). It may run on the engine's
        thread (for a call that waited for the step) while other requests' calls are prepared
        on the event loop: read and write only the call and its ``state``."""
        raise NotImplementedError

    def kv_stats(self) -> Any:
        """The engine's ``KvStats`` (pages used / free, preemptions), exported as
        ``mstar_kv_*``; None without a KV cache."""
        stats = getattr(self.engine, "kv_stats", None)
        return stats() if stats is not None else None

    def forward(self, batch: Any) -> list[dict[str, torch.Tensor]]:
        raise TypeError("an EngineNode runs through its engine (prepare / outputs), not forward")

    # -- tensor parallelism (a node group with tp_size > 1) ---------------------------------
    def follow(self) -> None:
        """Ranks past 0: mirror rank 0's engine until its ``close``."""
        follow = getattr(self.engine, "follow", None)  # optional in the engine contract
        if self.tensor_parallel is None or follow is None:
            raise TypeError(f"{type(self).__name__} does not run tensor-parallel")
        follow()

    def close(self) -> None:
        """The service is stopping (rank 0 releases its followers here)."""
        if self.engine is not None:
            self.engine.close()

    def exit_reason(self) -> str | None:
        """Why this node can no longer step (its engine process died), else None. The
        service stops on it; the conductor then fails the requests it held."""
        return self.engine.exit_reason() if self.engine is not None else None


@dataclass(frozen=True)
class NodeContext:
    """Where a submodule is created."""

    node: str
    device: str
    cache_dir: str | None
    model_kwargs: dict[str, Any]
    tp: Any = None  # a TPSpec when the node group has tp_size > 1: join it (see NodeSubmodule.tensor_parallel)
    #: the walks this node group serves the node for (a node placed on two groups with
    #: graph_walks serves some walks on each: e.g. prefill here, decode there); empty: unknown
    walks: frozenset[str] = frozenset()

    @property
    def compile(self) -> bool:
        """``model_kwargs.compile``: run what the model offers under torch.compile; on by default on
        a GPU, never on a CPU."""
        flag = self.model_kwargs.get("compile")
        return self.device.startswith("cuda") and (flag is None or bool(flag))


@dataclass(frozen=True)
class ModelApi:
    """What the OpenAI-compatible routes may send to and ask of a model beyond text in and its
    outputs out (conductor.proto's ``ModelApi``; the conductor reports it in ListModels)."""

    #: media kinds a chat message may attach ("image", "audio", "video"), each sent as a file
    chat_media: tuple[str, ...] = ()
    #: model kwargs every chat completion sends (BAGEL: {"mode": "understand"})
    chat_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: the audio output chat answers carry with modalities ["text", "audio"] ("": text only); the
    #: model then takes the model kwargs ``modalities`` (always sent) and ``voice``
    chat_audio_output: str = ""
    voices: tuple[str, ...] = ()
    default_voice: str = ""
    #: "wav", and "pcm16" only for 24 kHz PCM16 audio (what OpenAI's pcm16 means)
    audio_formats: tuple[str, ...] = ()
    #: model kwargs /v1/images/edits sends with the input image; None: the model does not edit images
    edit_kwargs: Mapping[str, Any] | None = None
    #: model kwargs /v1/audio/speech sends with the input text (Qwen3-Omni: a read-aloud system prompt)
    speech_kwargs: Mapping[str, Any] = field(default_factory=dict)


class Model:
    """A composite model: graph, walks, and the per-request walk state machine."""

    name: ClassVar[str]
    nodes: ClassVar[tuple[GraphNode, ...]]
    #: typed schemas (``mstar.models.knobs.Knobs``) of the placement YAML's model_kwargs and of a
    #: request's model_kwargs; the gateway's OpenAPI document shows the request one. None: untyped
    config_schema: ClassVar[Any] = None
    request_schema: ClassVar[Any] = None
    #: the longest sequence (prompt + output tokens) a request may have: the placement YAML's
    #: max_seq_len, set by ``Placement``; models bound prompts by it and size their KV caches for it
    max_seq_len: int = 4096
    #: the conductor refuses a prompt text longer than ``max_prompt_chars`` before the model reads it
    #: (a request-sized cost bounded before it is paid: tokenising 30 MB took 43 s); by default
    #: ``max_seq_len`` tokens of at most this many characters each, a bound no real prompt that fits nears
    chars_per_token_bound: ClassVar[int] = 16
    #: validate_kwargs + process_prompt decode media or do other work that would stall the conductor's
    #: event loop (every request's routing) for milliseconds: run them on a worker thread. Light models
    #: (the toy's read costs ~9 us, a thread hop ~60 us) stay on the loop.
    heavy_prompt: ClassVar[bool] = False
    #: the ACTION output that ``Conductor.Act`` returns; None: the model does not serve Act. A model that
    #: sets it reads Act's request as its Generate request: text = the task, files = the camera images
    #: (named by camera), model_kwargs {"state": [floats], "seed": int or absent}.
    act_output: ClassVar[str | None] = None

    def __init__(self, model_kwargs: dict[str, Any] | None = None, cache_dir: str | None = None):
        self.model_kwargs = dict(model_kwargs or {})
        self.cache_dir = cache_dir  # where weights live (HF cache or plain directories)
        self.walks: dict[str, Walk] = {w.name: w for w in self.build_walks()}
        node_map = {n.name: n for n in self.nodes}
        self.plans: dict[str, WalkPlan] = {name: plan_walk(w, node_map, self.walks) for name, w in self.walks.items()}
        self.outputs: dict[str, Modality] = {}
        for plan in self.plans.values():
            for e in plan.emits:
                assert e.modality is not None
                if self.outputs.setdefault(e.name, e.modality) is not e.modality:
                    raise GraphError(f"output '{e.name}' is emitted with two modalities")
        for plan in self.plans.values():
            for e in plan.conductor_emits:
                if e.name in self.outputs:
                    raise GraphError(f"'{e.name}' goes both to the client and to EMIT_TO_CONDUCTOR; give the "
                                     f"conductor's value its own name (postprocess tells emits apart by name)")

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt text (characters) worth reading: a longer one cannot fit. A model whose
        prompts have another bound (a fixed token budget) overrides it."""
        return self.max_seq_len * self.chars_per_token_bound

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]

    # -- graph ---------------------------------------------------------------------------
    def build_walks(self) -> list[Walk]:
        raise NotImplementedError

    def checkpoints(self) -> list[Any]:
        """The checkpoints this model (with its model_kwargs) reads, as ``mstar.models.hub``
        ``CheckpointSpec``s: the launcher finds them in the local caches, or downloads them
        when allowed, before any service starts. Models without weights need none."""
        return []

    def check_assets(self) -> None:
        """Raise with a message saying where to put them if weights/tokenizers are missing.
        The launcher calls it before starting anything."""

    def write_random_weights(self, directory: str) -> list[str]:
        """Write a tiny random checkpoint in the real layout under ``directory`` (demo
        mode); returns what was written. Models without weights write nothing."""
        return []

    def prepare_conductor(self) -> None:
        """Load what the conductor side needs (tokenizers); called once at conductor start."""

    def api(self) -> ModelApi:
        """The model's OpenAI-facing surface (chat media, chat audio, image edits); called on the
        conductor after ``prepare_conductor``. Default: text in, the outputs out, nothing more."""
        return ModelApi()

    # -- conductor side ------------------------------------------------------------------
    def validate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Check and normalise per-request knobs; raise InvalidArgument naming the field."""
        if kwargs:
            raise InvalidArgument(f"model_kwargs.{next(iter(kwargs))}", f"unknown key for model '{self.name}'")
        return {}

    def process_prompt(self, prompt: Prompt) -> RequestState:
        raise NotImplementedError

    def next_walk(self, state: RequestState, finished: str | None) -> WalkSeed | None:
        """The state machine: the first walk (finished=None), then the one after
        ``finished``, or None when the request is complete."""
        raise NotImplementedError

    def postprocess(self, state: RequestState, emit: Emit) -> list[Output]:
        raise NotImplementedError

    # -- node-group side -----------------------------------------------------------------
    def create_submodule(self, ctx: NodeContext) -> NodeSubmodule:
        raise NotImplementedError

