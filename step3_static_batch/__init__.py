"""Step 3: static batching: many requests decoded together, left-padded, with a batched KV cache."""

from .engine import LLM, RequestMetrics, RequestOutput
from .kv_cache import KVCache
from .sampling import SamplingParams

__all__ = ["KVCache", "LLM", "RequestMetrics", "RequestOutput", "SamplingParams"]
