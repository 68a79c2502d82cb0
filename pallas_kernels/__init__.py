"""paxkv's Pallas GPU kernels: decode and ragged paged attention, each beside its jnp reference."""
import warnings

# The kernels here are written for Pallas' Triton lowering, which JAX deprecated after 0.11 in
# favour of Mosaic GPU and which warns each time it lowers a kernel. paxkv chose that lowering
# knowingly (Mosaic GPU variants sit beside the Triton kernels, picked per shape), so the
# warning says nothing actionable to paxkv's users: hide exactly that message.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                        category=DeprecationWarning)
