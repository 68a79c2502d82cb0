"""paxkv: vLLM's PagedAttention serving engine, reimplemented in JAX and Pallas."""
__version__ = "0.1.0"
