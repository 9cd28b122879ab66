"""Step 3: static batching: many requests decoded together, left-padded, with a batched KV cache."""

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
