"""OpenAI-compatible HTTP server: `paxkv serve MODEL` (FastAPI + uvicorn, Prometheus metrics)."""
