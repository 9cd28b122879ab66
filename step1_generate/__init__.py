"""Step 1: text generation by re-running the whole sequence for every new token (no cache)."""

from .engine import LLMEngine
from .llm import LLM
from .sampling_params import Logprob, SamplingParams
from .sequence import CompletionOutput, RequestMetrics, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "LLMEngine",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
