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

The edit is tested against a real dump (tests/test_autotune_results.py); loading an edited
file back into the engine on the GPU has not been run yet (the next step that
results/one_stream.md names). Plain text handling, no JAX: the format is the one JAX
0.11.2's XLA writes (`entries { key { target { hlo_fingerprint } } value { optimal_config {
backend, backend_config { triton {...} } } } }`).
"""
from __future__ import annotations

import argparse
import dataclasses
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
    block = text[e.start:e.end]
    tri = re.search(r"triton \{", block)
    tri_end = _block_end(block, tri.end() - 1)
    body = block[tri.end():tri_end - 1]
    unknown = set(fields) - set(e.config)
    if unknown:
        raise ValueError(f"triton: fields {sorted(unknown)} are not in the dumped tiling "
                         f"({sorted(e.config)})")
    new_body = _FIELD.sub(lambda m: f"{m.group(1)}: {fields.get(m.group(1), int(m.group(2)))}", body)
    new_block = block[:tri.end()] + new_body + block[tri_end - 1:]
    return text[:e.start] + new_block + text[e.end:]


def describe(e: Entry) -> str:
    """One line per entry: fingerprint, backend, tiling fields."""
    return " ".join([e.fingerprint, e.backend] + [f"{k}={v}" for k, v in e.config.items()])


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
    args = ap.parse_args(argv)
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
    else:
        with open(args.out, "w") as f:
            f.write(set_triton(text, args.fingerprint, parse_triton(args.triton)))
        print("wrote", args.out, file=sys.stderr)


if __name__ == "__main__":
    main()
