"""Step 1: text generation by re-running the whole sequence for every new token (no cache)."""

from .engine import LLM, RequestMetrics, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "RequestMetrics", "RequestOutput", "SamplingParams"]
