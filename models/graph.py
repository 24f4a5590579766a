"""The Walk Graph: the language a model author uses to declare a composite model.

A model declares graph nodes (the components) and named walks. A walk has a
*body* (the order nodes run in: Sequential / Parallel / Loop / a node name) and
*edges* (the values flowing between nodes). The runtime decides where nodes run;
the graph only says what depends on what.

Edge endpoints:
- ``INPUT`` as a source: a walk input, given by the state machine when the walk
  starts or, failing that, a value persisted by an earlier walk under that name.
- ``EMIT_TO_CLIENT`` as a destination: streamed to the client.
- ``EMIT_TO_CONDUCTOR`` as a destination: a value for the model's own state machine. The
  conductor's ``postprocess`` sees it as an Emit, as it sees client outputs; clients never do
  (e.g. why a loop stopped, for the request's finish reason or the next walk's choice).

Inside a Loop, an edge from a node to itself or to an earlier node of the loop
body is *carried*: its value feeds the next iteration. An edge from a loop node to
a node after the loop fires once, when the loop ends (last value, or the
concatenation over iterations if the Loop accumulates that edge). An emit from a loop node
fires at every iteration, or once when the loop ends with ``at_loop_end=True``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

INPUT = "<input>"
EMIT_TO_CLIENT = "<client>"
EMIT_TO_CONDUCTOR = "<conductor>"


class EngineType(enum.Enum):
    """Which engine of the node-group service executes a node. ``KV_CACHE``: the node keeps each
    request's state (its K/V cache) in its group's engine between walks; placement then refuses to
    split its walks over groups unless the later ones receive that state (a K/V hand-off)."""

    STATELESS = "stateless"
    KV_CACHE = "kv_cache"


class Modality(enum.Enum):
    """What a client-bound edge carries (mirrors mstar.v1.Modality)."""

    TEXT = 1
    IMAGE = 2
    AUDIO = 3
    ACTION = 4
    LATENT = 5


@dataclass(frozen=True)
class GraphNode:
    """A component of the model (encoder, LLM, codec...)."""

    name: str
    engine: EngineType = EngineType.STATELESS


@dataclass(frozen=True)
class GraphEdge:
    """A value flowing from ``src`` to ``dst`` under ``name``.

    persist: also keep the value for later walks of the same request (read there
        through an INPUT edge of the same name into the same node).
    modality: required when ``dst`` is EMIT_TO_CLIENT.
    at_loop_end: for an emit (EMIT_TO_CLIENT / EMIT_TO_CONDUCTOR) from a node inside a Loop:
        fire once, when the loop ends, with the last iteration's value (all iterations'
        values concatenated if the Loop accumulates the name), instead of at every iteration.
        The node still returns the output at every iteration.
    once: for a value entering a Loop from outside it (a walk input, or a node before the
        loop): only the loop's first iteration reads it, and it is dropped once read. Loop
        inputs are otherwise kept for every iteration; a large one read once (a KV cache
        handed over from another node group, which the engine copies into its own pages)
        would be held for the whole loop.
    """

    src: str
    dst: str
    name: str
    persist: bool = False
    modality: Modality | None = None
    at_loop_end: bool = False
    once: bool = False

    @property
    def streaming(self) -> bool:
        return False


# --- chunk policies for streaming edges -------------------------------------------------


@dataclass(frozen=True)
class FixedChunks:
    """Chunks of ``size`` consecutive items. When the producer finishes, a partial
    last chunk is still delivered if ``continue_after_done`` (else dropped)."""

    size: int
    continue_after_done: bool = True

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"FixedChunks.size must be >= 1, got {self.size}")


@dataclass(frozen=True)
class SlidingWindow:
    """Every ``stride`` new rows, the last ``window`` rows (once ``window`` exist). When
    the producer finishes, one last window follows (``final``), holding any rows not yet
    covered — possibly none, so that a consumer holding back look-ahead can flush.

    ``first`` (default ``window``): the first window comes once ``first`` rows exist and
    holds just those; later ones every ``stride`` rows after it, up to ``window`` long. A
    consumer that needs less context at the start than in steady state (a codec's first
    frame has no left context to wait for) starts earlier.

    ``ramp``: after the first window, each one brings at most as many new rows as all the
    windows before it (``first``, ``first``, 2 ``first``, ... up to ``stride``): a short first
    chunk of audio is followed by chunks that take no longer to make than the audio before them
    takes to play, at any rate faster than real time."""

    window: int
    stride: int
    first: int | None = None
    ramp: bool = False

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.stride <= self.window:
            raise ValueError(f"SlidingWindow needs window >= 1 and 1 <= stride <= window, got window={self.window}, "
                             f"stride={self.stride}")
        if self.first is not None and not 1 <= self.first <= self.window:
            raise ValueError(f"SlidingWindow.first must be in [1, window={self.window}], got {self.first}")

    @property
    def first_rows(self) -> int:
        return self.window if self.first is None else self.first


@dataclass(frozen=True)
class LeftContext:
    """Chunks of ``chunk`` new items, each preceded by up to ``left_context`` earlier
    items. A partial last chunk is delivered when the producer finishes."""

    chunk: int
    left_context: int

    def __post_init__(self) -> None:
        if self.chunk < 1 or self.left_context < 0:
            raise ValueError(f"LeftContext needs chunk >= 1 and left_context >= 0, got chunk={self.chunk}, "
                             f"left_context={self.left_context}")


ChunkPolicy = FixedChunks | SlidingWindow | LeftContext


@dataclass(frozen=True)
class PartitionTopology:
    """How a stream crosses walks: items produced by ``src_walk`` are cut into chunks,
    and each chunk runs one instance of ``dst_walk`` (a chunk walk) whose INPUT edge
    named like the stream receives the chunk. Chunk walks run while the producer
    still runs; the producer's walk ends only when all its chunk walks have ended."""

    src_walk: str
    dst_walk: str


@dataclass(frozen=True)
class StreamingGraphEdge(GraphEdge):
    """An edge whose values (one per producer iteration) are buffered and cut into
    chunks under ``policy``. Two shapes:

    - ``topology=PartitionTopology(src_walk, dst_walk)``: each chunk runs one instance of
      ``dst_walk`` (a chunk walk) whose INPUT edge named like the stream receives it.
    - no topology: ``dst`` is a node of another Loop of the same walk, already running (a
      Talker decode loop fed by a Thinker loop). Each iteration of ``dst`` takes the next
      chunk (``NodeCall.chunk`` says which), waits while none is there, and once the
      producer has finished and every chunk is taken it fires without the input (the name
      is absent from ``NodeCall.inputs``), until its own loop stops. Back-pressure: the
      producer's loop waits while ``max_ahead`` of its chunks are not yet taken.
    """

    policy: ChunkPolicy = field(default_factory=lambda: FixedChunks(1))
    topology: PartitionTopology | None = None
    max_ahead: int = 16  # chunks a producer may run ahead of a running loop taking them

    def __post_init__(self) -> None:
        if self.max_ahead < 1:
            raise ValueError(f"StreamingGraphEdge.max_ahead must be >= 1, got {self.max_ahead}")

    @property
    def streaming(self) -> bool:
        return True


# --- walk bodies ----------------------------------------------------------------------


@dataclass(frozen=True)
class Sequential:
    steps: tuple[Step, ...]

    def __init__(self, *steps: Step):
        object.__setattr__(self, "steps", tuple(steps))


@dataclass(frozen=True)
class Parallel:
    branches: tuple[Step, ...]

    def __init__(self, *branches: Step):
        object.__setattr__(self, "branches", tuple(branches))


@dataclass(frozen=True)
class Loop:
    """Runs ``body`` up to ``max_iters`` times. ``stop_node`` (a node of the body) may
    end it early: its submodule's ``check_stop`` says so. Edges leaving the loop fire
    when it ends; those named in ``accumulate`` carry all iterations' values
    concatenated along dim 0 instead of the last one."""

    body: Step
    max_iters: int
    stop_node: str | None = None
    accumulate: frozenset[str] = frozenset()
    name: str = "loop"


Step = str | Sequential | Parallel | Loop


@dataclass(frozen=True)
class Walk:
    name: str
    body: Step
    edges: tuple[GraphEdge, ...]

    def __init__(self, name: str, body: Step, edges: list[GraphEdge] | tuple[GraphEdge, ...]):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "body", body)
        object.__setattr__(self, "edges", tuple(edges))


class GraphError(ValueError):
    """A graph that cannot run; the message says what to fix."""
