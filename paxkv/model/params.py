"""The parameter tree of a model: its shapes and its random initialization (benchmarks, tests).

Loading and saving checkpoints is `weights.py`'s; the tree's names are the layers' own
(`layers.py`), which follow the Hugging Face checkpoint names.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from paxkv.config import ModelConfig
from paxkv.model.dense import grouped_attention
from paxkv.model.layers import INIT_STD, DecoderLM

Params = Any  # nested dict of arrays, the Linen "params" collection


def param_shapes(cfg: ModelConfig, dtype: Any = jnp.float32) -> Params:
    """The parameter tree as `jax.ShapeDtypeStruct`s (no memory touched)."""
    def init(key):
        ids = jnp.zeros((1, 1), jnp.int32)
        fake_attention = lambda layer, q, k, v, state: (
            grouped_attention(q, k, v, ids, ids[0], 1.0), state)
        return DecoderLM(cfg, dtype).init(key, ids, ids, fake_attention)["params"]
    return jax.eval_shape(init, jax.random.key(0))


def leaf_name(path: tuple) -> str:
    """A tree path as "layers_0/self_attn/q_proj/kernel"."""
    return "/".join(str(getattr(p, "key", p)) for p in path)


def is_norm_gain(name: str) -> bool:
    """Whether the leaf `name` (as `leaf_name` writes it) is a norm's gain."""
    return name.endswith("scale")


def init_value(cfg: ModelConfig, name: str) -> float | None:
    """A constant a leaf starts at (a norm's gain: 1, or 0 where gains are applied as 1 + w;
    a bias: 0), or None for a leaf drawn from N(0, INIT_STD)."""
    if is_norm_gain(name):
        return 0.0 if cfg.norm_unit_offset else 1.0
    if name.endswith("bias"):
        return 0.0
    return None


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random parameters created on the default device: norm gains at 1 (as the family
    applies them), biases 0, other weights N(0, 0.02).

    Each tensor is made by its own small jitted call, so even an 8B model never needs more
    than its own size (plus one tensor) of device memory, and nothing goes through the host.
    """
    dtype = jnp.dtype(dtype)
    shapes = param_shapes(cfg, dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    out = []
    for index, (path, leaf) in enumerate(leaves):
        value = init_value(cfg, leaf_name(path))
        if value is not None:
            out.append(_full(leaf.shape, dtype, value))
        else:
            out.append(_normal(jax.random.fold_in(key, index), leaf.shape, dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _full(shape: tuple[int, ...], dtype: Any, value: float) -> jax.Array:
    return jnp.full(shape, value, dtype)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return (jax.random.normal(key, shape, jnp.float32) * INIT_STD).astype(dtype)
