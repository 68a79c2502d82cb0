"""JAX's persistent compilation cache, on by default: a second process compiles nothing
the first one compiled.

The directory is, in order: the `compilation_cache_dir` argument of `LLM`, the environment
variable `PAXKV_COMPILATION_CACHE_DIR`, or `$XDG_CACHE_HOME/paxkv/xla` (`~/.cache/paxkv/xla`).
The value "off" (argument or variable) switches it off. JAX by default skips programs that
compile in under a second; paxkv caches those too, so small models restart fast as well.
The cache is bounded (`MAX_CACHE_BYTES`), which also makes concurrent processes take JAX's
file lock around each entry.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("paxkv")

OFF = "off"
ENV_VAR = "PAXKV_COMPILATION_CACHE_DIR"
# JAX writes an entry in place and reads it back without a lock unless the cache is bounded,
# and a process that reads an entry another is still writing aborts inside XLA (several
# engines, a server and its benchmark, or parallel test runs share one directory). A bound
# turns JAX's file lock on, and keeps the directory from growing without end (least recently
# used entries go first).
MAX_CACHE_BYTES = 8 * 2**30


def default_cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "paxkv", "xla")


def resolve_cache_dir(requested: str | None = "auto") -> str | None:
    """The directory to use, or None when the cache is off."""
    if requested is None or requested == OFF:
        return None
    if requested != "auto":
        return os.fspath(requested)
    env = os.environ.get(ENV_VAR)
    if env:
        return None if env == OFF else env
    return default_cache_dir()


def enable_compilation_cache(requested: str | None = "auto", sharded_on_cpu: bool = False) -> str | None:
    """Point JAX's persistent cache at the resolved directory (once per process).

    `sharded_on_cpu`: the programs will be split over several CPU devices or processes (the
    tests of tensor parallelism); the cache stays off for them, a precaution. The segfault
    that first put it off (inside a compile that writes the cache) was later found to be
    the test process running out of memory maps (tests/conftest.py), not the cache.
    """
    import jax
    from jax._src import compilation_cache

    path = None if sharded_on_cpu else resolve_cache_dir(requested)
    current = jax.config.jax_compilation_cache_dir
    if current == path:
        return path
    if path is None:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()
        return None
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
    # A process that compiled before the cache was configured has already decided not to
    # use one; let it look again.
    compilation_cache.reset_cache()
    logger.info("persistent compilation cache: %s", path)
    return path
