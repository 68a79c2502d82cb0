"""The next weight asked into L2 on a second GPU stream while a layer's small kernels run.

At one decode stream a layer's four weight matmuls stream HBM while the kernels between them
(norms, RoPE + KV write, attention, split combine, activation) are bound by latency and leave
HBM idle. At each site below the model starts `pallas_kernels.layer_ops.prefetch_to_l2` on a
second stream (`jax.experimental.compute_on`, XLA's stream annotation) as soon as the
kernel before the window has written its output, and makes the matmul after the window wait
for it (`gate`), so the matmul finds the part of its weight it reads first in L2. The tokens
also flow into the step's logits (`sink`, an exact no-op on their values), so no compiler pass
can drop a prefetch whose token only an optimization barrier holds:

    "qkv"      the layer's q/k/v weight, during the input norm
    "o"        the o weight, during RoPE + KV write, attention and the split combine
    "gate_up"  the gate/up weight, during the post-attention norm
    "down"     the down weight, during the activation

SITES holds the bytes each site asks for (absent or 0: none); ORDER which of the weight's
bytes ("head": the first ones, "spread": evenly over it). Steps of more than MAX_ROWS tokens
keep their own kernels busy and warm nothing. The settings are read when the step is traced:
set them before the engine compiles.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

SITES: dict[str, int] = {}
ORDER = "head"
CHUNK_BYTES = 32 * 1024
MAX_ROWS = 16
STREAM = 1
# None: only where the model runs on a GPU; True or False forces it (tests, ablations).
ENABLED: bool | None = None


# Tokens started while the current step is traced, for `sink` (trace-time bookkeeping only).
_started: list[jax.Array] = []


def _active(site: str, rows: int) -> bool:
    enabled = jax.default_backend() == "gpu" if ENABLED is None else ENABLED
    return enabled and rows <= MAX_ROWS and SITES.get(site, 0) > 0


def start(site: str, weight: jax.Array, after: jax.Array, rows: int) -> jax.Array | None:
    """Start warming L2 with `weight` for `site` once `after` is written, on the second
    stream -> the token `gate` waits on, or None where the site warms nothing."""
    if not _active(site, rows):
        return None
    from pallas_kernels.layer_ops.l2_prefetch import plan, prefetch_to_l2
    p = plan(weight, SITES[site], chunk_bytes=CHUNK_BYTES, order=ORDER)
    if p is None:
        return None
    interpret = jax.default_backend() != "gpu"
    if interpret:   # no second stream to run on: the same kernel in line
        token = prefetch_to_l2(weight, after, p=p, interpret=True)
        _started.append(token)
        return token
    on_stream = _compute_on(lambda w, a: prefetch_to_l2(w, a, p=p),
                            compute_type=f"gpu_stream:{STREAM}",
                            out_memory_spaces=jax.memory.Space.Device)
    token = on_stream(weight, after)
    _started.append(token)
    return token


def _compute_on(f, **kwargs):
    """`jax.experimental.compute_on`'s function form (named `compute_on2` before JAX 0.11)."""
    from jax.experimental import compute_on as module
    return getattr(module, "compute_on2", module.compute_on)(f, **kwargs)


def gate(x: jax.Array, token: jax.Array | None) -> jax.Array:
    """`x`, available only once the prefetch behind `token` has ended (None: `x` as is)."""
    if token is None:
        return x
    x, _ = jax.lax.optimization_barrier((x, token))
    return x


def sink(logits: jax.Array) -> jax.Array:
    """`logits` made to depend on every prefetch started since the last call (adds their zero
    tokens, times 0.0 in float32 so no simplifier folds it away); the list is emptied."""
    tokens = list(_started)
    _started.clear()
    if not tokens:
        return logits
    total = sum(t[0] for t in tokens).astype(jnp.float32)
    return logits + total * jnp.float32(0.0)
