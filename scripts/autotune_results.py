"""Read and edit the autotuning results XLA dumps (`--xla_gpu_dump_autotune_results_to=F.textproto`),
to give one fusion a tiling of our choosing and load the file back
(`--xla_gpu_load_autotune_results_from=F.textproto`).

XLA's override flag forces one tiling on every matmul of a program; the decode step wants one
tiling for one fusion (down's, `results/one_stream.md`, "XLA's own tilings"). The dump names
fusions only by fingerprint, so a fusion is told apart by the fingerprints two dumps share:
the engine's, and a probe's whose only matmul is the one wanted
(`probe_xla_gemm_tilings.py --dump_autotune`).

    python3 scripts/autotune_results.py list ENGINE.textproto
    python3 scripts/autotune_results.py common ENGINE.textproto PROBE.textproto
    python3 scripts/autotune_results.py set ENGINE.textproto --fingerprint FP \
        --triton "block_m: 128 block_n: 8 block_k: 32 num_stages: 4 num_warps: 4" --out EDITED.textproto
    python3 scripts/autotune_results.py fusions HLO_DUMP_DIR [--rows 8]
    python3 scripts/autotune_results.py thin ENGINE.textproto --tma [--stages 5] --out EDITED.textproto

`thin` edits every Triton entry whose tiling has `block_n` rows (8: the one-stream decode
step's matmuls) at once: Hopper's TMA copies allowed (`is_tma_allowed`, which XLA's autotuner
picks for some of them in some processes and not in others) and/or another stage count.

`fusions` is the other way to tell the entries apart: it reads the optimized HLO that
`--xla_dump_to=DIR --xla_dump_hlo_as_text` writes in the same process as the results dump and
prints each matmul fusion of the given row count with its projection (from the op name), its
split of K, its output tile and contracting tile (block_m, block_k), warps and stages. These
name its entry in the results dump (`GemmFusion.matches`) unless another fusion of the module
was given the same tiling, which happens (one engine process gave all four layer matmuls
one). Both edit and listing are tested against real H200 dumps
(tests/test_autotune_results.py); results/one_stream.md ("XLA's tilings in the engine") has
the edited files loaded back into the engine. Plain text handling, no JAX: the formats are the
ones JAX 0.11.2's XLA writes (`entries { key { target { hlo_fingerprint } } value {
optimal_config { backend, backend_config { triton {...} } } } }`, and the
`block_level_fusion_config` of `__triton_nested_gemm_fusion` in the HLO).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import sys

_FIELD = re.compile(r"(\w+):\s*(\d+)")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One fusion's result: where it sits in the text, its fingerprint, backend and config."""

    fingerprint: str
    backend: str
    config: dict[str, int]
    start: int
    end: int


def _block_end(text: str, open_brace: int) -> int:
    """Index just past the brace that closes the one at `open_brace`."""
    depth = 0
    for i in range(open_brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError("unbalanced braces in the autotune results")


def parse_entries(text: str) -> list[Entry]:
    """Every `entries { ... }` block of a dump, in order."""
    out = []
    for m in re.finditer(r"(?m)^entries \{", text):
        end = _block_end(text, m.end() - 1)
        block = text[m.start():end]
        fp = re.search(r'hlo_fingerprint: "(\w+)"', block)
        backend = re.search(r"backend: (\w+)", block)
        if fp is None or backend is None:
            raise ValueError(f"an entry at offset {m.start()} has no fingerprint or backend")
        cfg = block.split("backend_config", 1)[1] if "backend_config" in block else ""
        out.append(Entry(fp.group(1), backend.group(1),
                         {k: int(v) for k, v in _FIELD.findall(cfg)}, m.start(), end))
    return out


def parse_triton(spec: str) -> dict[str, int]:
    """`"block_m: 128 block_n: 8 ..."` -> {"block_m": 128, ...}."""
    fields = {k: int(v) for k, v in _FIELD.findall(spec)}
    missing = {"block_m", "block_n", "block_k", "num_stages", "num_warps"} - fields.keys()
    if missing:
        raise ValueError(f"triton: missing {sorted(missing)} in {spec!r}")
    return fields


def set_triton(text: str, fingerprint: str, fields: dict[str, int]) -> str:
    """The dump with `fingerprint`'s Triton tiling fields replaced by `fields` (the others
    kept); ValueError if no Triton entry has that fingerprint."""
    entries = [e for e in parse_entries(text) if e.fingerprint == fingerprint]
    if not entries:
        raise ValueError(f"fingerprint: {fingerprint!r} is not in the autotune results")
    if len(entries) > 1 or entries[0].backend != "TRITON":
        raise ValueError(f"fingerprint: {fingerprint!r} is not exactly one Triton entry "
                         f"({[e.backend for e in entries]})")
    e = entries[0]
    unknown = set(fields) - set(e.config)
    if unknown:
        raise ValueError(f"triton: fields {sorted(unknown)} are not in the dumped tiling "
                         f"({sorted(e.config)})")
    return text[:e.start] + _with_triton_fields(text[e.start:e.end], fields) + text[e.end:]


def _with_triton_fields(block: str, fields: dict[str, int]) -> str:
    """One entry's text with the numeric fields of its `triton { }` tiling that `fields` names
    replaced in place (every line kept)."""
    tri = re.search(r"triton \{", block)
    tri_end = _block_end(block, tri.end() - 1)
    body = block[tri.end():tri_end - 1]
    new_body = _FIELD.sub(lambda m: f"{m.group(1)}: {fields.get(m.group(1), int(m.group(2)))}", body)
    return block[:tri.end()] + new_body + block[tri_end - 1:]


def set_thin(text: str, block_n: int, tma: bool, stages: int | None) -> tuple[str, int]:
    """The dump with every Triton entry of `block_n` rows given TMA (`tma`) and `stages`
    stages (None: kept) -> (edited text, entries edited). ValueError if none has `block_n`."""
    if stages is not None and stages < 1:
        raise ValueError(f"stages: must be >= 1, got {stages}")
    out, edited, pos = [], 0, 0
    for e in parse_entries(text):
        if e.backend != "TRITON" or e.config.get("block_n") != block_n:
            continue
        block = text[e.start:e.end]
        if stages is not None:
            block = _with_triton_fields(block, {"num_stages": stages})
        if tma and "is_tma_allowed" not in block:
            block = re.sub(r"(\n(\s*)num_ctas: \d+\n)", r"\1\2is_tma_allowed: true\n", block, count=1)
        out += [text[pos:e.start], block]
        pos = e.end
        edited += 1
    if not edited:
        raise ValueError(f"block_n: no Triton entry has block_n {block_n}")
    return "".join(out) + text[pos:], edited


def describe(e: Entry) -> str:
    """One line per entry: fingerprint, backend, tiling fields."""
    return " ".join([e.fingerprint, e.backend] + [f"{k}={v}" for k, v in e.config.items()])


# Which projection a matmul fusion computes, from the op name JAX gave its dot.
_PROJECTION_BY_OP_NAME = (("o_proj", "o"), ("down_proj", "down"), ("self_attn/dot_general", "qkv"),
                          ("mlp/dot_general", "gate_up"), ("lm_head", "lm_head"))


@dataclasses.dataclass(frozen=True)
class GemmFusion:
    """One Triton matmul fusion of an optimized HLO module, as compiled."""

    projection: str
    output_shape: tuple[int, ...]
    split_k: int          # the leading axis XLA's split-K rewrite added (1: not split)
    num_warps: int
    num_stages: int
    output_tile: tuple[int, ...]
    block_k: int | None   # the dot's contracting tile

    def matches(self, entry: Entry) -> bool:
        """Whether an autotune entry's Triton tiling is the one this fusion was compiled with."""
        return (entry.backend == "TRITON" and entry.config.get("block_m") == max(self.output_tile)
                and entry.config.get("block_k") == self.block_k
                and entry.config.get("num_warps") == self.num_warps
                and entry.config.get("num_stages") == self.num_stages)


def _computation_body(text: str, name: str) -> str:
    """The text of computation `name` (`%name (...) -> ... {` up to its closing line)."""
    m = re.search(r"(?m)^" + re.escape(name) + r" .*?^\}", text, re.S)
    return m.group(0) if m else ""


def gemm_fusions(hlo_text: str, rows: int | None = None) -> list[GemmFusion]:
    """Every `__triton_nested_gemm_fusion` of one module's optimized HLO whose output has
    `rows` rows (all when None), one per projection (the layers repeat the first)."""
    out: dict[str, GemmFusion] = {}
    for line in hlo_text.splitlines():
        s = line.strip()
        if not s.startswith("%") or "__triton_nested_gemm_fusion" not in s or " fusion(" not in s:
            continue
        dims = tuple(int(d) for d in re.search(r"= \w+\[([\d,]*)\]", s).group(1).split(",") if d)
        if rows is not None and dims[-2] != rows:
            continue
        op = re.search(r'op_name="([^"]*)"', s)
        projection = next((p for key, p in _PROJECTION_BY_OP_NAME if op and key in op.group(1)),
                          op.group(1) if op else "?")
        if projection in out:
            continue
        config = json.loads(s.split("backend_config=", 1)[1])
        block = config["fusion_backend_config"]["block_level_fusion_config"]
        body = _computation_body(hlo_text, re.search(r"calls=(%[\w.\-]+)", s).group(1))
        dot = next((l for l in body.splitlines() if " dot(" in l), "")
        k_tile = re.search(r'backend_config=\{"sizes":\["(\d+)"\]\}', dot)
        out[projection] = GemmFusion(projection, dims, dims[0] if len(dims) == 3 else 1,
                                     int(block["num_warps"]), int(block["num_stages"]),
                                     tuple(int(v) for v in block["output_tiles"][0]["sizes"]),
                                     int(k_tile.group(1)) if k_tile else None)
    return list(out.values())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_list = sub.add_parser("list", help="every entry: fingerprint, backend, tiling")
    p_list.add_argument("dump")
    p_common = sub.add_parser("common", help="the entries two dumps share, by fingerprint")
    p_common.add_argument("dump")
    p_common.add_argument("other")
    p_set = sub.add_parser("set", help="give one Triton entry another tiling")
    p_set.add_argument("dump")
    p_set.add_argument("--fingerprint", required=True)
    p_set.add_argument("--triton", required=True)
    p_set.add_argument("--out", required=True)
    p_thin = sub.add_parser("thin", help="every entry of one row count: TMA and/or stages")
    p_thin.add_argument("dump")
    p_thin.add_argument("--block_n", type=int, default=8)
    p_thin.add_argument("--tma", action="store_true")
    p_thin.add_argument("--stages", type=int, default=None)
    p_thin.add_argument("--out", required=True)
    p_fus = sub.add_parser("fusions", help="the matmul fusions of an optimized-HLO dump")
    p_fus.add_argument("hlo_dir")
    p_fus.add_argument("--rows", type=int, default=8)
    args = ap.parse_args(argv)
    if args.cmd == "fusions":
        for path in sorted(glob.glob(os.path.join(args.hlo_dir, "*after_optimizations.txt"))):
            with open(path) as f:
                for g in gemm_fusions(f.read(), args.rows):
                    print(os.path.basename(path).split(".")[0], g.projection, "out", list(g.output_shape),
                          "split_k", g.split_k, "tile", list(g.output_tile), "block_k", g.block_k,
                          "warps", g.num_warps, "stages", g.num_stages)
        return
    with open(args.dump) as f:
        text = f.read()
    if args.cmd in ("list", "common"):
        shared = None
        if args.cmd == "common":
            with open(args.other) as f:
                shared = {e.fingerprint for e in parse_entries(f.read())}
        for e in parse_entries(text):
            if shared is None or e.fingerprint in shared:
                print(describe(e))
    elif args.cmd == "thin":
        edited_text, edited = set_thin(text, args.block_n, args.tma, args.stages)
        with open(args.out, "w") as f:
            f.write(edited_text)
        print("wrote", args.out, "with", edited, "entries edited", file=sys.stderr)
    else:
        with open(args.out, "w") as f:
            f.write(set_triton(text, args.fingerprint, parse_triton(args.triton)))
        print("wrote", args.out, file=sys.stderr)


if __name__ == "__main__":
    main()
