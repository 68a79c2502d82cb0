"""`diagnose_one_stream.py` with kernel defaults replaced in this process, to A/B tunings in
fresh processes without editing the library.

    PYTHONPATH=. python3 scripts/probes/diagnose_variants.py base
    PYTHONPATH=. python3 scripts/probes/diagnose_variants.py rope2+ppcb2
    PYTHONPATH=. python3 scripts/probes/diagnose_variants.py splits1 scripts/profile_step.py --model llama3-8b ...

A second argument names another script to run under the variant (its own arguments follow).

Variants, joined with "+": `ropeapart` (RoPE and the KV write in their own kernel before
decode attention, not inside it), `ropeN` (RoPE + KV-write kernel, N warps), `normN` (add + RMSNorm
kernel, N warps), `ppcbN` (decode attention, N pages per loop step), `splitsN` (decode
attention, N splits of each sequence's pages; 1 skips the combine kernel), `dstagesN` (decode
attention, N pipeline stages where they fit), `dwarpsN` (the fused RoPE + decode attention
kernel, N warps), `xlanorm`,
`xlarope`, `xlacombine` (that fused Pallas kernel replaced by the XLA ops it fuses), `xlasmall`
(all three), `siluexp`, `silutanh` (SwiGLU's sigmoid written as `1 / (1 + exp(-x))` or
through tanh instead of XLA's logistic, which decides what XLA may fuse into the down
matmul), `base` (nothing). XLA flags go in XLA_FLAGS as usual.
"""
import importlib
import os
import runpy
import sys


def _module(name: str):
    """The module itself: `import a.b.c as m` would bind the jitted function that the
    package's `__init__` exports under the module's own name."""
    return importlib.import_module(name)


def apply(name: str) -> None:
    """Replace the default that `name` names (see the module docstring)."""
    if name == "ropeapart":
        module = _module("paxkv.model.attention")
        module.PagedAttention.fuses_rope_decode = lambda *args, **kwargs: False
    elif name.startswith("rope"):
        module = _module("pallas_kernels.layer_ops.rope_kv_write")
        warps = int(name[4:])
        module.default_num_warps = lambda q_heads, head_dim: warps
    elif name.startswith("norm"):
        module = _module("pallas_kernels.layer_ops.add_rms_norm")
        warps = int(name[4:])
        module.default_num_warps = lambda hidden: warps
    elif name.startswith("ppcb"):
        module = _module("pallas_kernels.paged_attention.paged_attention")
        pages = int(name[4:])
        module.default_pages_per_compute_block = lambda block_size: pages
    elif name.startswith("dwarps"):
        import functools
        module = _module("pallas_kernels.paged_attention")
        module.rope_paged_attention = functools.partial(module.rope_paged_attention,
                                                        num_warps=int(name[6:]))
    elif name.startswith("dstages"):
        paging = _module("pallas_kernels.paged_attention.paging")
        fit, stages = paging.fit_num_stages, int(name[7:])
        paging.fit_num_stages = lambda requested, default, **kw: fit(requested, stages, **kw)
    elif name.startswith("splits"):
        module = _module("pallas_kernels.paged_attention.paged_attention")
        splits = int(name[6:])
        module.choose_num_splits = lambda *args, **kwargs: splits
    elif name in ("xlanorm", "xlarope", "xlacombine", "xlasmall"):
        if name in ("xlanorm", "xlasmall"):
            _module("pallas_kernels.layer_ops.add_rms_norm").supported = lambda hidden: False
        if name in ("xlarope", "xlasmall"):
            _module("pallas_kernels.layer_ops.rope_kv_write").supported = lambda *args: False
        if name in ("xlacombine", "xlasmall"):
            from pallas_kernels.paged_attention.combine import combine_splits
            _module("pallas_kernels.paged_attention.paged_attention").combine_splits_kernel = (
                lambda o_part, lse, out_dtype=None, interpret=False:
                combine_splits(o_part, lse).astype(out_dtype))
    elif name in ("siluexp", "silutanh"):
        import flax.linen as nn
        import jax.numpy as jnp
        if name == "siluexp":
            nn.silu = lambda x: x / (1 + jnp.exp(-x))
        else:
            nn.silu = lambda x: x * (0.5 + 0.5 * jnp.tanh(0.5 * x))
    elif name != "base":
        raise SystemExit(f"unknown variant {name!r} (see the docstring)")


if __name__ == "__main__":
    names = sys.argv[1].split("+") if len(sys.argv) > 1 else ["base"]
    for n in names:
        apply(n)
    source = _module("pallas_kernels.paged_attention.paged_attention").__file__
    print("variant", "+".join(names), "from", os.path.relpath(source), flush=True)
    script = sys.argv[2] if len(sys.argv) > 2 else "scripts/probes/diagnose_one_stream.py"
    sys.argv = [script] + sys.argv[3:]
    runpy.run_path(script, run_name="__main__")
