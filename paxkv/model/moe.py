"""The mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE): route, sort by expert, one
grouped matmul per projection, unsort.

Each token's router logits go through a softmax (float32); its `num_experts_per_tok` highest
experts are kept, their weights renormalised to sum to one where the family asks
(`norm_topk_prob`; Mixtral always does). The (token, expert) pairs are then sorted by expert,
so every expert's tokens are one contiguous run of rows, and each projection is one grouped
matmul over the stacked expert weights (`grouped_matmul`: XLA's `ragged_dot`, or on a GPU the
Pallas kernel where its tuning table says it wins): an expert no token chose has an empty
run, and no compute runs over all experts. The rows are unsorted, weighted and
summed per token.

Parameters (per MoE layer, under `layers_{i}/moe`):
    router/kernel          [hidden, num_experts]
    experts/gate_proj      [num_experts, hidden, moe_intermediate]
    experts/up_proj        [num_experts, hidden, moe_intermediate]
    experts/down_proj      [num_experts, moe_intermediate, hidden]
Under tensor parallelism every device holds every expert and a slice of its intermediate
width (`paxkv/parallel/sharding.py`): routing is replicated, each device runs the same
grouped matmuls on its columns, and one all-reduce after `down_proj` sums them, as for the
dense MLP.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from paxkv.config import ModelConfig
from paxkv.model.activations import activation

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def route(logits: jax.Array, top_k: int, renormalise: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits `[T, E]` -> (weights `[T, k]` float32, expert ids `[T, k]` int32)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def expert_order(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Flattened (token, choice) pairs sorted by expert -> (order `[T * k]`, rows per expert
    `[E]`); stable, so within an expert rows keep token order."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return order, counts


def grouped_matmul(x: jax.Array, weights: jax.Array, group_sizes: jax.Array,
                   backend: str = "auto") -> jax.Array:
    """Rows of `x` `[M, K]`, sorted into runs of `group_sizes` rows, times their expert's
    `weights[e]` `[K, N]` -> `[M, N]`.

    `backend`: "xla" (`jax.lax.ragged_dot`), "pallas" (`pallas_kernels.grouped_matmul`,
    which reads only the experts that own rows; interpret mode off the GPU), or "auto": on a
    GPU the Pallas kernel where its tuning table (`pallas_kernels/grouped_matmul/tuning.py`)
    has a measured winner for M rows, else XLA."""
    from pallas_kernels.grouped_matmul import tuning
    on_gpu = jax.default_backend() == "gpu"
    if backend not in ("auto", "xla", "pallas"):
        raise ValueError(f"grouped_matmul backend must be auto, xla or pallas, got {backend!r}")
    if backend == "pallas":
        tiles = tuning.pick(x.shape[0]) or tuning.Tiles()
    elif backend == "auto" and on_gpu:
        tiles = tuning.pick(x.shape[0])
    else:
        tiles = None
    if tiles is None:
        return jax.lax.ragged_dot(x, weights, group_sizes,
                                  preferred_element_type=jnp.float32).astype(x.dtype)
    from pallas_kernels.grouped_matmul import grouped_matmul as pallas_grouped_matmul
    return pallas_grouped_matmul(x, weights, group_sizes, interpret=not on_gpu, **tiles.kwargs())


class SparseMoE(nn.Module):
    """`x [..., hidden]` -> the weighted sum of its chosen experts' gated MLPs."""

    cfg: ModelConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        e, k, h, i = c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
        lead = x.shape[:-1]
        tokens = x.reshape(-1, h).astype(self.dtype)
        logits = nn.Dense(e, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                          kernel_init=nn.initializers.normal(0.02), name="router")(tokens)
        weights, experts = route(logits, k, c.norm_topk_prob)
        shapes = ((e, h, i), (e, h, i), (e, i, h))
        w = _Experts(shapes, self.dtype, name="experts")()
        order, counts = expert_order(experts, e)
        rows = tokens[order // k]                                   # [T * k, hidden]
        gate = grouped_matmul(rows, w["gate_proj"].astype(self.dtype), counts)
        up = grouped_matmul(rows, w["up_proj"].astype(self.dtype), counts)
        out = grouped_matmul(activation(c.hidden_act)(gate) * up,
                             w["down_proj"].astype(self.dtype), counts)   # [T * k, hidden]
        unsorted = jnp.zeros_like(out).at[order].set(out).reshape(-1, k, h)
        mixed = jnp.sum(unsorted * weights.astype(self.dtype)[..., None], axis=1)
        return mixed.reshape(*lead, h)


class _Experts(nn.Module):
    """The stacked expert weights (`experts/{gate,up,down}_proj`)."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> dict[str, jax.Array]:
        init = nn.initializers.normal(0.02)
        return {name: self.param(name, init, shape, self.dtype)
                for name, shape in zip(EXPERT_PROJECTIONS, self.shapes)}
