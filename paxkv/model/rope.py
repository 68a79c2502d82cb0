"""Rotary position embeddings, with Llama-3.1's "llama3" frequency scaling.

Each layer's base and scaling come from `ModelConfig.layer_rope` (Gemma 3's sliding layers
have a base of their own; its global layers a "linear" scaling).

Convention: the "rotate half" layout of Hugging Face checkpoints. The head dimension is split
into two halves `(x1, x2)` and rotated as `(x1 cos - x2 sin, x2 cos + x1 sin)`, frequency `i`
acting on the pair `(i, i + d/2)`. HF's Llama weights are stored permuted for this layout, so
using the interleaved layout instead would silently give wrong logits.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from paxkv.config import ModelConfig, RopeScaling


def llama3_scale_inv_freq(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """Llama-3.1 long-context scaling of the inverse frequencies.

    Wavelengths shorter than `original / high_freq_factor` are kept, those longer than
    `original / low_freq_factor` are divided by `factor`, and the band in between is a
    linear blend of the two (in `original / wavelength`).
    """
    original = float(scaling.original_max_position_embeddings)
    low_wavelen = original / scaling.low_freq_factor
    high_wavelen = original / scaling.high_freq_factor
    wavelen = 2.0 * math.pi / inv_freq
    blend = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1.0 - blend) * inv_freq / scaling.factor + blend * inv_freq
    out = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(in_band, blended, out).astype(np.float32)


RopeKey = tuple[float, RopeScaling | None]   # (base, scaling): what one layer's tables depend on


def inverse_frequencies(cfg: ModelConfig, layer: int = 0) -> np.ndarray:
    """`[head_dim // 2]` float32 inverse frequencies of `layer`'s RoPE (a compile-time constant)."""
    return _inverse_frequencies(cfg.head_dim, *cfg.layer_rope(layer))


def _inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    d = head_dim
    exponents = np.arange(0, d, 2, dtype=np.float32) / np.float32(d)
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    return llama3_scale_inv_freq(inv_freq, scaling)


def cos_sin(positions: jax.Array, cfg: ModelConfig, layer: int = 0) -> tuple[jax.Array, jax.Array]:
    """cos and sin of `layer`'s RoPE, shape `positions.shape + (head_dim // 2,)`, float32."""
    inv_freq = jnp.asarray(inverse_frequencies(cfg, layer))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def rope_tables(positions: jax.Array, cfg: ModelConfig) -> dict[RopeKey, tuple[jax.Array, jax.Array]]:
    """cos and sin of every distinct RoPE the layers use, keyed by `cfg.layer_rope(layer)`
    (one entry for most families; Gemma 3's sliding layers have their own base)."""
    tables: dict[RopeKey, tuple[jax.Array, jax.Array]] = {}
    for layer in range(cfg.num_layers):
        key = cfg.layer_rope(layer)
        if key not in tables:
            tables[key] = cos_sin(positions, cfg, layer)
    return tables


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x [..., heads, head_dim]` by angles `cos/sin [..., head_dim // 2]` (fp32 math)."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[..., None, :], sin[..., None, :]   # broadcast over heads
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)
