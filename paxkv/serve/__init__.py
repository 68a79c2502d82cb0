"""OpenAI-compatible HTTP server: `paxkv serve MODEL` (FastAPI + uvicorn, Prometheus metrics).

Two processes by default, as in vLLM V1: the frontend (cli.py, app.py, engine_client.py:
HTTP, checks, tokenization, detokenization, SSE; no JAX) and the engine process
(engine_core.py: the LLM, stepping without pause), joined by a socket pair (ipc.py; rows and
updates in streams.py). `--no-engine-process`: the engine on a thread instead (engine_loop.py).
"""
