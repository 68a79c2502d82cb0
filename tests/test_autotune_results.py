"""scripts/autotune_results.py against real dumps: the autotuning results the engine's XLA wrote
on an H200 (results/one_stream/xla_tilings/engine_autotune.textproto), and the optimized HLO
and results one process wrote together. Editing one fusion's tiling must change that fusion's
fields and nothing else in the file; each matmul fusion read from the HLO must find its entry."""
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


def test_thin_edits_every_row_count_entry_and_nothing_else(ar):
    text = DUMP.read_text()
    before = ar.parse_entries(text)
    thin = {e.fingerprint for e in before if e.backend == "TRITON" and e.config.get("block_n") == 8}
    assert len(thin) >= 4          # the layer matmuls and the LM head of the decode step
    edited, count = ar.set_thin(text, 8, tma=True, stages=5)
    assert count == len(thin)
    after = ar.parse_entries(edited)
    assert [e.fingerprint for e in after] == [e.fingerprint for e in before]
    for b, a in zip(before, after):
        block = edited[a.start:a.end]
        if b.fingerprint in thin:
            assert a.config == dict(b.config, num_stages=5)
            assert block.count("is_tma_allowed: true") == 1
        else:
            assert block == text[b.start:b.end]
    # stages kept, TMA only; and an entry that has TMA already is not given it twice
    again, _ = ar.set_thin(edited, 8, tma=True, stages=None)
    assert again == edited


def test_bad_thin_edits_name_the_field(ar):
    text = DUMP.read_text()
    with pytest.raises(ValueError, match="block_n"):
        ar.set_thin(text, 3, tma=True, stages=None)
    with pytest.raises(ValueError, match="stages"):
        ar.set_thin(text, 8, tma=False, stages=0)


# The optimized HLO and the autotune results one engine process dumped together on the H200.
HLO_EXCERPT = ROOT / "results" / "one_stream" / "xla_tilings" / "gemm_fusions_excerpt.hlo.txt"
PAIRED_DUMP = ROOT / "results" / "one_stream" / "xla_tilings" / "engine_autotune_hlo_pair.textproto"


def test_gemm_fusions_read_from_the_engines_hlo(ar):
    fusions = {g.projection: g for g in ar.gemm_fusions(HLO_EXCERPT.read_text(), rows=8)}
    assert set(fusions) == {"qkv", "o", "gate_up", "down", "lm_head"}
    # XLA's split of K (the leading axis of the partial sums) and the output shapes.
    assert {p: g.split_k for p, g in fusions.items()} == {"qkv": 4, "o": 8, "gate_up": 1, "down": 8,
                                                         "lm_head": 1}
    assert fusions["gate_up"].output_shape == (8, 28672) and fusions["lm_head"].output_shape == (8, 128256)
    assert fusions["lm_head"].block_k == 16 and fusions["lm_head"].num_warps == 2
    assert all(g.block_k == 64 and g.num_warps == 4 and g.num_stages == 3
               for p, g in fusions.items() if p != "lm_head")
    assert ar.gemm_fusions(HLO_EXCERPT.read_text(), rows=16) == []
    assert len(ar.gemm_fusions(HLO_EXCERPT.read_text(), rows=None)) == 5


def test_each_fusion_names_its_entry_in_the_same_process_dump(ar):
    entries = ar.parse_entries(PAIRED_DUMP.read_text())
    fusions = {g.projection: g for g in ar.gemm_fusions(HLO_EXCERPT.read_text(), rows=8)}
    lm_head = [e for e in entries if fusions["lm_head"].matches(e)]
    assert len(lm_head) == 1 and lm_head[0].config["block_k"] == 16
    # That process gave the four layer matmuls one tiling: four entries share it, so here the
    # tiling alone cannot tell them apart (the limit the script's docstring states).
    layer = [e for e in entries if fusions["o"].matches(e)]
    assert len(layer) == 4 and all(fusions[p].matches(layer[0]) for p in ("qkv", "gate_up", "down"))
    assert not fusions["lm_head"].matches(layer[0])
