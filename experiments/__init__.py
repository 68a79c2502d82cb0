"""Paper-style experiments: absl programs, one per table or figure of the PagedAttention paper."""
