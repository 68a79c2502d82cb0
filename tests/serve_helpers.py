"""Start `python3 -m paxkv.serve` as a subprocess on a free 127.0.0.1 port, for the server tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compile_cache_env(cache_dir: str) -> dict[str, str]:
    """Environment that makes JAX keep compiled programs in `cache_dir` (CPU included): the
    server subprocess and the in-process reference LLM compile the same step programs."""
    return {"JAX_COMPILATION_CACHE_DIR": cache_dir, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def use_compile_cache(cache_dir: str) -> None:
    """The same for this process (takes effect if nothing has compiled yet here)."""
    import jax
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


class ServerProcess:
    """A live server; `url` is its base address. Stops (SIGTERM, then SIGKILL) on `stop()`."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 startup_timeout: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="paxkv-serve-", delete=False)
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in
                                                  full_env.get("PYTHONPATH", "").split(os.pathsep) if p])
        full_env.setdefault("JAX_PLATFORMS", "cpu")
        full_env.update(env or {})
        cmd = [sys.executable, "-m", "paxkv.serve", *args, "--host", "127.0.0.1",
               "--port", str(self.port), "--disable-uvicorn-access-log"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self._wait_healthy(startup_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-6000:]

    def metric(self, name: str) -> float:
        """One unlabelled sample of /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10.0).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
