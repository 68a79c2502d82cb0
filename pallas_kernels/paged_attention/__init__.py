"""Decode paged attention (one query token per sequence), Pallas GPU kernel + jnp reference."""
from pallas_kernels.paged_attention.combine import combine_splits, combine_splits_kernel
from pallas_kernels.paged_attention.paged_attention import (
    LAYOUTS,
    choose_num_splits,
    default_pages_per_compute_block,
    paged_attention,
    rope_paged_attention,
)
from pallas_kernels.paged_attention.reference import (paged_attention_reference,
                                                      rope_paged_attention_reference)

__all__ = ["LAYOUTS", "choose_num_splits", "combine_splits", "combine_splits_kernel",
           "default_pages_per_compute_block", "paged_attention", "paged_attention_reference",
           "rope_paged_attention", "rope_paged_attention_reference"]
