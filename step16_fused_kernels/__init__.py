"""Step 16: fused kernels: a decode step of few sequences in five Triton kernels a layer (the products with
their LayerNorms, bias, GELU, residual and KV write; split-K and programmatic dependent launch as options),
on top of step 15."""

import importlib

# each public name, by the module of this package that defines it; imported when first used (PEP 562), so
# that `python -m <step>` starts its command line before torch loads (and Ctrl-C there exits quietly)
EXPORTS = {
    "api_server": ["build_app"],
    "block_manager": ["BlockManager"],
    "core_client": ["AsyncMPClient", "EngineDeadError", "InprocClient", "SyncMPClient"],
    "engine": ["LLMEngine"],
    "engine_core": ["EngineCore"],
    "kv_cache": ["PagedKVCache"],
    "llm": ["LLM"],
    "messages": ["SchedulerStats"],
    "outputs": ["CompletionOutput", "RequestMetrics", "RequestOutput"],
    "sampling_params": ["Logprob", "RequestOutputKind", "SamplingParams"],
    "scheduler": ["Scheduler"],
}
__all__ = [name for names in EXPORTS.values() for name in names]


def __getattr__(name: str):
    """``from <step> import LLM`` and ``<step>.LLM``: the name, imported from its module on first use."""
    module = next((module for module, names in EXPORTS.items() if name in names), None)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f".{module}", __name__), name)
    return value
