"""Per-layer kernels that each replace several of XLA's: the residual add fused with RMSNorm,
RoPE fused with the KV-page write, and a small step's whole SwiGLU MLP. At one stream a decode
layer's non-matmul work is a dozen launches of a few microseconds each, so launches, and the
matmuls' ramps, not bytes, are what they save."""
from pallas_kernels.layer_ops.add_rms_norm import add_rms_norm, add_rms_norm_reference
from pallas_kernels.layer_ops.atomic_mlp import swiglu_mlp, swiglu_mlp_reference
from pallas_kernels.layer_ops.rope_kv_write import (rope_kv_write, rope_kv_write_reference,
                                                    split_heads)

__all__ = ["add_rms_norm", "add_rms_norm_reference", "rope_kv_write", "rope_kv_write_reference",
           "split_heads", "swiglu_mlp", "swiglu_mlp_reference"]
