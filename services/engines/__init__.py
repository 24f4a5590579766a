"""The engine library: paged KV cache, attention backends, a Llama-architecture decoder,
sampling, a micro-scheduler, and the KV-cache and stateless engines built from them."""

from mstar.services.engines.attention import AttentionBatch, HeadShape, TorchPagedAttention, make_backend
from mstar.services.engines.kv_cache import KVCacheSpec, PagedKVCache, kv_budget_bytes
from mstar.services.engines.kv_engine import EngineConfig, EngineStats, ForwardItem, KVCacheEngine, StepFailed
from mstar.services.engines.llama import LlamaConfig, LlamaForCausalLM
from mstar.services.engines.pages import CsrPageTable, OutOfPages, PageAllocator, build_csr
from mstar.services.engines.sampling import FinishReason, Sampler, SamplingParams
from mstar.services.engines.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, SeqEvent
from mstar.services.engines.sequence import SeqStatus
from mstar.services.engines.stateless import StatelessEngine
from mstar.services.engines.weights import WeightLoadError, load_checkpoint

__all__ = [
    "AttentionBatch", "CsrPageTable", "EngineConfig", "EngineStats", "FinishReason", "ForwardItem",
    "HeadShape", "KVCacheEngine", "KVCacheSpec", "LlamaConfig", "LlamaForCausalLM", "OutOfPages",
    "PageAllocator", "PagedKVCache", "Sampler", "SamplingParams", "Scheduler", "SchedulerConfig",
    "SchedulerOutput", "SeqEvent", "SeqStatus", "StatelessEngine", "StepFailed", "TorchPagedAttention",
    "WeightLoadError", "build_csr", "kv_budget_bytes", "load_checkpoint", "make_backend",
]
