"""scripts/autotune_results.py against a real dump: the autotuning results the engine's XLA wrote
on an H200 (results/one_stream/xla_tilings/engine_autotune.textproto). Editing one fusion's
tiling must change that fusion's fields and nothing else in the file."""
import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DUMP = ROOT / "results" / "one_stream" / "xla_tilings" / "engine_autotune.textproto"


def _module():
    spec = importlib.util.spec_from_file_location("autotune_results", ROOT / "scripts" / "autotune_results.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ar():
    return _module()


def test_parse_counts_and_tilings(ar):
    entries = ar.parse_entries(DUMP.read_text())
    backends = [e.backend for e in entries]
    assert len(entries) == 94
    assert backends.count("TRITON") == 6 and backends.count("NATIVE_EMITTER") == 78
    assert len({e.fingerprint for e in entries}) == len(entries)
    thin = [e for e in entries if e.backend == "TRITON" and e.config["block_n"] == 8]
    assert len(thin) == 5   # the decode step's 8-row matmuls
    assert all({"block_m", "block_k", "num_stages", "num_warps"} <= e.config.keys() for e in thin)


def test_set_triton_changes_one_entry_only(ar):
    text = DUMP.read_text()
    before = ar.parse_entries(text)
    target = next(e for e in before if e.backend == "TRITON" and e.config["block_k"] == 16)
    edited = ar.set_triton(text, target.fingerprint,
                           ar.parse_triton("block_m: 64 block_n: 8 block_k: 32 num_stages: 4 num_warps: 4"))
    after = ar.parse_entries(edited)
    assert [e.fingerprint for e in after] == [e.fingerprint for e in before]
    for b, a in zip(before, after):
        if b.fingerprint == target.fingerprint:
            assert a.config == dict(b.config, block_m=64, block_k=32, num_stages=4, num_warps=4)
        else:
            assert (a.backend, a.config) == (b.backend, b.config)
            assert edited[a.start:a.end] == text[b.start:b.end]
    # The edit rewrites numbers in place: every line is kept.
    assert edited.count("\n") == text.count("\n")


def test_bad_edits_name_the_field(ar):
    text = DUMP.read_text()
    native = next(e for e in ar.parse_entries(text) if e.backend == "NATIVE_EMITTER")
    with pytest.raises(ValueError, match="fingerprint"):
        ar.set_triton(text, "0" * 32, {"block_m": 64})
    with pytest.raises(ValueError, match="fingerprint"):
        ar.set_triton(text, native.fingerprint, {"block_m": 64})
    with pytest.raises(ValueError, match="triton"):
        ar.parse_triton("block_m: 64 block_n: 8")
