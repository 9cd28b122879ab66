"""Step 2: generation with a KV cache: prefill the prompt once, then decode one token per forward pass."""

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
