"""FlashInfer paged attention (CUDA only; imported lazily, so CPU hosts never need it).

Uses the plan/run API of flashinfer 0.7.x: ``BatchDecodeWithPagedKVCacheWrapper`` when every
sequence has one query token, ``BatchPrefillWithPagedKVCacheWrapper`` otherwise (chunked
prefill, attend-without-append blocks, multi-token appends). KV layout is NHD, K and V passed
as a tuple of [num_pages, page_size, Hkv, D] tensors.

Both wrappers run the fa2 tensor-core kernels by default: decode with tensor cores and
prefill share one JIT module (one compile on a fresh host instead of two).
"""

from __future__ import annotations

import importlib.util

import torch

from mstar.services.engines.attention import AttentionBatch, HeadShape

WORKSPACE_BYTES = 128 * 1024 * 1024
#: Decode attention in captured graphs: FlashInfer's tensor-core (fa2 prefill) kernel, else its
#: CUDA-core decode kernel (a JIT module of its own; 0.05-0.09 ms slower per 28-layer step on an
#: H100 at 24/8 heads, bench/results/engines).
GRAPH_DECODE_TENSOR_CORES = True
#: Graphs of at least this many sequences run without split-KV: batch x kv_heads CTAs already fill
#: the GPU, and the split's merge kernel is one more launch per layer (0.08-0.10 ms a step at
#: batch 16 / 64). Smaller batches keep the split, which long contexts need.
GRAPH_DECODE_NO_SPLIT_FROM = 16


def flashinfer_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def _import_flashinfer():
    try:
        import flashinfer
    except ImportError as e:  # pragma: no cover - depends on the host
        raise RuntimeError(
            "attention='flashinfer' needs the flashinfer package (pip install flashinfer-python, "
            "or unpack .fi/flashinfer-site.tar.xz onto PYTHONPATH)"
        ) from e
    return flashinfer


class FlashInferAttention:
    name = "flashinfer"

    def __init__(
        self,
        heads: HeadShape,
        device: torch.device,
        dtype: torch.dtype,
        page_size: int,
        prefill_backend: str = "fa2",
        decode_tensor_cores: bool = True,
    ):
        if device.type != "cuda":
            raise RuntimeError(f"FlashInfer attention needs a CUDA device, got '{device}'")
        fi = _import_flashinfer()
        self.heads, self.dtype, self.page_size = heads, dtype, page_size
        self._decode = fi.BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device), "NHD",
            use_tensor_cores=decode_tensor_cores,
        )
        self._prefill = fi.BatchPrefillWithPagedKVCacheWrapper(
            torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device), "NHD", backend=prefill_backend
        )
        self._active = None

    def plan(self, batch: AttentionBatch) -> None:
        h, t = self.heads, batch.table
        if batch.is_decode:
            self._decode.plan(
                t.kv_indptr, t.kv_indices, t.kv_last_page_len,
                h.num_qo_heads, h.num_kv_heads, h.head_dim, self.page_size,
                q_data_type=self.dtype, kv_data_type=self.dtype,
            )
            self._active = self._decode
        else:
            self._prefill.plan(
                batch.qo_indptr, t.kv_indptr, t.kv_indices, t.kv_last_page_len,
                h.num_qo_heads, h.num_kv_heads, h.head_dim, self.page_size,
                causal=batch.causal, q_data_type=self.dtype, kv_data_type=self.dtype,
            )
            self._active = self._prefill

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        if self._active is None:
            raise RuntimeError("FlashInferAttention.run before plan")
        return self._active.run(q, (k_cache, v_cache))


class FlashInferGraphDecode:
    """Decode attention for one CUDA-graph batch size: fixed device buffers the graph reads,
    refilled by ``plan`` (outside the graph) before every replay."""

    name = "flashinfer-graph"

    def __init__(self, heads: HeadShape, device: torch.device, dtype: torch.dtype, page_size: int,
                 batch_size: int, max_pages: int, workspace: torch.Tensor):
        fi = _import_flashinfer()
        self.heads, self.dtype, self.page_size, self._device = heads, dtype, page_size, device
        self.split_kv = batch_size < GRAPH_DECODE_NO_SPLIT_FROM
        i32 = dict(dtype=torch.int32, device=device)
        self._wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=GRAPH_DECODE_TENSOR_CORES,
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, **i32),
            paged_kv_indices_buffer=torch.zeros(max_pages, **i32),
            paged_kv_last_page_len_buffer=torch.zeros(batch_size, **i32),
        )

    def plan(self, batch: AttentionBatch) -> None:
        """Non-blocking, so it can run while the previous step is still on the device: host
        tables pinned, page ids sent ahead (a pageable or host-side ``indices`` would make
        FlashInfer copy synchronously and wait for the device)."""
        h, t = self.heads, batch.table
        indices = t.kv_indices.pin_memory().to(self._device, non_blocking=True)
        self._wrapper.plan(
            t.kv_indptr.pin_memory(), indices, t.kv_last_page_len.pin_memory(),
            h.num_qo_heads, h.num_kv_heads, h.head_dim, self.page_size,
            q_data_type=self.dtype, kv_data_type=self.dtype, non_blocking=True,
            disable_split_kv=not self.split_kv,
        )

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return self._wrapper.run(q, (k_cache, v_cache))
