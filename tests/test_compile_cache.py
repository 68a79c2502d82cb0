"""The persistent compilation cache: on by default, movable, switchable off; a second
process compiles nothing the first one compiled."""
import json
import os
import subprocess
import sys
import pytest

from paxkv.runner import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_resolution_order(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.resolve_cache_dir() == os.path.join(str(tmp_path), "paxkv", "xla")
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env"))
    assert compile_cache.resolve_cache_dir() == str(tmp_path / "env")
    assert compile_cache.resolve_cache_dir(str(tmp_path / "arg")) == str(tmp_path / "arg")
    monkeypatch.setenv(compile_cache.ENV_VAR, "off")
    assert compile_cache.resolve_cache_dir() is None
    assert compile_cache.resolve_cache_dir(None) is None
    assert compile_cache.resolve_cache_dir("off") is None


@pytest.mark.slow
def test_second_process_compiles_nothing(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "measure_startup.py"), "--model=tiny",
           f"--out_dir={tmp_path}", "--processes=2"]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=600)
    runs = json.load(open(tmp_path / "startup.json"))["runs"]
    assert runs[0]["cache_misses"] > 0
    assert runs[1]["cache_misses"] == 0
    assert runs[1]["cache_hits"] >= runs[0]["cache_misses"]


def test_the_cache_is_bounded_and_off_for_sharded_cpu_programs(tmp_path):
    import jax
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_compilation_cache_max_size)
    try:
        assert compile_cache.enable_compilation_cache(str(tmp_path)) == str(tmp_path)
        assert jax.config.jax_compilation_cache_max_size == compile_cache.MAX_CACHE_BYTES > 0
        assert compile_cache.enable_compilation_cache(str(tmp_path), sharded_on_cpu=True) is None
        assert jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_max_size", before[1])
        compile_cache.enable_compilation_cache(before[0] or "off")
