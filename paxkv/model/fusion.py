"""The serving layout of the weights: q/k/v and gate/up projections fused into one matmul each.

Checkpoints store `q_proj`, `k_proj`, `v_proj` and `gate_proj`, `up_proj` as separate
matrices that all read the same activations. Left separate, a decode step runs five thin
matmuls per layer where two would do, and XLA's dot merger may fuse them anyway by
concatenating the weights on every step (on an H200 at batch 256 that copy cost more than
the attention kernels). Fusing once at load time, as vLLM's merged linear layers do, gives
each layer two wide matmuls and no per-step copies.

Layout (per layer, replacing the separate kernels):
    self_attn/qkv_proj/kernel   [hidden, (num_heads + 2 * num_kv_heads) * head_dim]
    self_attn/qkv_proj/bias     [(num_heads + 2 * num_kv_heads) * head_dim]   (Qwen2's biases)
    mlp/gate_up_proj/kernel     [hidden, 2 * intermediate_size]
The network in `layers.py` accepts either layout; checkpoint export (`weights.hf_tensors`)
reads either.

Tensor-parallel engines serve from the grouped layout (`group_projections`): the same fused
kernels with a group axis in the middle, one group per KV head,
    self_attn/qkv_proj/kernel   [hidden, num_kv_heads, (q_per_kv + 2) * head_dim]
    self_attn/qkv_proj/bias     [num_kv_heads, (q_per_kv + 2) * head_dim]
    mlp/gate_up_proj/kernel     [hidden, num_kv_heads, 2 * intermediate_size / num_kv_heads]
where group g holds, in order, its slice of every projection (its q heads, its k and v
head; its chunk of gate and of up columns). A plain column split of the 2-D fused kernel
would hand a device some q columns and none of its k/v; splitting the group axis hands every
device whole groups, so each one computes its own heads and its own chunk of the MLP, for
any tensor-parallel size that divides `num_kv_heads`.
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
    """Whether `params` is in a fused layout, 2-D or grouped (layer 0 decides)."""
    return "qkv_proj" in params.get("layers_0", {}).get("self_attn", {})


def is_grouped(params: Params) -> bool:
    """Whether `params` is in the grouped (tensor-parallel) layout."""
    return is_fused(params) and params["layers_0"]["self_attn"]["qkv_proj"]["kernel"].ndim == 3


def fused_leaves(block: Params, fused_name: str) -> tuple[str, ...]:
    """The leaves a fused projection has in `block` (one layer's "self_attn" or "mlp"), in
    either layout: ("kernel",) or, where the projections carry biases, ("kernel", "bias")."""
    parts = FUSED[fused_name][1]
    held = block.get(fused_name) or block.get(parts[0]) or {}
    return ("kernel", "bias") if "bias" in held else ("kernel",)


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
    return with_fused_kernels(params, lambda layer, block, parts, leaf: _concat(
        [layer[block][p][leaf] for p in parts]))


def with_fused_kernels(params: Params, make: Any) -> Params:
    """A new tree whose layers hold, per fused projection and leaf ("kernel", and "bias"
    where the projections have biases), `make(layer, block, parts, leaf)` in place of the
    separate projections (and of any fused one already there)."""
    out = dict(params)
    for name, layer in params.items():
        if not name.startswith("layers_"):
            continue
        layer = dict(layer)
        for fused_name, (block, parts) in FUSED.items():
            if block not in layer:   # a mixture-of-experts layer has no dense MLP
                continue
            leaves = fused_leaves(layer[block], fused_name)
            sub = {k: v for k, v in layer[block].items() if k not in parts and k != fused_name}
            sub[fused_name] = {leaf: make(layer, block, parts, leaf) for leaf in leaves}
            layer[block] = sub
        out[name] = layer
    return out


@jax.jit
def _concat(arrays: list[jax.Array]) -> jax.Array:
    return jnp.concatenate(arrays, axis=-1)


def group_kernel(arrays: list[jax.Array], groups: int) -> jax.Array:
    """Separate `[in, w_i]` kernels (or `[w_i]` biases) -> one grouped `[in, groups,
    sum(w_i) / groups]` kernel (`[groups, sum(w_i) / groups]` bias): group g holds columns
    `[g * w_i / groups, (g + 1) * w_i / groups)` of every array i."""
    parts = []
    for k in arrays:
        if k.shape[-1] % groups:
            raise ValueError(f"a projection of width {k.shape[-1]} does not split into {groups} groups")
        parts.append(k.reshape(*k.shape[:-1], groups, k.shape[-1] // groups))
    return jnp.concatenate(parts, axis=-1)


def group_projections(params: Params, cfg: ModelConfig) -> Params:
    """Any layout -> the grouped layout (a new tree; other tensors are shared, not copied).

    Outside jit this converts one fused kernel at a time (`paxkv.parallel.sharding` does it
    under jit with the target shardings, so no device holds a whole kernel)."""
    if is_grouped(params):
        return params
    return with_fused_kernels(params, lambda layer, block, parts, leaf: _group(
        [projection(layer, block, p, cfg, leaf) for p in parts], cfg.num_kv_heads))


_group = jax.jit(group_kernel, static_argnums=(1,))


def projection(layer: Params, block: str, part: str, cfg: ModelConfig,
               leaf: str = "kernel") -> jax.Array:
    """The `[in, out]` kernel (`leaf` "kernel") or `[out]` bias ("bias") of one separate
    projection (`block` "self_attn" or "mlp"), from any layout; in a fused layout it is
    sliced out of the fused one."""
    sub = layer[block]
    if part in sub:
        return sub[part][leaf]
    fused_name = next(f for f, (b, parts) in FUSED.items() if b == block and part in parts)
    i = FUSED[fused_name][1].index(part)
    widths = part_widths(cfg, fused_name)
    x = sub[fused_name][leaf]
    lead = x.shape[:-2] if leaf == "kernel" and x.ndim == 3 or leaf == "bias" and x.ndim == 2 else None
    if lead is not None:   # grouped: this part's slice of every group, groups in order
        groups = x.shape[-2]
        per_group = [w // groups for w in widths]
        start = sum(per_group[:i])
        return x[..., start:start + per_group[i]].reshape(*lead, widths[i])
    start = sum(widths[:i])
    return x[..., start:start + widths[i]]


def split_columns(x: jax.Array, widths: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """Split the last axis of a fused projection's output into the separate outputs."""
    out, start = [], 0
    for w in widths:
        out.append(x[..., start:start + w])
        start += w
    return tuple(out)


def split_groups(y: jax.Array, widths: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """A grouped projection's output `[..., groups, sum(widths) / groups]` -> the separate
    outputs `[..., widths[i]]`, each in the column order of its own projection."""
    groups = y.shape[-2]
    parts = split_columns(y, tuple(w // groups for w in widths))
    return tuple(p.reshape(*y.shape[:-2], w) for p, w in zip(parts, widths))
