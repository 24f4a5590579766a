"""CUDA-graph capture and replay of decode steps, one graph per batch-size bucket.

A decode batch of n sequences is padded to the smallest bucket >= n; padded rows read and
write scratch page 0. Before each replay the step's token ids, positions and cache slots are
copied into the graph's static buffers and FlashInfer re-plans into its fixed page-table
buffers (outside the graph). Each bucket has two graphs used in turn, so the plan for step
N+1 (whose host staging buffer FlashInfer reuses) never races step N still queued on the
device. Needs CUDA and FlashInfer; ``graphs_unavailable_reason`` says why not otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from mstar.services.engines.batch import SeqSlice, build_step_inputs, upload_stream
from mstar.services.engines.kernels import TORCH_OPS, Ops
from mstar.services.engines.kv_cache import PagedKVCache
from mstar.services.engines.layers import ForwardContext
from mstar.services.engines.pdl import PDL_MODES, pdl_unavailable_reason

log = logging.getLogger(__name__)

#: decode-graph buckets: the engine captures those below its max_num_seqs and max_num_seqs itself
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)


def table_pages(num_pages: int, batch_size: int) -> int:
    """Page-table entries a graph of ``batch_size`` rows may be planned with: every page of the cache
    once, plus scratch page 0 for each padded row (a full cache and a padded batch at once: a batch of
    400 on an H100, padded to 448, once asked for 7,070 entries of a 7,021-page cache)."""
    return num_pages + batch_size


#: Decode attention inside the graphs (``EngineConfig.graph_attention``): 'auto' runs the fused
#: Triton kernel (RoPE + K/V store + split-KV attention, ``attn_triton.py``) when triton imports,
#: else FlashInfer; 'flashinfer' / 'triton' force one. On an H100 the Triton kernel beat FlashInfer's
#: graph decode + RoPE + store at every batch (1-64) and context (192-4096) measured
#: (bench/results/engines/decode_attn_split.json).
GRAPH_ATTENTION = ("auto", "flashinfer", "triton")

#: Decode graphs without RMSNorm kernels (``EngineConfig.fused_norms``, ``ForwardContext.fused_norms``):
#: 'auto' where the model allows it (``fused_norms_unavailable_reason``) and the graphs run the
#: fused Triton attention, 'on' (an error where it cannot), 'off'.
FUSED_NORMS = ("auto", "on", "off")

#: The fused-norm graphs' down projection + residual add (``EngineConfig.down_gemm``,
#: ``ForwardContext.triton_down``): 'auto' one Triton kernel (``gemm_triton.linear_add_``) in the
#: graphs that skip the norm kernels, for batches up to its ``MAX_ROWS``; 'triton' (an error where
#: the graphs keep their norm kernels); 'cublas' (addmm).
DOWN_GEMM = ("auto", "triton", "cublas")
#: The same choices for those graphs' qkv and o_proj + residual add (``EngineConfig.proj_gemm``,
#: ``ForwardContext.triton_proj``; ``gemm_triton.linear`` / ``linear_add_``, weights row-major).
#: Alone the Triton kernels are no faster than cuBLAS; they let the next kernel launch early (pdl.py).
PROJ_GEMM = DOWN_GEMM


def triton_unavailable_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton does not import ({e})"
    return None


def graphs_unavailable_reason(device: torch.device, backend_name: str) -> str | None:
    if device.type != "cuda":
        return f"device is {device}, not CUDA"
    if backend_name != "flashinfer":
        return f"attention backend '{backend_name}' cannot be captured (FlashInfer is)"
    return None


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, ids, positions, slots, backend, out):
        self.graph, self.ids, self.positions, self.slots, self.backend, self.out = (
            graph, ids, positions, slots, backend, out,
        )
        self.done = torch.cuda.Event()  # recorded after each replay that uploads on the side: its inputs may be rewritten


class DecodeGraphs:
    def __init__(self, model, cache: PagedKVCache, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                 copies: int = 2, ops: Ops = TORCH_OPS, attention: str = "auto", min_split_tokens: int | None = None,
                 fused_norms: str = "auto", down_gemm: str = "auto", pdl: str = "auto", proj_gemm: str = "auto"):
        """``attention``: decode attention inside the graphs: 'flashinfer', 'triton' (the fused
        kernel) or 'auto' (Triton when it imports, else FlashInfer). ``min_split_tokens``: the
        fused kernel's per-step split rule (``TritonGraphDecode.min_split_tokens``; None: its
        default). ``fused_norms``: one of ``FUSED_NORMS``; ``down_gemm``: one of ``DOWN_GEMM`` (with the
        Triton kernel the model's down weights are stored row-major, the layout it streams);
        ``proj_gemm``: one of ``PROJ_GEMM`` (likewise for qkv / o_proj); ``pdl``: one of ``PDL_MODES``."""
        from mstar.services.engines.attn_flashinfer import WORKSPACE_BYTES, FlashInferGraphDecode

        if attention not in GRAPH_ATTENTION:
            raise ValueError(f"graph_attention '{attention}' is not one of {', '.join(GRAPH_ATTENTION)}")
        no_triton = triton_unavailable_reason() if attention != "flashinfer" else None
        if attention == "triton" and no_triton:
            raise RuntimeError(f"graph_attention='triton': {no_triton}")
        if attention == "auto" and no_triton:
            log.info("decode graphs use FlashInfer attention only: %s", no_triton)
        use_triton = attention != "flashinfer" and not no_triton
        if fused_norms not in FUSED_NORMS:
            raise ValueError(f"fused_norms '{fused_norms}' is not one of {', '.join(FUSED_NORMS)}")
        why_not = None
        if fused_norms != "off":
            why_not = ("the graphs' attention is FlashInfer, which applies no row scales" if not use_triton
                       else getattr(model, "fused_norms_unavailable_reason", lambda: "the model has no fused-norm path")())
            if why_not and fused_norms == "on":
                raise RuntimeError(f"fused_norms='on': {why_not}")
            if why_not:
                log.info("decode graphs keep their RMSNorm kernels: %s", why_not)
        self.fused_norms = fused_norms != "off" and why_not is None
        # graphs of up to this many rows run the Triton down projection / qkv and o_proj
        self._down_rows = self._triton_gemm_rows(model, "down_gemm", down_gemm, ("down_proj",))
        self._proj_rows = self._triton_gemm_rows(model, "proj_gemm", proj_gemm, ("qkv_proj", "o_proj"))
        if pdl not in PDL_MODES:
            raise ValueError(f"pdl '{pdl}' is not one of {', '.join(PDL_MODES)}")
        no_pdl = None
        if pdl != "off":
            no_pdl = (pdl_unavailable_reason(cache.device) if self.fused_norms
                      else "the graphs keep their RMSNorm kernels, which are not programmatic dependents")
            if no_pdl and pdl == "on":
                raise RuntimeError(f"pdl='on': {no_pdl}")
            if no_pdl:
                log.info("decode graphs launch no kernel as a programmatic dependent: %s", no_pdl)
        self.pdl = pdl != "off" and no_pdl is None
        self.model, self.cache, self.ops = model, cache, ops
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.copies = copies
        dev = cache.device
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)  # scratch, stream-ordered
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._turn = 0
        self._last: _Graph | None = None
        pool = None
        for bs in reversed(self.batch_sizes):  # largest first, so smaller graphs reuse its pool
            for copy in range(copies):
                if use_triton:
                    from mstar.services.engines.attn_triton import TritonGraphDecode

                    backend = TritonGraphDecode(model.config.heads, dev, cache.spec.dtype, cache.page_size, bs,
                                                table_pages(cache.allocator.num_pages, bs))
                    if min_split_tokens is not None:
                        backend.min_split_tokens = min_split_tokens
                    backend.pdl = self.pdl
                else:
                    backend = FlashInferGraphDecode(
                        model.config.heads, dev, cache.spec.dtype, cache.page_size, bs,
                        table_pages(cache.allocator.num_pages, bs), workspace,
                    )
                g = self._capture(bs, backend, pool)
                pool = g.graph.pool()
                self._graphs[(bs, copy)] = g
        self.attention = {bs: self._graphs[(bs, 0)].backend.name for bs in self.batch_sizes}
        log.info("captured decode CUDA graphs for batch sizes %s (x%d), attention %s, fused norms %s, Triton down "
                 "projection %s, programmatic dependent launches %s", self.batch_sizes, copies, self.attention,
                 self.fused_norms, self.triton_down, self.pdl)

    def _triton_gemm_rows(self, model, option: str, choice: str, projections: tuple[str, ...]) -> int:
        """Rows up to which the fused-norm graphs run ``projections`` as Triton GEMMs (0: cuBLAS)
        for ``option`` = ``choice`` (one of ``DOWN_GEMM``); stores their weights row-major, the
        layout the kernels stream."""
        if choice not in DOWN_GEMM:
            raise ValueError(f"{option} '{choice}' is not one of {', '.join(DOWN_GEMM)}")
        if choice == "triton" and not self.fused_norms:
            raise RuntimeError(f"{option}='triton': the graphs keep their RMSNorm kernels (fused_norms is off or "
                               "unavailable), and the Triton projections add into the fused-norm residual stream")
        if choice == "cublas" or not self.fused_norms:
            return 0
        from mstar.services.engines.gemm_triton import MAX_ROWS
        from mstar.services.engines.layers import set_weight_layout

        for name in projections:
            set_weight_layout(model, column_major=False, only=name)
        return MAX_ROWS

    @torch.inference_mode()
    def _capture(self, bs: int, backend, pool) -> _Graph:
        dev = self.cache.device
        ids = torch.zeros(bs, dtype=torch.long, device=dev)
        positions = torch.zeros(bs, dtype=torch.long, device=dev)
        slots = torch.zeros(bs, dtype=torch.long, device=dev)
        backend.plan(build_step_inputs(self.cache, [], pad_to=bs).attn)
        ctx = ForwardContext(backend, self.cache.kv, slots, self.ops, fused_norms=self.fused_norms,
                             triton_down=bs <= self._down_rows, pdl=self.pdl, triton_proj=bs <= self._proj_rows)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels (and lazy inits) outside the capture
                self.model(self.model.embed(ids), positions, ctx)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.model(self.model.embed(ids), positions, ctx)
        return _Graph(graph, ids, positions, slots, backend, out)

    @property
    def triton_down(self) -> bool:
        """Some graphs run the down projection + residual add as one Triton kernel."""
        return self._down_rows > 0

    def bucket(self, num_seqs: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= num_seqs), None)

    def prepare(self, slices: Sequence[SeqSlice]):
        """Padded step inputs for a one-token-per-sequence batch (None: no bucket fits)."""
        bs = self.bucket(len(slices))
        return None if bs is None else build_step_inputs(self.cache, slices, pad_to=bs)

    def replay(self, inputs, token_ids: torch.Tensor) -> torch.Tensor:
        """Replay the graph of ``inputs``' bucket. Its positions, slots and (Triton attention) page
        table go up on the upload stream once the graph's previous replay is done with them; the
        compute stream waits for them just before the replay, and meanwhile runs what is queued."""
        self._turn = (self._turn + 1) % self.copies
        g = self._graphs[(inputs.padded_rows, self._turn)]
        n = inputs.num_rows
        main = torch.cuda.current_stream()
        side = g.backend.name == "triton-graph"  # its plan is three copies; FlashInfer's plans on the compute stream
        up = upload_stream(main.device) if side else main
        if side:
            up.wait_event(g.done)
        with torch.cuda.stream(up):
            g.positions.copy_(inputs.positions.pin_memory(), non_blocking=True)  # pinned: no wait on the device
            g.slots.copy_(inputs.attn.slots.pin_memory(), non_blocking=True)
            g.backend.plan(inputs.attn)
        if side:
            main.wait_stream(up)
        g.ids[:n].copy_(token_ids, non_blocking=True)
        g.ids[n:].zero_()
        g.graph.replay()
        if side:
            g.done.record(main)
        self._last = g
        return g.out[:n]

    def replay_last(self) -> None:
        """Replay the latest graph on its inputs as they stand (benchmarks: the forward's device
        time without re-planning; it rewrites the same K/V slots)."""
        if self._last is None:
            raise RuntimeError("replay_last before any replay")
        self._last.graph.replay()
