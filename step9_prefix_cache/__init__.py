"""Step 9: requests that share a prefix share its KV blocks (chained block hashes, reference counts, LRU
eviction, copy-on-write), on top of step 8."""

from .api_server import build_app
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
    "build_app",
]
