"""paxkv: vLLM's PagedAttention serving engine, reimplemented in JAX and Pallas."""
from paxkv.outputs import CompletionOutput, RequestOutput
from paxkv.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "RequestOutput",
           "CompletionOutput", "RequestOutputKind"]


def __getattr__(name: str):
    # LLM pulls in JAX; keep `import paxkv` cheap for host-only users (scheduler research).
    if name in ("LLM", "LLMEngine"):
        from paxkv import llm
        return getattr(llm, name)
    raise AttributeError(name)
