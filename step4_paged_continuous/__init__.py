"""Step 4: a paged KV cache and continuous batching, with preemption by recompute."""

from .block_manager import BlockManager
from .engine import LLM, EngineStats, LLMEngine, RequestMetrics, RequestOutput
from .kv_cache import PagedKVCache
from .sampling import SamplingParams
from .scheduler import Scheduler

__all__ = [
    "BlockManager",
    "EngineStats",
    "LLM",
    "LLMEngine",
    "PagedKVCache",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
]
