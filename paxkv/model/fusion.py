"""The serving layout of the weights: q/k/v and gate/up projections fused into one matmul each.

Checkpoints store `q_proj`, `k_proj`, `v_proj` and `gate_proj`, `up_proj` as separate
matrices that all read the same activations. Left separate, a decode step runs five thin
matmuls per layer where two would do, and XLA's dot merger may fuse them anyway by
concatenating the weights on every step (on an H200 at batch 256 that copy cost more than
the attention kernels). Fusing once at load time, as vLLM's merged linear layers do, gives
each layer two wide matmuls and no per-step copies.

Layout (per layer, replacing the separate kernels):
    self_attn/qkv_proj/kernel   [hidden, (num_heads + 2 * num_kv_heads) * head_dim]
    mlp/gate_up_proj/kernel     [hidden, 2 * intermediate_size]
The network in `layers.py` accepts either layout; checkpoint export (`weights.hf_tensors`)
reads either.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from paxkv.config import ModelConfig

Params = Any

# Fused kernel name -> (the block holding it, the separate projections it replaces, in
# column order).
FUSED: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
}
FUSED_PARTS = frozenset(p for _, parts in FUSED.values() for p in parts)


def is_fused(params: Params) -> bool:
    """Whether `params` is in the serving layout (layer 0 decides)."""
    return "qkv_proj" in params.get("layers_0", {}).get("self_attn", {})


def part_widths(cfg: ModelConfig, fused_name: str) -> tuple[int, ...]:
    """Output width of each separate projection a fused kernel replaces, in column order."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    widths = {"q_proj": q, "k_proj": kv, "v_proj": kv,
              "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}
    return tuple(widths[p] for p in FUSED[fused_name][1])


def fuse_projections(params: Params) -> Params:
    """Separate q/k/v and gate/up kernels -> the fused serving layout (a new tree).

    Already-fused trees come back unchanged. Tensors other than the fused ones are shared
    with the input, so once the caller drops the input only the fused copies remain.
    """
    if is_fused(params):
        return params
    out = dict(params)
    for name, layer in params.items():
        if not name.startswith("layers_"):
            continue
        layer = dict(layer)
        for fused_name, (block, parts) in FUSED.items():
            sub = dict(layer[block])
            sub[fused_name] = {"kernel": _concat([sub.pop(p)["kernel"] for p in parts])}
            layer[block] = sub
        out[name] = layer
    return out


@jax.jit
def _concat(kernels: list[jax.Array]) -> jax.Array:
    return jnp.concatenate(kernels, axis=1)


def projection(layer: Params, block: str, part: str, cfg: ModelConfig) -> jax.Array:
    """The `[in, out]` kernel of one separate projection (`block` "self_attn" or "mlp"),
    from either layout; in the fused layout it is sliced out of the fused kernel."""
    sub = layer[block]
    if part in sub:
        return sub[part]["kernel"]
    fused_name = next(f for f, (b, parts) in FUSED.items() if b == block and part in parts)
    i = FUSED[fused_name][1].index(part)
    widths = part_widths(cfg, fused_name)
    start = sum(widths[:i])
    return sub[fused_name]["kernel"][:, start:start + widths[i]]


def split_columns(x: jax.Array, widths: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """Split the last axis of a fused projection's output into the separate outputs."""
    out, start = [], 0
    for w in widths:
        out.append(x[..., start:start + w])
        start += w
    return tuple(out)
