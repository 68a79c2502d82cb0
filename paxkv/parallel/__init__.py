"""Tensor parallelism over a `jax.sharding.Mesh`: mesh, weight and pool shardings, loading,
multi-host startup. Nothing here is imported when `tensor_parallel_size == 1`."""
