"""The KV-cache engine: a decoder-only transformer over the paged cache.

Two ways in:
- scheduled generation (autoregressive nodes): ``add_request`` / ``step`` / ``release``;
  each ``step`` is schedule -> execute -> update, with continuous batching, chunked prefill,
  preemption, sampling, and on CUDA graph replay and pipelined decode;
- direct passes (denoising loops, CFG branches, world-model rollouts): ``forward(items)``,
  each item naming a (request, label) cache and whether its tokens' K/V persist.
``release(request_id)`` frees every page the request holds under every label.
Hand-off (prefill on one engine, decode on another with the same weights): ``export_kv`` on
the sender, ``import_request`` on the receiver, which continues the request as if it had
computed those tokens itself.

Pipelined decode (``overlap``): when every sequence of step N decodes and nothing waits,
step N+1 is launched from step N's sampled tokens while they are still on the device; the
host then reads step N's tokens and updates the scheduler while the GPU runs step N+1. Rows of
N+1 whose sequence finished at N are dropped; their K/V write lands past the committed length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mstar.services.engines.attention import make_backend
from mstar.services.engines.batch import (
    SeqSlice,
    StagedRows,
    StepInputs,
    build_step_inputs,
    download_stream,
    h2d,
)
from mstar.services.engines.cuda_graphs import (
    DEFAULT_BATCH_SIZES,
    DOWN_GEMM,
    FUSED_NORMS,
    GRAPH_ATTENTION,
    PROJ_GEMM,
    DecodeGraphs,
    graphs_unavailable_reason,
)
from mstar.services.engines.direct import ForwardItem, run_direct
from mstar.services.engines.kernels import make_ops
from mstar.services.engines.kv_cache import PagedKVCache
from mstar.services.engines.model_runner import ModelRunner, PagedDecoder
from mstar.services.engines.pages import OutOfPages
from mstar.services.engines.pdl import PDL_MODES
from mstar.services.engines.sampling import Sampler, SamplingParams
from mstar.services.engines.scheduler import (
    ScheduledChunk,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SeqEvent,
)
from mstar.services.engines.sequence import SeqStatus
from mstar.services.engines.sequence import Sequence as Seq

log = logging.getLogger(__name__)
#: EngineConfig.fused_sampler -> Sampler(fused=...)
FUSED_SAMPLER = {"auto": None, "on": True, "off": False}
#: EngineConfig.prefill_attention's values (FlashInfer's prefill backends)
PREFILL_ATTENTION = ("fa2", "fa3", "auto")
__all__ = ["EngineConfig", "EngineStats", "ForwardItem", "KVCacheEngine", "StepFailed"]


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    kv_cache_bytes: int | None = None  # None: gpu_memory_fraction of free memory (CUDA only)
    gpu_memory_fraction: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # the longest sequence (prompt + output tokens) served: the cache must hold one, and a longer
    # one is aborted (the placement YAML's max_seq_len); None: up to the whole cache
    max_seq_len: int | None = None
    attention: str = "auto"  # auto | torch | flashinfer
    # FlashInfer's kernels for passes of several new tokens a sequence: fa2 (one JIT module with
    # the decode kernel: one compile on a fresh host) | fa3 (Hopper) | auto (FlashInfer's pick:
    # fa3 on Hopper). Long non-causal blocks (BAGEL's flow steps) run faster on fa3
    prefill_attention: str = "fa2"
    cuda_graphs: bool = True  # decode graphs; off (and logged) where unavailable
    overlap: bool = True  # pipelined decode: launch step N+1 before reading step N; CUDA only
    graph_batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    kernels: str = "auto"  # auto | torch | flashinfer: RMSNorm / RoPE / SiLU·mul (kernels.py)
    # decode attention inside CUDA graphs: auto (the fused Triton RoPE + K/V store + split-KV
    # attention kernel when triton imports, else FlashInfer) | flashinfer | triton
    graph_attention: str = "auto"
    # the fused kernel's split-KV: a step uses as many of its graph's splits as give the longest
    # sequence at least this many cached tokens each (0: always all of them)
    attention_min_split_tokens: int = 128
    # token ids the engine's requests usually draw from (half-open ranges): a step whose rows all
    # carry allowed-token ranges inside them computes logits for these ids only (an audio
    # codebook in a large text vocabulary: the head reads a fraction of its weight)
    head_ranges: tuple[tuple[int, int], ...] = ()
    # steps whose rows all draw from small allowed sets, or over the full vocabulary without
    # top-k / top-p, sample in Triton kernels (sample_triton.py): auto (on CUDA when triton
    # imports) | on | off (the torch sampler)
    fused_sampler: str = "auto"
    # decode graphs without RMSNorm kernels (the norm weights folded into the projections, each
    # row's 1/rms applied by the attention and SiLU·mul kernels, residual adds inside the o_proj /
    # down GEMMs): auto (where the model and graph attention allow) | on | off
    fused_norms: str = "auto"
    # the down projection + residual add of those graphs (batches <= gemm_triton.MAX_ROWS): auto
    # (one Triton kernel where fused_norms is on) | triton (an error where it cannot) | cublas
    down_gemm: str = "auto"
    # the Triton kernels of those graphs (attention, SiLU·mul, down) launched as programmatic
    # dependents of the kernel ahead (pdl.py): auto (sm_90+ with a Triton that has it) | on | off
    pdl: str = "auto"
    # qkv and o_proj (+ residual add) of those graphs (batches <= gemm_triton.MAX_ROWS): auto
    # (Triton kernels where fused_norms is on) | triton | cublas
    proj_gemm: str = "auto"

    def __post_init__(self) -> None:
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"EngineConfig.prefill_attention: '{self.prefill_attention}' is not one of "
                             f"{', '.join(PREFILL_ATTENTION)}")
        if self.graph_attention not in GRAPH_ATTENTION:
            raise ValueError(f"EngineConfig.graph_attention: '{self.graph_attention}' is not one of "
                             f"{', '.join(GRAPH_ATTENTION)}")
        if self.attention_min_split_tokens < 0:
            raise ValueError(f"EngineConfig.attention_min_split_tokens must be >= 0, got {self.attention_min_split_tokens}")
        if self.fused_norms not in FUSED_NORMS:
            raise ValueError(f"EngineConfig.fused_norms: '{self.fused_norms}' is not one of {', '.join(FUSED_NORMS)}")
        if self.down_gemm not in DOWN_GEMM:
            raise ValueError(f"EngineConfig.down_gemm: '{self.down_gemm}' is not one of {', '.join(DOWN_GEMM)}")
        if self.proj_gemm not in PROJ_GEMM:
            raise ValueError(f"EngineConfig.proj_gemm: '{self.proj_gemm}' is not one of {', '.join(PROJ_GEMM)}")
        if self.pdl not in PDL_MODES:
            raise ValueError(f"EngineConfig.pdl: '{self.pdl}' is not one of {', '.join(PDL_MODES)}")
        if self.fused_sampler not in FUSED_SAMPLER:
            raise ValueError(f"EngineConfig.fused_sampler: '{self.fused_sampler}' is not one of {', '.join(FUSED_SAMPLER)}")


@dataclass
class EngineStats:
    steps: int = 0  # forward passes launched by step()
    graph_steps: int = 0  # of which replayed from a CUDA graph
    pipelined_steps: int = 0  # of which launched before the previous step's tokens were read
    preemptions: int = 0
    sampled_tokens: int = 0  # drawn, including rows dropped after their sequence finished


class StepFailed(RuntimeError):
    """The forward pass of a step raised; its requests were released."""

    def __init__(self, request_ids: list[str]):
        super().__init__(f"engine step failed; released requests {request_ids}")
        self.request_ids = request_ids


@dataclass(frozen=True)
class _Launched:
    """A step whose device work is queued and whose tokens are not read yet."""

    out: SchedulerOutput
    sampling: tuple[int, ...]  # indices of the chunks that sample
    tokens: torch.Tensor  # sampled ids on the model's device, one per sampling chunk
    host: torch.Tensor  # their host copy, valid after wait()
    wait: Callable[[], None]


class KVCacheEngine:
    def __init__(self, model: PagedDecoder, config: EngineConfig = EngineConfig(),
                 clock: Callable[[], float] = time.monotonic, tp=None, page_group=None):
        """``tp``: this process's ``TensorParallel`` rank for a model loaded with it. Rank 0
        is a full engine; the others only mirror its passes (``follow``). ``page_group``: a
        ``TensorParallel`` group of whole engines that make the same passes themselves (a
        sequence-parallel model): their caches get the same number of pages, so a pass that
        runs out of pages fails on every rank alike."""
        p = next(model.parameters())  # type: ignore[attr-defined]
        self.device, self.dtype, self.config, self.clock = p.device, p.dtype, config, clock
        self.tp = tp
        spec = model.config.kv_spec(config.page_size, p.dtype)  # type: ignore[attr-defined]
        self.cache = PagedKVCache.from_budget(spec, p.device, config.kv_cache_bytes, config.gpu_memory_fraction,
                                              tp if tp is not None else page_group)
        backend = make_backend(config.attention, model.config.heads, p.device, p.dtype, config.page_size,
                               config.prefill_attention)
        self.ops = make_ops(config.kernels, p.device, p.dtype)
        why_no_graphs = graphs_unavailable_reason(p.device, backend.name)
        graphs = None
        if config.cuda_graphs and why_no_graphs:
            log.info("CUDA graphs off: %s", why_no_graphs)
        elif config.cuda_graphs:
            # every batch the engine may run replays a graph: the buckets up to the cap, and the cap
            sizes = sorted({min(b, config.max_num_seqs) for b in config.graph_batch_sizes} | {config.max_num_seqs})
            graphs = DecodeGraphs(model, self.cache, sizes, ops=self.ops, attention=config.graph_attention,
                                  min_split_tokens=config.attention_min_split_tokens, fused_norms=config.fused_norms,
                                  down_gemm=config.down_gemm, pdl=config.pdl, proj_gemm=config.proj_gemm)
        self.overlap = config.overlap and p.device.type == "cuda"
        if config.overlap and not self.overlap:
            log.info("overlap scheduling off: device is %s, not CUDA", p.device)
        self.runner = ModelRunner(model, self.cache, backend, graphs, self.ops, tp)
        max_pages = self.cache.allocator.num_usable
        if config.max_seq_len is not None:
            need = -(-config.max_seq_len // config.page_size)
            if need > max_pages:
                raise ValueError(f"the KV cache holds {max_pages * config.page_size} tokens, fewer than one sequence of "
                                 f"max_seq_len={config.max_seq_len}: give it more memory (kv_cache_bytes, "
                                 f"gpu_memory_fraction) or lower max_seq_len")
            max_pages = need
        self.scheduler = Scheduler(self.cache, SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, max_pages))
        self.sampler = Sampler(fused=FUSED_SAMPLER[config.fused_sampler])
        self._sample_rows = StagedRows(p.device)  # the sampler's per-row numbers, uploaded ahead of each step
        self._head_cols = None  # the head_ranges' ids on the device, in column order
        if config.head_ranges:
            vocab = model.config.vocab_size  # type: ignore[attr-defined]
            hr = config.head_ranges
            if any(not 0 <= a < b <= vocab for a, b in hr) or any(b1 > a2 for (_, b1), (a2, _) in zip(hr, hr[1:], strict=False)):
                raise ValueError(f"EngineConfig.head_ranges: {hr} must be ascending, disjoint and in [0, {vocab})")
            self._head_cols = torch.cat([torch.arange(a, b) for a, b in config.head_ranges]).to(p.device)
        self._inside_head: dict[int, tuple[bool, tuple]] = {}  # id(allowed ranges) -> (inside?, kept alive)
        self.stats = EngineStats()
        self._inflight: _Launched | None = None
        if p.device.type == "cuda":  # the fused full-vocabulary sampler compiles now, not on the first request
            # (H100, bench/results/orpheus/2026-11-25/: that request's first window 2.0 s before, 95 ms after)
            self.warm_sampler([SamplingParams(seed=0)])

    @property
    def cuda_graphs(self) -> bool:
        return self.runner.graphs is not None

    @property
    def model(self) -> PagedDecoder:
        return self.runner.model

    def follow(self) -> None:
        """Tensor-parallel ranks past 0: mirror the leader's passes until it calls ``close``."""
        self.runner.follow()

    def close(self) -> None:
        """Release the followers (the leader's last word to them)."""
        self.runner.stop_followers()

    # -- scheduled generation ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                    key: tuple[str, str] = ("", ""), timeout_s: float | None = None) -> None:
        """Queue a prompt on the request's "main" cache; ``key`` (node, walk) is its fairness
        class; past ``timeout_s`` the request is released and reported FINISHED_ABORTED."""
        params = params or SamplingParams()
        self._refuse_duplicate(request_id)
        deadline = None if timeout_s is None else self.clock() + timeout_s
        self.scheduler.add(Seq(request_id, list(prompt_ids), params, key, deadline=deadline))
        if params.repetition_penalty != 1:
            self.sampler.track(request_id, prompt_ids, self.model.config.vocab_size, self.device)

    def export_kv(self, request_id: str, label: str = "main") -> torch.Tensor:
        """A contiguous copy of the committed K/V of the request's ``label`` sequence,
        [num_layers, 2, length, num_kv_heads, head_dim] in the cache's dtype, on its device.
        Frees nothing (``release`` does). KeyError when there is no such sequence."""
        self._one_rank("export_kv")
        return self.cache.gather(request_id, label)

    def import_request(self, request_id: str, token_ids: Sequence[int], kv: torch.Tensor,
                       params: SamplingParams | None = None, key: tuple[str, str] = ("", ""),
                       timeout_s: float | None = None, num_output_tokens: int = 0) -> None:
        """Queue a request whose first ``kv.shape[2]`` tokens of ``token_ids`` were computed
        by an engine with the same weights (``kv`` from its ``export_kv``), the last
        ``num_output_tokens`` of them sampled there. The K/V go into the cache now (OutOfPages:
        nothing is kept); the next step computes the rest of ``token_ids`` and samples output
        number ``num_output_tokens``, so stops, seeds and the repetition penalty line up with
        an engine that ran the whole request. Preempted, it is recomputed from ``token_ids``."""
        params = params or SamplingParams()
        self._one_rank("import_request")
        self._refuse_duplicate(request_id)
        self.cache.check_kv(kv, f"request {request_id!r}")
        deadline = None if timeout_s is None else self.clock() + timeout_s
        seq = Seq.resumed(request_id, list(token_ids), params, num_output_tokens, kv.shape[2], key, deadline)
        self.cache.scatter(request_id, "main", kv)
        self.scheduler.add(seq)
        if params.repetition_penalty != 1:  # the outputs sampled there count as seen, as here
            self.sampler.track(request_id, seq.token_ids, self.model.config.vocab_size, self.device)

    def _refuse_duplicate(self, request_id: str) -> None:
        if self.scheduler.find(request_id) or self.cache.has_seq(request_id, "main"):
            raise ValueError(f"request {request_id} already holds a 'main' sequence; release it first")

    def _one_rank(self, what: str) -> None:
        if self.tp is not None and self.tp.size > 1:
            raise NotImplementedError(f"{what}: each of the {self.tp.size} tensor-parallel ranks holds its own "
                                      "share of the KV heads; hand-off moves one cache: use tp_size=1 engines")

    @property
    def has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work

    def step(self) -> list[SeqEvent]:
        """Finish one step (launching it first unless it is already in flight) and return its
        events; with ``overlap``, the next step may already be running when this returns."""
        events = self._abort_expired()
        launched, self._inflight = self._inflight, None
        out = launched.out if launched else None
        try:
            if launched is None:
                out = self.scheduler.schedule()
                self.stats.preemptions += len(out.preempted)
                if not out.chunks:
                    return events + self.scheduler.update_from_output(out, [])
                ids = torch.tensor([t for c in out.chunks for t in c.seq.token_ids[c.start : c.start + c.num_tokens]])
                launched = self._launch(out, self._build(out), ids)
            if self.overlap:
                self._inflight = self._launch_next(launched)
            launched.wait()
        except Exception as e:
            outs = [o for o in (out, self._inflight and self._inflight.out) if o]
            failed = sorted({c.seq.request_id for o in outs for c in o.chunks})
            self._inflight = None
            for rid in failed:
                self.release(rid)
            raise StepFailed(failed) from e
        return events + self._complete(launched)

    def release(self, request_id: str) -> None:
        """Finish, cancel, time out or fail: free every page of every label of the request.
        (A step still in flight may write past the freed pages' old contents: it runs before
        any later step on the device, so no live data is touched.)"""
        self.scheduler.abort(request_id)
        self.cache.release(request_id)
        self.sampler.forget(request_id)

    def generate(self, prompts: dict[str, Sequence[int]], params: SamplingParams) -> dict[str, list[int]]:
        """Run prompts to completion (tests, benchmarks); returns output ids per request."""
        for rid, ids in prompts.items():
            self.add_request(rid, ids, params)
        outs: dict[str, list[int]] = {rid: [] for rid in prompts}
        while self.has_work:
            for ev in self.step():
                if ev.token_id is not None:
                    outs[ev.request_id].append(ev.token_id)
                if ev.status.finished:
                    self.release(ev.request_id)
        return outs

    @torch.inference_mode()
    def warm_sampler(self, params: Sequence[SamplingParams]) -> None:
        """Sample once from zero logits with each of ``params`` (a row each), on the path a
        step with those parameters takes (the restricted head's columns when their ranges lie
        inside ``head_ranges``), so what compiles on first use (the fused sampler's compact
        kernel is specialized on the allowed sets' width) compiles at start-up, not while the
        first request's stream and every other one wait. Tracks no sequence and touches no
        cache; unseeded rows draw from the sampler's own stream."""
        if not params:
            return
        in_head = self._head_cols is not None and all(self._in_head(p.allowed_token_ranges) for p in params)
        cols = len(self._head_cols) if in_head else self.model.config.vocab_size
        logits = torch.zeros((len(params), cols), dtype=self.dtype, device=self.device)
        self.sampler(logits, params, counters=list(range(len(params))), columns=self._head_cols if in_head else None)

    # -- direct passes ----------------------------------------------------------------------
    def forward(self, items: Sequence[ForwardItem], causal: bool = True) -> list[torch.Tensor]:
        """One pass over several labelled caches; returns final hidden states per item.

        Causal: each new token sees its cache and the new tokens before it. Non-causal: it
        sees its whole cache and all new tokens of its item (a denoising block, a frame)."""
        return run_direct(self.runner, self.cache, items, causal, self.dtype)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    # -- internals ---------------------------------------------------------------------------
    def _abort_expired(self) -> list[SeqEvent]:
        now = self.clock()
        queued = [s for q in self.scheduler.waiting.values() for s in q]
        expired = sorted({s.request_id for s in self.scheduler.running + queued
                          if s.deadline is not None and s.deadline <= now})
        for rid in expired:
            self.release(rid)
        return [SeqEvent(rid, None, SeqStatus.FINISHED_ABORTED) for rid in expired]

    def _build(self, out: SchedulerOutput) -> StepInputs:
        slices = [SeqSlice(c.seq.request_id, c.seq.label, c.start, c.num_tokens) for c in out.chunks]
        graphs = self.runner.graphs
        padded = graphs.prepare(slices) if graphs is not None and out.is_decode else None
        return padded if padded is not None else build_step_inputs(self.cache, slices)

    @torch.inference_mode()
    def _launch(self, out: SchedulerOutput, inputs: StepInputs, token_ids: torch.Tensor, ahead: int = 0) -> _Launched:
        """Queue the forward pass and the sampling of ``out``; ``ahead`` = outputs sampled
        but not yet added to the sequences (1 for a pipelined step)."""
        sampling = tuple(i for i, c in enumerate(out.chunks) if c.samples)
        seqs = [out.chunks[i].seq for i in sampling]
        index = [s.num_output_tokens + ahead for s in seqs]
        params = [s.params.at_output(i) for s, i in zip(seqs, index, strict=True)]
        keys = [s.request_id for s in seqs]
        head = self._head_cols is not None and all(self._in_head(p.allowed_token_ranges) for p in params)
        columns = self._head_cols if head else None
        vocab = len(columns) if columns is not None else self.model.config.vocab_size
        # the sampler's per-row numbers go up before the forward pass, off the compute stream
        plan = self.sampler.plan(params, vocab, self.device, keys, index, columns)
        per_row = self._sample_rows.put(plan.host)
        try:
            hidden = self.runner.run(inputs, token_ids=token_ids)
            rows = inputs.last_rows()[list(sampling)]
            if torch.equal(rows, torch.arange(len(rows))):  # decode: every row samples, no gather
                hidden = hidden[: len(rows)]
            else:
                hidden = hidden[h2d(rows, self.device)]
            logits = self.model.compute_logits(hidden, self.config.head_ranges if head else ())
            tokens = self.sampler.sample(logits, plan, per_row)
        finally:
            self._sample_rows.read()
        host, wait = _to_host_async(tokens)
        self.stats.steps += 1
        self.stats.graph_steps += int(self.runner.last_run_replayed)
        self.stats.sampled_tokens += len(sampling)
        return _Launched(out, sampling, tokens, host, wait)

    def _in_head(self, ranges: tuple[tuple[int, int], ...]) -> bool:
        """Do these allowed ranges (non-empty) lie inside ``head_ranges``? Cached by identity:
        the same tuples come back every step."""
        hit = self._inside_head.get(id(ranges))
        if hit is None:
            inside = bool(ranges) and all(any(a <= x and y <= b for a, b in self.config.head_ranges) for x, y in ranges)
            hit = self._inside_head[id(ranges)] = (inside, ranges)
        return hit[0]

    def _launch_next(self, prev: _Launched) -> _Launched | None:
        """Step N+1 from step N's tokens still on the device, or None when it cannot be
        known without them (prefill chunks, waiting requests) or when an
        eager FlashInfer wrapper would have to be re-planned while step N still uses it."""
        chunks = prev.out.chunks
        if self.scheduler.num_waiting or len(prev.sampling) != len(chunks):
            return None
        if self.runner.graphs is None and self.runner.backend.name != "torch":
            return None
        keep = [i for i, c in enumerate(chunks) if c.seq.status is SeqStatus.RUNNING
                and c.seq.num_output_tokens + 1 < c.seq.params.max_tokens]  # N's token is not its last
        if not keep:
            return None
        nxt = tuple(ScheduledChunk(chunks[i].seq, chunks[i].start + chunks[i].num_tokens, 1, True) for i in keep)
        try:
            for c in nxt:
                self.cache.reserve(c.seq.request_id, c.seq.label, c.start + 1)
        except OutOfPages:
            return None
        out = SchedulerOutput(nxt)
        ids = prev.tokens if len(keep) == len(chunks) else prev.tokens[h2d(torch.tensor(keep), self.device)]
        launched = self._launch(out, self._build(out), ids, ahead=1)
        self.stats.pipelined_steps += 1
        return launched

    def _complete(self, launched: _Launched) -> list[SeqEvent]:
        """Commit the step's K/V and hand its tokens to the scheduler (after ``wait``)."""
        out = launched.out
        for c in out.chunks:
            if c.seq.status is SeqStatus.RUNNING:  # not finished or released meanwhile
                self.cache.commit(c.seq.request_id, c.seq.label, c.start + c.num_tokens)
        sampled: list[int | None] = [None] * len(out.chunks)
        for i, tok in zip(launched.sampling, launched.host.tolist(), strict=True):
            sampled[i] = tok
        return self.scheduler.update_from_output(out, sampled)


def _to_host_async(tokens: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """Start copying sampled tokens to the host; returns the host tensor and a wait."""
    if tokens.device.type != "cuda":
        return tokens, lambda: None
    down = download_stream(tokens.device)
    down.wait_stream(torch.cuda.current_stream(tokens.device))
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    with torch.cuda.stream(down):
        host.copy_(tokens, non_blocking=True)
    tokens.record_stream(down)  # its memory is not reused before the copy ran
    done = torch.cuda.Event()
    done.record(down)
    return host, done.synchronize
