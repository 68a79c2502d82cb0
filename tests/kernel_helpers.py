"""What the kernel tests share: tolerances and the error measure."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

HEAD_DIM = 32
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def rel_err(out, ref) -> float:
    """Relative L2 error of `out` against `ref`, in float64."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
