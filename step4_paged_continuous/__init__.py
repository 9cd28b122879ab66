"""Step 4: a paged KV cache and continuous batching, with preemption by recompute."""

from .block_manager import BlockManager
from .engine import LLMEngine
from .kv_cache import PagedKVCache
from .llm import LLM
from .sampling_params import Logprob, RequestOutputKind, SamplingParams
from .scheduler import Scheduler, SchedulerStats
from .sequence import CompletionOutput, RequestMetrics, RequestOutput

__all__ = [
    "LLM",
    "BlockManager",
    "CompletionOutput",
    "LLMEngine",
    "Logprob",
    "PagedKVCache",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "Scheduler",
    "SchedulerStats",
]
