"""New weights into a serving engine's parameter tree, in its own layout and placement.

A rollout engine inside a training loop takes the trainer's weights every step. They come in
one of two shapes (vLLM's `load_weights` takes the first):

- (Hugging Face tensor name, array) pairs, any subset of the checkpoint's tensors: each is
  checked against the family's `tensor_specs` (name and shape), transposed and cast as a
  checkpoint load would, and written where the engine keeps it: a leaf of its own, a slice
  of a fused q/k/v or gate/up kernel (2-D, or grouped under tensor parallelism), or an
  expert's slice of a stacked leaf. Fused kernels are rebuilt from the new parts and the
  current ones (one concatenation each).
- the engine's own parameter tree (`LLM.llm_engine.runner.params`' structure): every leaf
  must have the current leaf's shape and dtype; an array already placed with the current
  leaf's sharding is taken as it is, without a copy.

Everything is checked before anything is built, so a bad name or shape leaves the old
weights in place. Shapes, dtypes and shardings do not change, so no step program recompiles.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from paxkv.config import ModelConfig
from paxkv.model.families.base import TensorSpec
from paxkv.model.fusion import FUSED, group_kernel, projection
from paxkv.model.registry import family_of

Params = Any


def _get(tree: Params, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _replace(tree: Params, path: tuple[str, ...], value: Any) -> Params:
    """A copy of `tree` (dicts along `path` only) with `value` at `path`."""
    if not path:
        return value
    out = dict(tree)
    out[path[0]] = _replace(tree[path[0]], path[1:], value)
    return out


def _place_like(x: Any, like: jax.Array) -> jax.Array:
    """`x` with `like`'s dtype and sharding; an array already so placed is returned as is."""
    if isinstance(x, jax.Array) and x.dtype == like.dtype and x.sharding == like.sharding:
        return x
    return jax.device_put(jnp.asarray(x, like.dtype), like.sharding)


def _fused_of(spec: TensorSpec) -> tuple[str, str] | None:
    """(fused kernel name, leaf) a separate projection's spec is part of, else None."""
    if len(spec.path) < 4:
        return None
    block, part, leaf = spec.path[1], spec.path[2], spec.path[3]
    for fused_name, (fused_block, parts) in FUSED.items():
        if block == fused_block and part in parts:
            return fused_name, leaf
    return None


def _as_param(spec: TensorSpec, x: Any) -> jax.Array:
    """An HF tensor in the parameter tree's orientation ([in, out] for linear layers)."""
    x = jnp.asarray(x)
    return x.T if spec.transpose else x


def check_named(cfg: ModelConfig, weights: Iterable[tuple[str, Any]]) -> list[tuple[TensorSpec, Any]]:
    """(spec, array) of every named tensor; ValueError naming the first unknown name, wrong
    shape or repeated name (nothing changed yet)."""
    specs = {s.hf_name: s for s in family_of(cfg).tensor_specs(cfg)}
    out, seen = [], set()
    for name, x in weights:
        spec = specs.get(name)
        if spec is None:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue   # a tied model's head is its embedding
            raise ValueError(f"update_weights: {name!r} is not a tensor of this "
                             f"{cfg.architecture}")
        if name in seen:
            raise ValueError(f"update_weights: {name!r} is given twice")
        seen.add(name)
        if tuple(np.shape(x)) != spec.hf_shape:
            raise ValueError(f"update_weights: {name!r} has shape {tuple(np.shape(x))}, "
                             f"expected {spec.hf_shape}")
        out.append((spec, x))
    return out


def check_tree(current: Params, new: Params) -> list[tuple[tuple[str, ...], jax.Array, Any]]:
    """(path, current leaf, new leaf) of every leaf; ValueError naming the first path that is
    missing, extra, or of another shape or dtype."""
    cur = {tuple(str(getattr(k, "key", k)) for k in p): x
           for p, x in jax.tree_util.tree_flatten_with_path(current)[0]}
    got = {tuple(str(getattr(k, "key", k)) for k in p): x
           for p, x in jax.tree_util.tree_flatten_with_path(new)[0]}
    for path in got.keys() - cur.keys():
        raise ValueError(f"update_weights: {'/'.join(path)} is not a parameter of the engine")
    for path in cur.keys() - got.keys():
        raise ValueError(f"update_weights: the tree lacks {'/'.join(path)}")
    out = []
    for path, like in cur.items():
        x = got[path]
        if tuple(np.shape(x)) != like.shape:
            raise ValueError(f"update_weights: {'/'.join(path)} has shape {tuple(np.shape(x))}, "
                             f"expected {like.shape}")
        if jnp.result_type(x) != like.dtype:
            raise ValueError(f"update_weights: {'/'.join(path)} has dtype {jnp.result_type(x)}, "
                             f"expected {like.dtype}")
        out.append((path, like, x))
    return out


def updated_params(current: Params, cfg: ModelConfig,
                   weights: Params | Iterable[tuple[str, Any]]) -> Params:
    """`current` with `weights` written in (see the module docstring); leaves not named keep
    their arrays."""
    if isinstance(weights, Mapping):
        leaves = check_tree(current, weights)
        new = current
        for path, like, x in leaves:
            new = _replace(new, path, _place_like(x, like))
        return new
    named = check_named(cfg, weights)
    new = current
    fused: dict[tuple[str, str, str], dict[str, jax.Array]] = {}
    stacked: dict[tuple[str, ...], dict[int, jax.Array]] = {}
    for spec, x in named:
        target = _fused_of(spec)
        if spec.expert is not None:
            stacked.setdefault(spec.path, {})[spec.expert] = _as_param(spec, x)
        elif target is not None and spec.path[2] not in _get(current, spec.path[:2]):
            fused.setdefault((spec.path[0], spec.path[1], target[0]), {})[
                f"{spec.path[2]}/{target[1]}"] = _as_param(spec, x)
        else:
            new = _replace(new, spec.path, _place_like(_as_param(spec, x), _get(current, spec.path)))
    for path, experts in stacked.items():
        like = _get(current, path)
        index = jnp.asarray(sorted(experts), jnp.int32)
        values = jnp.stack([experts[e] for e in sorted(experts)]).astype(like.dtype)
        new = _replace(new, path, _place_like(like.at[index].set(values), like))
    for (layer, block, fused_name), parts in fused.items():
        names = FUSED[fused_name][1]
        for leaf in ("kernel", "bias"):
            if not any(key.endswith("/" + leaf) for key in parts):
                continue
            like = current[layer][block][fused_name][leaf]
            pieces = [parts.get(f"{p}/{leaf}", None) for p in names]
            pieces = [x if x is not None else projection(current[layer], block, p, cfg, leaf)
                      for x, p in zip(pieces, names)]
            pieces = [jnp.asarray(x, like.dtype) for x in pieces]
            grouped = like.ndim == (3 if leaf == "kernel" else 2)
            value = group_kernel(pieces, like.shape[-2]) if grouped else jnp.concatenate(pieces, -1)
            new = _replace(new, (layer, block, fused_name, leaf), _place_like(value, like))
    return new
