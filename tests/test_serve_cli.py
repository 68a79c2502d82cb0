"""`paxkv serve` flags: one per LLM(...) engine argument, under vLLM's spelling."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tomllib

from paxkv.engine_args import EngineArgs
from paxkv.serve.cli import build_parser
from serve_helpers import ROOT


def test_every_llm_argument_is_a_flag():
    parser, names = build_parser()
    defaults_of = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    wanted = [n for n in defaults_of if n not in ("model", "params", "tokenizer")]
    assert sorted(names) == sorted(wanted)
    args = parser.parse_args(["llama3-8b", "--max-num-seqs", "8", "--no-enable-prefix-caching",
                              "--kv-cache-dtype", "int8", "--gpu-memory-utilization", "0.5",
                              "--num-gpu-blocks-override", "100"])
    assert args.model == "llama3-8b" and args.max_num_seqs == 8
    assert args.enable_prefix_caching is False and args.kv_cache_dtype == "int8"
    assert args.gpu_memory_utilization == 0.5 and args.num_gpu_blocks_override == 100
    defaults = parser.parse_args([])
    for n in wanted:
        assert getattr(defaults, n) == defaults_of[n], n
    assert (defaults.host, defaults.port) == ("127.0.0.1", 8000)


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("PAXKV_API_KEY", "from-env")
    parser, _ = build_parser()
    assert parser.parse_args([]).api_key == "from-env"
    assert parser.parse_args(["--api-key", "flag"]).api_key == "flag"


def test_console_script_and_module_entry_points():
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["scripts"]["paxkv"] == "paxkv.cli:main"
    for dep in ("fastapi", "uvicorn", "pydantic>=2", "prometheus-client"):
        assert dep in project["dependencies"], dep
    for cmd in (["-m", "paxkv.cli", "serve", "--help"], ["-m", "paxkv.serve", "--help"]):
        out = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 0, out.stderr
        assert "--max-num-seqs" in out.stdout and "--no-enable-prefix-caching" in out.stdout
