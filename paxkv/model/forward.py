"""The paged forward the engine runs, for every family: one step over a ragged `StepBatch`.

`forward(params, batch, kv_pool, cfg)` runs the family's network (`layers.DecoderLM`) with
`attention.PagedAttention` as each layer's attention: for each layer it writes the new
tokens' K/V into the page pool at `batch.slot_mapping` and then attends through
`batch.block_tables` (so cached context and the causal part of the new chunk come from the
same pages). It returns float32 logits of the last new token of every sequence and the new
pool. `cfg`, `backend`, `plan`, `decode_only` and `all_logits` are static.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from paxkv.cache.kv_layout import kv_layout
from paxkv.cache.kv_pool import KVPool
from paxkv.config import ModelConfig
from paxkv.model.attention import AttentionPlan, PagedAttention
from paxkv.model.batch import StepBatch
from paxkv.model.layers import DecoderLM, params_dtype

Params = Any  # nested dict of arrays, the Linen "params" collection


def _check_batch(batch: StepBatch, kv_pool: KVPool, cfg: ModelConfig) -> None:
    if batch.token_ids.ndim != 1:
        raise ValueError(f"forward: batch.token_ids must be 1-D [T], got shape {batch.token_ids.shape}")
    if batch.positions.shape != batch.token_ids.shape:
        raise ValueError(f"forward: batch.positions shape {batch.positions.shape} != "
                         f"token_ids shape {batch.token_ids.shape}")
    if batch.slot_mapping.shape[-1:] != batch.token_ids.shape:
        raise ValueError(f"forward: batch.slot_mapping shape {batch.slot_mapping.shape} does not "
                         f"end in token_ids' {batch.token_ids.shape}")
    slots = kv_layout(cfg).slots
    if kv_pool.num_layers != slots:
        raise ValueError(f"forward: kv_pool has {kv_pool.num_layers} layer slots, the model's "
                         f"KV layout {slots}")
    if kv_pool.k[0].shape[2:] != (cfg.num_kv_heads, cfg.head_dim):
        raise ValueError(f"forward: kv_pool pages {kv_pool.k[0].shape} do not hold "
                         f"{cfg.num_kv_heads} kv heads of dim {cfg.head_dim}")


def forward(params: Params, batch: StepBatch, kv_pool: KVPool, cfg: ModelConfig, *,
            backend: str = "reference", plan: AttentionPlan | None = None,
            decode_only: bool = False, all_logits: bool = False, mesh: Any = None,
            hidden_at: jax.Array | None = None,
            hidden_layers: tuple[int, ...] = ()) -> tuple[jax.Array, ...]:
    """One paged step -> (logits `[S, vocab]` float32 at `batch.logits_indices`, new pool).

    `plan` (static): how the step attends (`attention.AttentionPlan`, which the runner's
    config chose); None takes `backend`'s default plan. With `all_logits=True` the logits of
    every token are returned instead (`[T, vocab]`), e.g. for perplexity. `mesh` (static):
    the tensor-parallel mesh that `params` and `kv_pool` are split over (`paxkv.parallel`);
    None runs on one device. With `hidden_layers` (static) a third output holds those
    layers' residual stream at token indices `hidden_at` (`DecoderLM.__call__`), from the
    same pass.
    """
    _check_batch(batch, kv_pool, cfg)
    if plan is None:
        plan = AttentionPlan.for_backend(backend, tensor_parallel=mesh is not None)
    if cfg.batch_invariant and plan.fused:   # the fused layer kernels are not invariant
        plan = dataclasses.replace(plan, fused=False)
    attention = PagedAttention(cfg, batch, plan, decode_only, mesh)
    model = DecoderLM(cfg, params_dtype(params), fused=plan.fused)
    logits_at = None if all_logits else batch.logits_indices
    return model.apply({"params": params}, batch.token_ids, batch.positions, attention,
                       kv_pool, logits_at=logits_at, hidden_at=hidden_at,
                       hidden_layers=hidden_layers)


def forward_all_logits(params: Params, batch: StepBatch, kv_pool: KVPool, cfg: ModelConfig, *,
                       backend: str = "reference") -> tuple[jax.Array, KVPool]:
    """Like `forward` but returns logits of every token, `[T, vocab]` float32."""
    return forward(params, batch, kv_pool, cfg, backend=backend, all_logits=True)


# The engine's step: the pool is donated so XLA updates its pages in place.
forward_jit = jax.jit(forward, static_argnames=("cfg", "backend", "plan", "decode_only",
                                               "all_logits", "mesh", "hidden_layers"),
                      donate_argnames=("kv_pool",))
