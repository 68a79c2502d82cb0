"""The gate activation of a gated MLP, by `ModelConfig.hidden_act`: shared by the dense MLP
(`layers.py`) and the experts (`moe.py`)."""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """"silu" (SwiGLU) or "gelu_tanh" (GeGLU)."""
    if name == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return nn.silu
