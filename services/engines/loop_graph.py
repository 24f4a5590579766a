"""A fixed-shape loop, all of its iterations, replayed as one CUDA graph per batch bucket.

Composite models run fixed-shape inner loops: flow-matching denoise steps (10-50 Euler steps
of an action expert or an image latent), world-model rollout steps. ``LoopGraphs.run`` runs

    state = inputs
    for i in range(iterations):
        out = body(state, i)
        state = {**constants, **{name: out[name] for name in carried}}
    return out                                      # the last iteration's outputs, all of them

where ``constants`` are the inputs not named in ``carried``. On CUDA the whole loop is one graph
replay: a batch of B rows runs in the graph of the smallest bucket >= B, captured on first use
for that bucket and input signature (names, per-row shapes, dtypes). Its static input buffers
get the B rows and, in the rows past B, copies of row B-1 (real values, so a norm of a padded
row is no 0/0). A B larger than every bucket, a non-CUDA device or ``buckets=()`` runs the
same loop eagerly.

What the body may rely on, and what it must not do:
- ``i`` is a Python int during capture, so anything the body derives from it on the host
  (flow time t = 1 - i*dt, a row of a step table) is frozen into the graph: that is the point.
  Anything else that must change between runs has to be an input tensor.
- Rows are independent: padded rows run through the body too, and only the first B rows come
  back. A body that mixes rows (a reduction over dim 0) would see the padding.
- The inputs it receives are read-only: they are the caller's tensors (eager) or the graph's
  static buffers, which are refilled only at the next run.
- It must be capturable (no host syncs such as ``.item()``, no data-dependent shapes). A capture
  that fails raises; there is no silent eager fallback.

Outputs' lifetime: ``run`` never returns views of this object's buffers. Graph outputs are
cloned out of the graph's static outputs, so a caller may keep them across runs; eager outputs
are the body's own last return values. Replays run on the caller's current stream; one
``LoopGraphs`` must not run from two streams or threads at once (its graphs share one memory
pool and their static buffers). Several ``LoopGraphs`` that never run at the same time (one
thread's) may share that pool (``pool``): their graphs' intermediates then take the memory once.

Captures happen on first use, while other threads of the process may be running CUDA work (a
node group steps each engine on a thread of its own): they run in ``thread_local`` capture mode,
as torch.compile's CUDA-graph trees do, so another thread's allocation or host sync neither
fails nor breaks the capture (``global``, torch's default, would fail both).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from mstar.services.engines.batch import h2d

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)
#: Whole-loop runs on a side stream before a capture (lazy inits, cuBLAS workspaces, autotuning)
WARMUP_RUNS = 2

Body = Callable[[dict[str, torch.Tensor], int], dict[str, torch.Tensor]]
#: (name, per-row shape, dtype) of each input, sorted by name
Signature = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


class CaptureFailed(RuntimeError):
    """Capturing a bucket's graph failed (the body itself ran in the warm-up): the same loop can
    still run eagerly (``buckets = ()``)."""


@dataclass
class LoopGraphStats:
    graph_replays: int = 0  # runs served by a captured graph
    eager_runs: int = 0  # runs of the eager loop (no bucket fits, non-CUDA device, or no buckets)
    captures: int = 0  # graphs captured (one per bucket and input signature)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # static, [bucket, ...]
    outputs: dict[str, torch.Tensor]  # the last iteration's, [bucket, ...], in the shared pool


def copy_padded(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:B] = src`` and every row of ``dst`` past B a copy of row B-1 (B = ``len(src)``)."""
    rows = src.shape[0]
    if dst.is_cuda and src.device.type == "cpu" and not src.is_pinned():
        # from a private pinned copy, asynchronously: a copy from pageable memory first waits for
        # all the work queued on the stream, a host sync in every step that uploads an input
        dst[:rows].copy_(src.pin_memory(), non_blocking=True)
    else:
        dst[:rows].copy_(src)  # blocking: a caller's pinned ``src`` may be reused as soon as run() returns
    if rows < dst.shape[0]:
        dst[rows:].copy_(dst[rows - 1:rows].expand_as(dst[rows:]))


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` padded to ``rows`` rows the way a graph's static inputs are (a new tensor)."""
    out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    copy_padded(out, x)
    return out


def _describe(sig: Signature) -> str:
    return ", ".join(f"{n}:{list(s)} {str(d).removeprefix('torch.')}" for n, s, d in sig)


class LoopGraphs:
    def __init__(self, body: Body, iterations: int, carried: tuple[str, ...], device: torch.device | str,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, name: str = "loop", pool=None):
        """``body(state, i)`` returns a dict with at least every ``carried`` name (same shape and
        dtype as its input); ``buckets``: the batch sizes graphs are captured for (``()``: always
        eager); ``pool``: a ``torch.cuda.graph_pool_handle()`` shared with other ``LoopGraphs``
        that never run at the same time as this one (None: its own, made at the first capture)."""
        if isinstance(carried, str):
            raise TypeError(f"loop '{name}': carried must be a tuple of names, e.g. ('{carried}',), not a str")
        if iterations < 1:
            raise ValueError(f"loop '{name}': iterations must be >= 1, got {iterations}")
        if len(set(carried)) != len(carried):
            raise ValueError(f"loop '{name}': carried names repeat: {list(carried)}")
        if any(not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(f"loop '{name}': buckets must be positive ints, got {list(buckets)}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"loop '{name}': device {self.device} but torch.cuda is not available")
        self.body, self.iterations, self.carried, self.name = body, iterations, tuple(carried), name
        self.buckets = tuple(sorted(set(buckets)))
        self.stats = LoopGraphStats()
        self._graphs: dict[tuple[int, Signature], _Graph] = {}
        self._pool = pool  # torch.cuda.graph_pool_handle(), else made at the first capture

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def bucket(self, rows: int) -> int | None:
        """The graph bucket ``rows`` rows run in (None: eager)."""
        if self.device.type != "cuda":
            return None
        return next((b for b in self.buckets if b >= rows), None)

    def warm(self, example: Mapping[str, torch.Tensor]) -> None:
        """On CUDA, run ``example`` (one row's inputs, no batch dim) once at every bucket: each
        bucket's graph (and whatever the body compiles) made before any request needs it. Elsewhere
        nothing (no graphs to make)."""
        for rows in self.buckets if self.device.type == "cuda" else ():
            self.run({k: v.unsqueeze(0).expand(rows, *v.shape) for k, v in example.items()})

    def run(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The body's outputs of the last iteration, B rows each (B = the inputs' dim 0)."""
        rows = self._check_inputs(inputs)
        bucket = self.bucket(rows)
        if bucket is None:
            self.stats.eager_runs += 1
            with torch.no_grad():
                return self._loop({k: h2d(v, self.device) for k, v in inputs.items()}, rows)
        sig = tuple(sorted((k, tuple(v.shape[1:]), v.dtype) for k, v in inputs.items()))
        g = self._graphs.get((bucket, sig))
        if g is None:
            g = self._graphs[(bucket, sig)] = self._capture(bucket, sig, inputs)
        with torch.inference_mode():  # the static buffers are inference tensors
            for k, buf in g.inputs.items():
                copy_padded(buf, inputs[k])
            g.graph.replay()
        self.stats.graph_replays += 1
        # cloned outside inference mode: fresh, ordinary tensors that the next replay leaves alone
        return {k: v[:rows].clone() for k, v in g.outputs.items()}

    def _loop(self, inputs: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
        constants = {k: v for k, v in inputs.items() if k not in self.carried}
        state, out = dict(inputs), {}
        for i in range(self.iterations):
            out = self.body(state, i)
            self._check_outputs(out, state, rows, i)
            state = {**constants, **{k: out[k] for k in self.carried}}
        return out

    @torch.inference_mode()
    def _capture(self, bucket: int, sig: Signature, inputs: Mapping[str, torch.Tensor]) -> _Graph:
        t0 = time.perf_counter()
        with torch.cuda.device(self.device):
            static = {k: torch.empty((bucket, *s), dtype=d, device=self.device) for k, s, d in sig}
            for k, buf in static.items():  # real values for the warm-up
                copy_padded(buf, inputs[k])
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):  # a body error surfaces here, before any capture
                    self._loop(static, bucket)
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    outputs = self._loop(static, bucket)
            except Exception as e:
                raise CaptureFailed(f"loop '{self.name}': capturing bucket {bucket} ({_describe(sig)}) failed: "
                                   f"{e}") from e
        self.stats.captures += 1
        log.info("loop '%s': captured %d iterations for bucket %d (%s) in %.3f s; %d graphs", self.name,
                 self.iterations, bucket, _describe(sig), time.perf_counter() - t0, len(self._graphs) + 1)
        return _Graph(graph, static, outputs)

    def _check_inputs(self, inputs: Mapping[str, torch.Tensor]) -> int:
        if not inputs:
            raise ValueError(f"loop '{self.name}': no inputs")
        for k, v in inputs.items():
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                raise ValueError(f"loop '{self.name}': input '{k}' must be a tensor with a batch dim 0, got "
                                 f"{type(v).__name__}{list(v.shape) if isinstance(v, torch.Tensor) else ''}")
        rows = {k: v.shape[0] for k, v in inputs.items()}
        if len(set(rows.values())) > 1:
            raise ValueError(f"loop '{self.name}': inputs have different batch sizes (dim 0): "
                             + ", ".join(f"{k}={n}" for k, n in rows.items()))
        missing = [k for k in self.carried if k not in inputs]
        if missing:
            raise ValueError(f"loop '{self.name}': carried {missing} not among the inputs ({', '.join(inputs)})")
        n = next(iter(rows.values()))
        if n == 0:
            raise ValueError(f"loop '{self.name}': the inputs have no rows")
        return n

    def _check_outputs(self, out: object, state: dict[str, torch.Tensor], rows: int, i: int) -> None:
        where = f"loop '{self.name}': body output at iteration {i}"
        if not isinstance(out, dict):
            raise TypeError(f"{where} is a {type(out).__name__}, not a dict of tensors")
        for k in self.carried:
            if k not in out:
                raise ValueError(f"{where} lacks carried '{k}' (it returned {', '.join(out) or 'nothing'})")
            got, want = out[k], state[k]
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                shown = f"{list(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__
                raise ValueError(f"{where}: carried '{k}' is {shown}, its input is {list(want.shape)} {want.dtype}")
        for k, v in out.items():
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != rows:
                shown = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"{where}: '{k}' is {shown}, not a tensor of {rows} rows in dim 0")
