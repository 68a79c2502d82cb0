"""Thin matmuls as split-K partial sums that the next fused kernel adds up.

At one stream a decode step multiplies 8 padded rows by each weight matrix. XLA splits K
for the narrow ones (q/k/v, o, down) so that every SM streams weights, and adds the slices
up in a reduction kernel of its own: three launches of about 1.3 us per layer, 4 us of the
20 us that a layer spends outside its matmuls. Here the split is a batch axis of the matmul
instead (`[splits, T, K / splits] x [splits, K / splits, N]`), its float32 partial sums are
the output, and the Pallas kernel that reads them next (residual add + RMSNorm, RoPE +
KV write: `pallas_kernels.layer_ops`) adds them as it loads its row. The sum is rounded to
the activation dtype before use, as the matmul's own output would be.

Only steps of at most `THIN_ROWS` tokens on the fused GPU path take this form (`plan`);
wider steps keep XLA's matmuls, whose outputs are too large to pass around in float32.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# Tokens per step up to which the plan applies: one stream and small batches.
THIN_ROWS = 16
# K slices per projection for thin steps (1: a plain matmul). Names are the layers' own.
SPLITS: dict[str, int] = {"qkv_proj": 4, "o_proj": 4, "down_proj": 4}


class SplitK(NamedTuple):
    """A matmul's output as float32 partial sums over K slices, `[splits, ..., N]`."""

    partials: jax.Array

    def total(self, dtype: Any) -> jax.Array:
        """The output the plain matmul would give: the sum, rounded to `dtype`."""
        return jnp.sum(self.partials, axis=0).astype(dtype)


class Plan(NamedTuple):
    """K slices per projection for one step (static; 1 everywhere: no split)."""

    qkv_proj: int = 1
    o_proj: int = 1
    down_proj: int = 1


NO_SPLIT = Plan()


def plan(num_tokens: int, enabled: bool) -> Plan:
    """The split plan for a step of `num_tokens` tokens: `SPLITS` when `enabled` (the fused
    GPU path) and the step is thin, else no split."""
    if not enabled or num_tokens > THIN_ROWS:
        return NO_SPLIT
    return Plan(**SPLITS)


def matmul(x: jax.Array, kernel: jax.Array, splits: int) -> jax.Array | SplitK:
    """`x @ kernel` (`[..., K] x [K, N]`): `SplitK` partials when `splits` > 1 divides K,
    else the plain product in x's dtype."""
    k, n = kernel.shape
    if splits <= 1 or k % splits:
        return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    lead = x.shape[:-1]
    rows = x.reshape(-1, splits, k // splits)
    partials = jnp.einsum("tsk,skn->stn", rows, kernel.reshape(splits, k // splits, n),
                          preferred_element_type=jnp.float32)
    return SplitK(partials.reshape(splits, *lead, n))


def total(x: jax.Array | SplitK, dtype: Any) -> jax.Array:
    """x itself, or the rounded sum of its partials."""
    return x.total(dtype) if isinstance(x, SplitK) else x


def take_rows(x: jax.Array | SplitK, at: jax.Array, width: int) -> jax.Array | SplitK:
    """Rows `at` of the flattened leading dims (`[..., width]` -> `[len(at), width]`)."""
    if isinstance(x, SplitK):
        splits = x.partials.shape[0]
        return SplitK(x.partials.reshape(splits, -1, width)[:, at])
    return x.reshape(-1, width)[at]
