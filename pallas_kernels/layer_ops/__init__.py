"""Small per-layer kernels that each replace several of XLA's: the residual add fused with
RMSNorm, and RoPE fused with the KV-page write (plain or 8-bit pages). At one stream a decode
layer's non-matmul work is a dozen launches of a few microseconds each, so launches, not bytes,
are what they save."""
from pallas_kernels.layer_ops.add_rms_norm import add_rms_norm, add_rms_norm_reference
from pallas_kernels.layer_ops.rope_kv_write import (rope_kv_write, rope_kv_write_reference,
                                                    split_heads)
from pallas_kernels.layer_ops.rope_kv_write_quantized import (
    rope_kv_write_quantized, rope_kv_write_quantized_reference)

__all__ = ["add_rms_norm", "add_rms_norm_reference", "rope_kv_write", "rope_kv_write_quantized",
           "rope_kv_write_quantized_reference", "rope_kv_write_reference", "split_heads"]
