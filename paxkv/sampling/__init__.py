"""Logits processing beyond temperature and top-k/p: penalties, bias, bans, grammar masks,
prompt logprobs. `rows.py` packs the per-row tensors on the host (numpy); `processors.py`
applies them on the device inside the jitted sampler (pure JAX)."""
