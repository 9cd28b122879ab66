"""Step 2: generation with a KV cache: prefill the prompt once, then decode one token per forward pass."""

from .engine import LLM, RequestMetrics, RequestOutput
from .kv_cache import KVCache
from .sampling import SamplingParams

__all__ = ["KVCache", "LLM", "RequestMetrics", "RequestOutput", "SamplingParams"]
