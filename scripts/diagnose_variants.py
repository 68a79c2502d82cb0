"""`diagnose_one_stream.py` with kernel defaults replaced in this process, to A/B tunings in
fresh processes without editing the library.

    PYTHONPATH=. python3 scripts/diagnose_variants.py base
    PYTHONPATH=. python3 scripts/diagnose_variants.py rope2+ppcb2

Variants, joined with "+": `ropeN` (RoPE + KV-write kernel, N warps), `normN` (add + RMSNorm
kernel, N warps), `ppcbN` (decode attention, N pages per loop step), `base` (nothing).
"""
import runpy
import sys


def apply(name: str) -> None:
    """Replace the default that `name` names (see the module docstring)."""
    if name.startswith("rope"):
        import pallas_kernels.layer_ops.rope_kv_write as module
        warps = int(name[4:])
        module.default_num_warps = lambda q_heads, head_dim: warps
    elif name.startswith("norm"):
        import pallas_kernels.layer_ops.add_rms_norm as module
        warps = int(name[4:])
        module.default_num_warps = lambda hidden: warps
    elif name.startswith("ppcb"):
        import pallas_kernels.paged_attention.paged_attention as module
        pages = int(name[4:])
        module.default_pages_per_compute_block = lambda block_size: pages
    elif name != "base":
        raise SystemExit(f"unknown variant {name!r} (ropeN, normN, ppcbN, base)")


if __name__ == "__main__":
    names = sys.argv[1].split("+") if len(sys.argv) > 1 else ["base"]
    for n in names:
        apply(n)
    print("variant", "+".join(names), flush=True)
    sys.argv = ["diagnose_one_stream.py"]
    runpy.run_path("scripts/diagnose_one_stream.py", run_name="__main__")
