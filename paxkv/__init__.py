"""paxkv: vLLM's PagedAttention serving engine, reimplemented in JAX and Pallas."""
import logging as _logging
import os as _os

# Start-up prints nothing a user cannot act on: JAX's note that it found no TPU library, its
# cache reset line, and transformers' note that PyTorch is absent (only its tokenizers are
# used) are kept out of every program's output. (Set TRANSFORMERS_VERBOSITY to see the last.)
for _name in ("jax._src.xla_bridge", "jax._src.compilation_cache"):
    _logging.getLogger(_name).setLevel(_logging.WARNING)
_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
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
