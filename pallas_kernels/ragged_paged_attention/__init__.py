"""Ragged paged attention (prefill / chunked prefill / mixed), Pallas GPU kernel + jnp reference."""
from pallas_kernels.ragged_paged_attention.ragged_paged_attention import (default_block_q,
                                                                          ragged_paged_attention)
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.work_list import build_work_list

__all__ = ["build_work_list", "default_block_q", "ragged_paged_attention",
           "ragged_paged_attention_reference"]
