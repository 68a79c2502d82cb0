"""Whether the side-stream prefetch (`paxkv.model.side_prefetch`) compiles to async calls on
a second stream: one decode step of a 2-layer model (hidden 1024) lowered and compiled with
no site and with all four, counts of what its compiled HLO holds, and whether the logits agree.

    PYTHONPATH=. python3 scripts/probe_side_prefetch_hlo.py      # on a GPU; OUT=DIR keeps the HLO
"""
import re
import jax, jax.numpy as jnp, numpy as np
from paxkv.model import side_prefetch
from paxkv.config import ModelConfig
from paxkv.model.llama import forward_jit, init_params
from paxkv.model.fusion import fuse_projections
from paxkv.model.batch import StepBatch
from paxkv.cache import kv_pool as kvp
cfg = ModelConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_layers=2, num_heads=8,
                  num_kv_heads=2, head_dim=128, rope_theta=10000.0, max_position_embeddings=1024)
params = fuse_projections(init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))
S, bs, nb = 8, 16, 64
batch = StepBatch(token_ids=jnp.arange(S, dtype=jnp.int32), positions=jnp.full((S,), 20, jnp.int32),
                  slot_mapping=(jnp.arange(S, dtype=jnp.int32) * 2 + 1) * bs + 4,
                  block_tables=jnp.stack([jnp.array([2 * i + 2, 2 * i + 3, 0, 0], jnp.int32) for i in range(S)]),
                  context_lens=jnp.full((S,), 21, jnp.int32), cu_q_lens=jnp.arange(S + 1, dtype=jnp.int32),
                  logits_indices=jnp.arange(S, dtype=jnp.int32))
outs = {}
for sites in ({}, {"o": 32 << 20, "qkv": 12 << 20, "gate_up": 12 << 20, "down": 4 << 20}):
    side_prefetch.SITES = sites
    jax.clear_caches()
    pool = kvp.init_pool(cfg, nb, bs, jnp.bfloat16)
    lowered = forward_jit.lower(params, batch, pool, cfg, backend="pallas", decode_only=True)
    text = lowered.compile().as_text()
    print("sites", sorted(sites), "call-start", text.count("call-start"), "stream_annotation",
          len(re.findall(r'_xla_stream_annotation="\d"', text)), "prefetch kernels", text.count("paxkv_prefetch_l2"), "triton calls", text.count("__gpu$xla.gpu.triton"), "async", text.count("async"), "barrier", text.count("opt-barrier"),
          "command_buffer", text.count("command_buffer"))
    logits, _ = forward_jit(params, batch, pool, cfg, backend="pallas", decode_only=True)
    outs[len(sites)] = np.asarray(logits)
    if sites: open(__import__("os").environ.get("OUT", "/tmp") + "/hlo_side.txt", "w").write(text)
print("logits equal with and without:", np.array_equal(outs[0], outs[4]))
