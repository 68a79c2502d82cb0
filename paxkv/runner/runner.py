"""The one door between host and device: scheduled work -> padded arrays -> jitted step.

The runner owns the device state (params, KV pool, host swap pool) and the compiled step.
It pads every step to a shape bucket (tokens, sequences, block-table width, sampling rows),
so a steady workload reuses a handful of compiled programs; it counts compilations so tests
and benchmarks can check that steady state compiles nothing.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paxkv.cache import kv_pool as kvp
from paxkv.cache.quant import storage_dtype
from paxkv.config import AttentionPlan, ModelConfig, RunnerConfig
from paxkv.engine.step_io import HostSample, SampleRow, StepTiming, WorkItem
from paxkv.model.batch import StepBatch
from paxkv.runner import transfer
from paxkv.runner.buckets import mixed_step_row_floor, pick_bucket
from paxkv.runner.table_rows import TableRows
from paxkv.sampler import SamplingTensors, log_softmax_rows, sample
from paxkv.sampling.rows import (bucket, pack_item_features, pack_masks, pack_row_features,
                                 sampling_mode, widen_sampling_mode)

NUM_BANNED = 8  # width of the per-row banned-token list (min_tokens: eos + stop ids)
_NO_PROMPT_LOGPROBS = (np.zeros(0, np.int32), np.zeros(0, np.int32))
# A verify step on fixed shapes has at least this many token rows (a power of two): the
# attention kernels tile query rows in 64s (one Mosaic GPU wgmma tile).
VERIFY_MIN_TOKENS = 64
_TOKEN_IDS = operator.attrgetter("token_ids")
_BLOCK_TABLE = operator.attrgetter("block_table")
_START = operator.attrgetter("start")
_FIRST = operator.itemgetter(0)


def _unpack_inputs(buf: jax.Array, spec: transfer.Spec) -> tuple[StepBatch, SamplingTensors, jax.Array]:
    """-> (batch, sampling tensors, hidden-state token indices)."""
    arrays = transfer.unpack_device(buf, spec)
    n = len(StepBatch._fields)
    m = n + len(SamplingTensors._fields)
    return StepBatch(*arrays[:n]), SamplingTensors(*arrays[n:m]), arrays[m]


def _feed(token_ids: jax.Array, prev_tokens: jax.Array) -> jax.Array:
    """Placeholders (negative ids, `-(row + 1)`) take the previous step's sampled token of
    that row, which never left the device (asynchronous scheduling)."""
    src = jnp.clip(-token_ids - 1, 0, prev_tokens.shape[0] - 1)
    return jnp.where(token_ids < 0, prev_tokens[src], token_ids)


def _pad_rows(tokens: jax.Array, num_rows: int) -> jax.Array:
    return jnp.zeros((num_rows,), jnp.int32).at[:tokens.shape[0]].set(tokens)


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """Everything that makes one compiled step program: the one static argument of every
    jitted step below (a value not seen before compiles a new program). The arrays a step
    reads travel packed in `inputs`, described by `spec`."""

    spec: transfer.Spec
    cfg: ModelConfig
    plan: AttentionPlan
    sampling_mode: str
    decode_only: bool = False
    num_logprobs: int = 0                 # top-k logprobs per sampled row
    num_prompt_logprobs: int = 0
    hidden_layers: tuple[int, ...] = ()   # layers whose residual stream comes back
    mesh: Any = None                      # tensor parallelism
    num_steps: int = 1                    # decode steps per call (multi-step decoding)
    num_draft_tokens: int = 0             # > 0: a speculative verify step of k drafts


def _forward_with_features(params: Any, kv_pool: kvp.KVPool, inputs: jax.Array,
                           prev_tokens: jax.Array, p: StepProgram) -> tuple:
    """The forward of a step: -> (logits, each row's newest token, hidden or None, pool, st).

    Prompt logprobs ask the model for logits at the prompt positions too (appended after the
    S per-sequence rows); hidden states come out of the same forward pass.
    """
    from paxkv.model.forward import forward
    batch, st, hidden_at = _unpack_inputs(inputs, p.spec)
    batch = batch._replace(token_ids=_feed(batch.token_ids, prev_tokens))
    fed = batch.token_ids[batch.logits_indices[st.logits_rows]]    # each row's newest token
    if st.prompt_positions.shape[0]:
        batch = batch._replace(logits_indices=jnp.concatenate([batch.logits_indices,
                                                               st.prompt_positions]))
    out = forward(params, batch, kv_pool, p.cfg, plan=p.plan, decode_only=p.decode_only,
                  mesh=p.mesh, hidden_at=hidden_at, hidden_layers=p.hidden_layers)
    hidden = out[2].reshape(-1) if p.hidden_layers else None
    return out[0], fed, hidden, out[1], st


def _step_fn(params: Any, kv_pool: kvp.KVPool, inputs: jax.Array, prev_tokens: jax.Array, *,
             program: StepProgram) -> tuple[jax.Array, jax.Array, kvp.KVPool]:
    """One step; `inputs` is the packed StepBatch + SamplingTensors, and the sampled
    tokens, logprobs and top-k come back packed in one int32 buffer (`transfer.py`).

    Also returns the sampled tokens padded to `prev_tokens`' length: the next step's
    `prev_tokens`, so placeholders can be filled without a round trip to the host.
    """
    p = program
    logits, fed, hidden, kv_pool, st = _forward_with_features(params, kv_pool, inputs,
                                                              prev_tokens, p)
    result = sample(logits, st, mode=p.sampling_mode, num_logprobs=p.num_logprobs,
                    num_prompt_logprobs=p.num_prompt_logprobs, fed_tokens=fed,
                    invariant=p.cfg.batch_invariant)
    arrays = tuple(result) + ((hidden,) if p.hidden_layers else ())
    return (transfer.pack_device(arrays), _pad_rows(result.tokens, prev_tokens.shape[0]),
            kv_pool)


def _forward_fn(params: Any, kv_pool: kvp.KVPool, inputs: jax.Array, prev_tokens: jax.Array, *,
                program: StepProgram) -> tuple:
    """The forward half of a split step: -> (logits, fed tokens, hidden or [0], new pool)."""
    logits, fed, hidden, kv_pool, _ = _forward_with_features(params, kv_pool, inputs,
                                                             prev_tokens, program)
    if hidden is None:
        hidden = jnp.zeros((0,), jnp.float32)
    return logits, fed, hidden, kv_pool


def _sample_fn(logits: jax.Array, fed: jax.Array, hidden: jax.Array, inputs: jax.Array,
               masks: jax.Array, prev_tokens: jax.Array, *,
               program: StepProgram) -> tuple[jax.Array, jax.Array]:
    """The sampling half of a split step, with the grammar masks that arrived meanwhile."""
    p = program
    _, st, _ = _unpack_inputs(inputs, p.spec)
    result = sample(logits, st._replace(masks=masks), mode=p.sampling_mode,
                    num_logprobs=p.num_logprobs, num_prompt_logprobs=p.num_prompt_logprobs,
                    fed_tokens=fed, invariant=p.cfg.batch_invariant)
    return (transfer.pack_device(tuple(result) + ((hidden,) if p.hidden_layers else ())),
            _pad_rows(result.tokens, prev_tokens.shape[0]))


def _multi_decode_fn(params: Any, kv_pool: kvp.KVPool, inputs: jax.Array, prev_tokens: jax.Array, *,
                     program: StepProgram) -> tuple[jax.Array, jax.Array, kvp.KVPool]:
    """`num_steps` decode steps in one device call, each sampled token fed to the next step.

    Row i of the batch is sequence i (one token each) and sampling row i samples it. Padding
    rows (context 0) stay padding: they write to the null block and read nothing. Returns
    tokens and logprobs `[num_steps, rows]` packed in one buffer.
    """
    from paxkv.model.forward import forward
    p = program
    batch, st, _ = _unpack_inputs(inputs, p.spec)
    batch = batch._replace(token_ids=_feed(batch.token_ids, prev_tokens))
    num_seqs = batch.context_lens.shape[0]
    block_size = kv_pool.block_size
    valid = batch.context_lens > 0
    rows = jnp.arange(num_seqs, dtype=jnp.int32)

    def body(j, carry):
        pool, tokens, positions, context, out_tok, out_lp = carry
        # [S] slots, or [G, S] with several KV groups (their tables' leading axis)
        slots = (batch.block_tables[..., rows, positions // block_size] * block_size
                 + positions % block_size)
        slots = jnp.where(valid, slots, rows % block_size)
        step = batch._replace(token_ids=tokens, positions=positions, slot_mapping=slots,
                              context_lens=context)
        logits, pool = forward(params, step, pool, p.cfg, plan=p.plan, decode_only=True,
                               mesh=p.mesh)
        res = sample(logits, st._replace(steps=st.steps + j), mode=p.sampling_mode,
                     num_logprobs=0, fed_tokens=tokens, invariant=p.cfg.batch_invariant)
        out_tok = out_tok.at[j].set(res.tokens)
        out_lp = out_lp.at[j].set(res.logprobs)
        inc = valid.astype(jnp.int32)
        return pool, jnp.where(valid, res.tokens, 0), positions + inc, context + inc, out_tok, out_lp

    init = (kv_pool, batch.token_ids, batch.positions, batch.context_lens,
            jnp.zeros((p.num_steps, num_seqs), jnp.int32),
            jnp.zeros((p.num_steps, num_seqs), jnp.float32))
    kv_pool, _, _, _, out_tok, out_lp = jax.lax.fori_loop(0, p.num_steps, body, init)
    return (transfer.pack_device((out_tok, out_lp)), _pad_rows(out_tok[-1], prev_tokens.shape[0]),
            kv_pool)


def _verify_fn(params: Any, kv_pool: kvp.KVPool, inputs: jax.Array, prev_tokens: jax.Array, *,
               program: StepProgram) -> tuple[jax.Array, jax.Array, kvp.KVPool]:
    """A speculative verify step: work item r is a sequence's last token followed by its
    drafts (up to k = `num_draft_tokens`), sampling row r verifies it. One forward writes
    every token's KV and gives logits at each; `spec_decode.rejection` keeps the drafts the
    target's distribution admits and draws the token after them. Returns tokens and their
    raw logprobs `[k + 1, rows]` (-1 past a row's emitted tokens) packed in one buffer; with
    `hidden_layers` (an EAGLE proposer's features) also those layers' residual stream at each
    row's k + 1 positions, `[rows, k + 1, layers, hidden]`, from the same forward."""
    from paxkv.model.forward import forward
    from paxkv.spec_decode.rejection import rejection_sample, target_probs
    p = program
    k = p.num_draft_tokens
    batch, st, _ = _unpack_inputs(inputs, p.spec)
    batch = batch._replace(token_ids=_feed(batch.token_ids, prev_tokens))
    num_tokens = batch.token_ids.shape[0]
    item = st.logits_rows                                                     # [R]
    first = batch.cu_q_lens[item]
    count = batch.cu_q_lens[item + 1] - first                                 # 1 + drafts
    at = jnp.minimum(first[:, None] + jnp.arange(k + 1)[None, :], num_tokens - 1)
    out = forward(params, batch, kv_pool, p.cfg, plan=p.plan, all_logits=True, mesh=p.mesh,
                  hidden_at=at.reshape(-1) if p.hidden_layers else None,
                  hidden_layers=p.hidden_layers)
    logits, kv_pool = out[0], out[1]                                          # [T, V]
    vocab = logits.shape[1]
    rows = logits[at]                                                         # [R, k + 1, V]
    drafts = batch.token_ids[at[:, 1:]]
    r = item.shape[0]

    def per_position(x: jax.Array) -> jax.Array:
        return jnp.repeat(x, k + 1)

    probs = target_probs(rows.reshape(-1, vocab), per_position(st.temperature),
                         per_position(st.top_k), per_position(st.top_p),
                         per_position(st.min_p)).reshape(r, k + 1, vocab)
    res = rejection_sample(probs, drafts, jnp.maximum(count - 1, 0), st.seeds, st.steps)
    raw = log_softmax_rows(rows, p.cfg.batch_invariant)
    lp = jnp.take_along_axis(raw, jnp.maximum(res.tokens, 0)[..., None], axis=-1)[..., 0]
    last = jnp.take_along_axis(res.tokens, (res.num_emitted - 1)[:, None], axis=1)[:, 0]
    arrays = (res.tokens.T, lp.T)
    if p.hidden_layers:
        arrays += (out[2].reshape(r, k + 1, len(p.hidden_layers), -1),)
    return transfer.pack_device(arrays), _pad_rows(last, prev_tokens.shape[0]), kv_pool


# The step programs: the pool is donated, so XLA updates its pages in place.
_jit_step = jax.jit(_step_fn, static_argnames="program", donate_argnums=(1,))
_jit_forward = jax.jit(_forward_fn, static_argnames="program", donate_argnums=(1,))
_jit_sample = jax.jit(_sample_fn, static_argnames="program")
_jit_multi_decode = jax.jit(_multi_decode_fn, static_argnames="program", donate_argnums=(1,))
_jit_verify = jax.jit(_verify_fn, static_argnames="program", donate_argnums=(1,))


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_blocks(pool: kvp.KVPool, src: jax.Array, dst: jax.Array) -> kvp.KVPool:
    return kvp.copy_blocks(pool, src, dst)


_gather_blocks = jax.jit(kvp.gather_blocks)          # pages and (quantized pools) scales
_scatter_blocks = jax.jit(kvp.scatter_blocks, donate_argnums=(0,))


def _pack_inputs(batch: StepBatch, st: SamplingTensors, mesh: Any = None,
                 hidden_at: np.ndarray | None = None) -> tuple[jax.Array, transfer.Spec]:
    """A step's host arrays -> one device buffer (one transfer; under tensor parallelism the
    same buffer to every device) and its static spec."""
    if hidden_at is None:
        hidden_at = np.zeros(0, np.int32)
    buf, spec = transfer.pack_host(tuple(batch) + tuple(st) + (hidden_at,))
    if mesh is not None:
        from paxkv.parallel.sharding import put_replicated
        return put_replicated(buf, mesh), spec
    return jax.device_put(buf), spec


class Runner:
    """Owns params, the KV pool and the host swap pool; runs one scheduled step at a time."""

    def __init__(self, params: Any, config: RunnerConfig, mesh: Any = None) -> None:
        """`config` comes from `config.runner_config`, which derived and checked it.

        `mesh` (tensor parallelism, `paxkv.parallel`): `params` are split over it and the
        pool is split by KV heads; the host swap pool holds this process's heads. None (one
        device) runs the single-device code below and nothing of `paxkv.parallel`."""
        self.config = config
        self._take_shapes(config)
        self.params = params
        self.mesh = mesh
        self._allocate_pool()
        # Host swap pool: the device pool's layout (scales included) in numpy, num_host_blocks
        # deep (under tensor parallelism: this process's heads of it).
        num_host_blocks = config.num_host_blocks
        self.host_pool: kvp.KVPool | None = jax.tree.map(
            lambda x: np.zeros((num_host_blocks,) + self._local_shape(x)[1:], x.dtype),
            self.kv_pool) if num_host_blocks else None
        # The host KV tier: evicted cached blocks, in the pool's layout (`cache/host_tier.py`
        # keeps which slot holds what). Offloads are gathered on the device and copied to the
        # host asynchronously; they land in these arrays at the next fetch or load.
        self.offload_pool: kvp.KVPool | None = jax.tree.map(
            lambda x: np.zeros((config.num_offload_blocks,) + self._local_shape(x)[1:], x.dtype),
            self.kv_pool) if config.num_offload_blocks else None
        self._pending_offloads: list[tuple[Any, np.ndarray]] = []
        # The last step's sampled tokens, kept on the device for the next step's placeholders.
        self._last_tokens = self._ids(np.zeros((self.row_buckets[-1],), np.int32))
        self.compiled_keys: set[tuple] = set()
        self.num_compilations = 0
        self.compile_time_s = 0.0
        self.asleep = 0                     # sleep level (0: awake)
        self.weights_stale = False          # woken from level 2: zeros until new weights
        self._slept_params: Any = None      # level 1: the weights in host memory
        self._param_shardings: Any = None

    def _allocate_pool(self) -> None:
        config = self.config
        storage = storage_dtype(config.kv_cache_dtype)
        if self.mesh is None:
            self.kv_pool = kvp.init_pool(config.model, config.num_blocks, config.block_size, storage)
        else:
            from paxkv.parallel import sharding
            self.kv_pool = sharding.init_pool(config.model, config.num_blocks, config.block_size,
                                              storage, self.mesh)

    def sleep(self, level: int = 1) -> None:
        """Free the device: the KV pool, and the weights (level 1: kept in host memory, level 2:
        dropped, to be replaced by `update_weights` after `wake_up`). vLLM's levels."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.asleep:
            raise RuntimeError(f"the engine is already asleep (level {self.asleep})")
        self._land_offloads()
        self._param_shardings = jax.tree.map(lambda x: x.sharding, self.params)
        self._param_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.params)
        self._slept_params = jax.device_get(self.params) if level == 1 else None
        host_pool, offload_pool = self.host_pool, self.offload_pool
        self.release(params=True)
        self.host_pool, self.offload_pool = host_pool, offload_pool   # host memory: kept
        self.asleep = level

    def wake_up(self) -> None:
        """Back to the device: the weights (level 1: as they were; level 2: zeros of the
        right shapes and placement, for `update_weights` to fill) and an empty KV pool."""
        if not self.asleep:
            return
        if self._slept_params is not None:
            self.params = jax.device_put(self._slept_params, self._param_shardings)
        else:
            self.params = jax.tree.map(lambda s, sh: jax.device_put(np.zeros(s.shape, s.dtype), sh),
                                       self._param_shapes, self._param_shardings)
        self._slept_params = None
        self._allocate_pool()
        self._last_tokens = self._ids(np.zeros((self.row_buckets[-1],), np.int32))
        self.asleep = 0

    def _take_shapes(self, config: RunnerConfig) -> None:
        """The settings the packing reads, as attributes (a profiler may narrow a bucket list)."""
        self.cfg = config.model
        self.block_size = config.block_size
        self.backend = config.attention_backend
        self.plan = config.attention
        self.fixed_shapes = config.fixed_shapes
        self.token_buckets = list(config.token_buckets)
        self.seq_buckets = list(config.seq_buckets)
        self.block_buckets = list(config.block_buckets)
        self.row_buckets = list(config.row_buckets)
        self.copy_buckets = list(config.copy_buckets)

    # ---- block movement (copy-on-write, swap) -------------------------------------------
    def _local_shape(self, x: jax.Array) -> tuple[int, ...]:
        if self.mesh is None:
            return x.shape
        from paxkv.parallel.sharding import HEADS_AXIS, local_heads
        heads = local_heads(x.sharding, x.shape)
        return x.shape[:HEADS_AXIS] + (heads.stop - heads.start,) + x.shape[HEADS_AXIS + 1:]

    def _ids(self, ids: np.ndarray) -> jax.Array:
        """Host ints for a jitted call (under tensor parallelism: on every device)."""
        if self.mesh is None:
            return jnp.asarray(ids)
        from paxkv.parallel.sharding import put_replicated
        return put_replicated(ids, self.mesh)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: all of a step's block copies in one jitted gather/scatter (each
        device copies its own heads of the blocks)."""
        if not pairs:
            return
        n = pick_bucket(len(pairs), self.copy_buckets)
        src = np.zeros(n, np.int32)
        dst = np.zeros(n, np.int32)
        src[:len(pairs)], dst[:len(pairs)] = zip(*pairs)
        self.kv_pool = _copy_blocks(self.kv_pool, self._ids(src), self._ids(dst))

    def _gather(self, dev: np.ndarray) -> kvp.KVPool:
        """Device blocks `dev` of every layer, gathered on the device (a bucketed count)."""
        padded = np.zeros(pick_bucket(len(dev), self.copy_buckets), np.int32)  # pad: null block
        padded[:len(dev)] = dev
        return _gather_blocks(self.kv_pool, self._ids(padded))

    def _to_host(self, blocks: kvp.KVPool, host: kvp.KVPool, slots: np.ndarray) -> None:
        """Gathered `blocks` (this process's heads) into rows `slots` of host arrays."""
        if self.mesh is not None:
            from paxkv.parallel.sharding import to_host_local
            blocks = jax.tree.map(to_host_local, blocks)
        for h, d in zip(jax.tree.leaves(host), jax.tree.leaves(blocks)):
            h[slots] = np.asarray(d)[:len(slots)]

    def _scatter_from_host(self, host: kvp.KVPool, pairs: Sequence[tuple[int, int]]) -> None:
        """Host rows -> device blocks, for (host row, device block) `pairs`."""
        src, dev = (np.asarray(x, np.int32) for x in zip(*pairs))
        n = len(dev)
        size = pick_bucket(n, self.copy_buckets)   # bucketed: a new count compiles nothing
        src_p = np.full(size, src[0], np.int32)
        src_p[:n] = src
        dev_p = np.zeros(size, np.int32)           # padding rows land in the null block
        dev_p[:n] = dev
        if self.mesh is None:
            blocks = jax.tree.map(lambda h: jnp.asarray(h[src_p]), host)
        else:
            from paxkv.parallel.sharding import from_host_local
            blocks = jax.tree.map(lambda h, x: from_host_local(h[src_p], x.sharding, (size,) + x.shape[1:]),
                                  host, self.kv_pool)
        self.kv_pool = _scatter_blocks(self.kv_pool, self._ids(dev_p), blocks)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Device blocks -> host pool (preemption by swapping)."""
        if not pairs:
            return
        dev, host = (np.asarray(x, np.int32) for x in zip(*pairs))
        self._to_host(self._gather(dev), self.host_pool, host)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Host pool -> device blocks."""
        if pairs:
            self._scatter_from_host(self.host_pool, pairs)

    def offload(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Evicted device blocks -> host KV tier slots, for (device block, slot) `pairs`. The
        copy to the host starts now and overlaps the step; it lands at the next fetch."""
        if not pairs:
            return
        dev, slots = (np.asarray(x, np.int32) for x in zip(*pairs))
        blocks = self._gather(dev)
        if self.mesh is None:
            for leaf in jax.tree.leaves(blocks):
                leaf.copy_to_host_async()
        self._pending_offloads.append((blocks, slots))

    def _land_offloads(self) -> None:
        for blocks, slots in self._pending_offloads:
            self._to_host(blocks, self.offload_pool, slots)
        self._pending_offloads = []

    def load(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Host KV tier slots -> device blocks, for (slot, device block) `pairs` (a prefix
        hit on blocks the device had evicted)."""
        if pairs:
            self._land_offloads()     # a slot may have been offloaded by this very step
            self._scatter_from_host(self.offload_pool, pairs)

    # ---- the step -----------------------------------------------------------------------
    _table_rows: dict[tuple[int, int], TableRows] | None = None   # per table shape, made on use

    def _table_rows_of(self, num_seqs: int, width: int, group: int = 0) -> TableRows:
        """The last packed block tables of this shape (most rows are unchanged next step)."""
        if self._table_rows is None:
            self._table_rows = {}
        rows = self._table_rows.get((num_seqs, width, group))
        if rows is None:
            rows = self._table_rows[num_seqs, width, group] = TableRows(num_seqs, width)
        return rows

    def _group_tables(self, items: Sequence[WorkItem], num_seqs: int, width: int,
                      tables: np.ndarray) -> np.ndarray:
        """`[G, S, width]`: group 0's packed `tables` and every other KV group's."""
        groups = [tables]
        for g in range(1, len(items[0].group_tables) + 1):
            groups.append(self._table_rows_of(num_seqs, width, g).fill(
                [it.group_tables[g - 1] for it in items]))
        return np.stack(groups)

    def pack(self, items: Sequence[WorkItem], tokens_per_seq: int = 0) -> tuple[StepBatch, bool]:
        """Ragged work -> padded StepBatch arrays (numpy) of a bucketed shape.

        `tokens_per_seq` > 0: a verify step, each item at most that many tokens. On fixed
        shapes it is padded to its own sequence bucket and that many tokens a sequence (a
        power of two, at least `VERIFY_MIN_TOKENS`), not to a prefill step's largest
        sequence bucket and token buckets: one stream's verify step of 5 tokens would
        otherwise compute 256."""
        bs = self.block_size
        n = len(items)
        # map + attrgetter walk the items in C: generators cost a Python frame per item.
        token_lists = list(map(_TOKEN_IDS, items))
        block_tables = list(map(_BLOCK_TABLE, items))
        q_lens = np.fromiter(map(len, token_lists), np.int32, n)
        decode_only = n > 0 and bool(np.all(q_lens == 1))
        num_seqs = pick_bucket(n, self.seq_buckets)
        if self.fixed_shapes and not decode_only and not tokens_per_seq:
            num_seqs = self.seq_buckets[-1]
        # Fixed shapes: only decode steps pick a table width (`config.fixed_block_buckets`)
        width = (pick_bucket(max(map(len, block_tables)), self.block_buckets)
                 if decode_only or not self.fixed_shapes else self.block_buckets[-1])
        tables = self._table_rows_of(num_seqs, width).fill(block_tables)
        grouped = n > 0 and len(items[0].group_tables) > 0
        if grouped:   # several KV groups: [G, S, width] tables, [G, T] slots
            tables = self._group_tables(items, num_seqs, width, tables)
        starts = np.fromiter(map(_START, items), np.int32, n)
        cu = np.zeros(num_seqs + 1, np.int32)
        np.cumsum(q_lens, out=cu[1:n + 1])
        cu[n + 1:] = cu[n]
        context = np.zeros(num_seqs, np.int32)
        context[:n] = starts + q_lens
        if decode_only:   # the hot path: one token per sequence, no per-token Python
            num_tokens = num_seqs
            tokens = np.zeros(num_tokens, np.int32)
            tokens[:n] = np.fromiter(map(_FIRST, token_lists), np.int32, n)
            positions = np.zeros(num_tokens, np.int32)
            positions[:n] = starts
            slots = np.arange(num_tokens, dtype=np.int32) % bs
            if grouped:
                slots = np.tile(slots, (tables.shape[0], 1))
                slots[:, :n] = tables[:, np.arange(n), starts // bs] * bs + starts % bs
            else:
                slots[:n] = tables[np.arange(n), starts // bs] * bs + starts % bs
        else:
            if tokens_per_seq and self.fixed_shapes:
                num_tokens = bucket(num_seqs * tokens_per_seq, VERIFY_MIN_TOKENS)
            else:
                num_tokens = pick_bucket(int(cu[n]), self.token_buckets)
            tokens = np.zeros(num_tokens, np.int32)
            positions = np.zeros(num_tokens, np.int32)
            slots = np.arange(num_tokens, dtype=np.int32) % bs   # padding -> the null block's slots
            rows = np.zeros(num_tokens, np.int32)
            for i, it in enumerate(items):
                a, b = cu[i], cu[i + 1]
                tokens[a:b] = it.token_ids
                positions[a:b] = np.arange(it.start, it.start + (b - a), dtype=np.int32)
                rows[a:b] = i
            real = slice(0, int(cu[n]))
            pos = positions[real]
            if grouped:
                slots = np.tile(slots, (tables.shape[0], 1))
                slots[:, real] = tables[:, rows[real], pos // bs] * bs + pos % bs
            else:
                slots[real] = tables[rows[real], pos // bs] * bs + pos % bs
        logits_idx = np.maximum(cu[1:] - 1, 0).astype(np.int32)
        return StepBatch(tokens, positions, slots, tables, context, cu, logits_idx), decode_only

    def pack_step(self, items: Sequence[WorkItem], rows: Sequence[SampleRow],
                  ) -> tuple[StepBatch, bool, SamplingTensors, str, int]:
        """`pack` and `pack_sampling` as a step's program sees them: (batch, decode_only,
        sampling tensors, sampling mode, top-logprob k). On fixed shapes a prefill or mixed step
        samples at least `buckets.mixed_step_row_floor` rows."""
        batch, decode_only = self.pack(items)
        floor = 0
        if self.fixed_shapes and not decode_only:
            floor = mixed_step_row_floor(batch.token_ids.shape[0], self.seq_buckets[-1])
        return (batch, decode_only, *self.pack_sampling(rows, floor))

    def pack_sampling(self, rows: Sequence[SampleRow], min_rows: int = 0) -> tuple[SamplingTensors, str, int]:
        r = pick_bucket(max(1, min_rows, len(rows)), self.row_buckets)
        n = len(rows)
        cols = list(zip(*rows)) if rows else [()] * len(SampleRow._fields)

        def col(index: int, dtype: Any, pad: Any) -> np.ndarray:
            out = np.full(r, pad, dtype)
            out[:n] = cols[index]
            return out

        any_banned = any(cols[7]) if n else False
        banned = np.full((r, NUM_BANNED if any_banned else 0), -1, np.int32)
        if any_banned:
            for i, ids in enumerate(cols[7]):
                ids = list(ids)[:NUM_BANNED]
                banned[i, :len(ids)] = ids
        temperature = col(1, np.float32, 0.0)
        features = pack_row_features(cols[9] if n else (), r, self.cfg.vocab_size)
        st = SamplingTensors(col(0, np.int32, 0), temperature, col(2, np.int32, -1),
                             col(3, np.float32, 1.0), col(4, np.float32, 0.0), col(5, np.int32, 0),
                             col(6, np.int32, 0), banned, *features, *_NO_PROMPT_LOGPROBS)
        mode = sampling_mode(temperature[:n], st.top_k[:n], st.top_p[:n], st.min_p[:n])
        k = max(cols[8]) if n else 0
        k = 0 if k == 0 else min(self.cfg.vocab_size, 1 << (k - 1).bit_length())
        return st, mode, k

    def _dispatched(self, pending: "PendingStep") -> "PendingStep":
        """Compile accounting happens at dispatch: a new bucket's first call traces and
        compiles before it returns (the run itself is still asynchronous)."""
        if pending.new:
            self.compiled_keys.add(pending.key)
            self.num_compilations += 1
            pending.compile_s = pending.t_dispatched - pending.t_start
            self.compile_time_s += pending.compile_s
        return pending

    def dispatch_multi_decode(self, items: Sequence[WorkItem], rows: Sequence[SampleRow],
                              num_steps: int) -> "PendingStep":
        """Queue `num_steps` decode steps over `items` (one token each, row i samples item i).

        Blocks for all the steps' tokens must already be reserved. `fetch` returns tokens and
        logprobs of shape `[num_steps, len(items)]`.
        """
        t0 = time.perf_counter()
        batch, decode_only = self.pack(items)
        if not decode_only:
            raise ValueError("dispatch_multi_decode needs one new token per sequence")
        num_seqs = batch.context_lens.shape[0]
        n = len(items)
        padded = list(rows) + [SampleRow(i) for i in range(n, num_seqs)]
        st, mode, _ = self.pack_sampling(padded)
        st = jax.tree.map(lambda x: x[:num_seqs], st)
        pack_s = time.perf_counter() - t0
        inputs, spec = _pack_inputs(batch, st, self.mesh)
        program = StepProgram(spec, self.cfg, self.plan, mode, decode_only=True, mesh=self.mesh,
                              num_steps=num_steps)
        key = ("multi", program)
        new = key not in self.compiled_keys
        out, self._last_tokens, self.kv_pool = _jit_multi_decode(
            self.params, self.kv_pool, inputs, self._last_tokens, program=program)
        shape = (num_steps, num_seqs)
        return self._dispatched(PendingStep(out, ((shape, "int32"), (shape, "float32")), n, 0, key,
                                            new, t0, time.perf_counter(), pack_s, multi=True))

    def dispatch(self, items: Sequence[WorkItem], rows: Sequence[SampleRow],
                 fill_masks: Callable[[list[SampleRow]], list[SampleRow]] | None = None,
                 force_sampling_mode: str | None = None) -> "PendingStep":
        """Queue one step over `items` sampling `rows`; returns at once (JAX dispatch is
        asynchronous), except for the first call of a shape bucket, which compiles.

        `fill_masks` (structured outputs): rows whose grammar masks are still to be computed
        -> the rows with them. The step then runs in two halves: the forward is dispatched
        first, the host computes the masks while the device runs it, and the sampler follows
        with the masks (one more small transfer).

        `force_sampling_mode` takes a more general sampler path than the rows need (ablations:
        `scripts/bench_sampler_modes.py` times the sort a temperature-only step skips).
        """
        t0 = time.perf_counter()
        batch, decode_only, st, mode, k = self.pack_step(items, rows)
        mode = widen_sampling_mode(mode, force_sampling_mode)
        hidden_at, spans = None, None
        if any(it.features is not None for it in items):
            prompt_pos, prompt_targets, hidden_at, spans = pack_item_features(
                [it.features for it in items], batch.cu_q_lens, batch.logits_indices)
            st = st._replace(prompt_positions=prompt_pos, prompt_targets=prompt_targets)
        kp = min(spans.num_prompt_logprobs, self.cfg.vocab_size) if spans else 0
        layers = spans.hidden_layers if spans else ()
        pack_s = time.perf_counter() - t0
        masks_shape = st.masks.shape
        if fill_masks is not None:     # the masks travel in the second half
            st = st._replace(masks=np.zeros((0, masks_shape[1]), np.int32))
        inputs, spec = _pack_inputs(batch, st, self.mesh, hidden_at)
        program = StepProgram(spec, self.cfg, self.plan, mode, decode_only=decode_only,
                              num_logprobs=k, num_prompt_logprobs=kp, hidden_layers=layers,
                              mesh=self.mesh)
        key = (program, fill_masks is not None, masks_shape)
        new = key not in self.compiled_keys
        if fill_masks is None:
            out, self._last_tokens, self.kv_pool = _jit_step(
                self.params, self.kv_pool, inputs, self._last_tokens, program=program)
        else:
            logits, fed, hidden, self.kv_pool = _jit_forward(
                self.params, self.kv_pool, inputs, self._last_tokens, program=program)
            t_mask = time.perf_counter()
            rows = fill_masks(list(rows))          # host work while the device runs the forward
            masks = pack_masks([r.features for r in rows], self.cfg.vocab_size)
            pack_s += time.perf_counter() - t_mask
            out, self._last_tokens = _jit_sample(
                logits, fed, hidden, inputs, self._ids(masks), self._last_tokens,
                program=program)
        r = st.seeds.shape[0]
        p = st.prompt_positions.shape[0]
        out_spec = [((r,), "int32"), ((r,), "float32"), ((r, k), "int32"), ((r, k), "float32"),
                    ((p,), "float32"), ((p, kp), "int32"), ((p, kp), "float32")]
        if layers:
            h = 0 if hidden_at is None else hidden_at.shape[0]
            out_spec.append(((h, len(layers), self.cfg.hidden_size), "float32"))
        pending = PendingStep(out, tuple(out_spec), len(rows), k, key, new, t0,
                              time.perf_counter(), pack_s)
        pending.spans, pending.has_hidden = spans, bool(layers)
        return self._dispatched(pending)

    def dispatch_verify(self, items: Sequence[WorkItem], rows: Sequence[SampleRow],
                        num_draft_tokens: int, hidden_layers: tuple[int, ...] = ()
                        ) -> "PendingStep":
        """Queue a speculative verify step (`_verify_fn`): item r is a sequence's last token
        and its drafts, row r samples it; returns tokens and logprobs `[k + 1, rows]`, -1
        past a row's emitted tokens, as `fetch` gives them. `hidden_layers` (an EAGLE
        proposer's `(num_layers,)`): `fetch`'s `hidden` is also those layers' residual
        stream at each row's k + 1 positions, `[rows, k + 1, layers, hidden]`; none asked,
        the program is the plain verify step's."""
        t0 = time.perf_counter()
        batch, _ = self.pack(items, tokens_per_seq=num_draft_tokens + 1)
        st, mode, _ = self.pack_sampling(rows)
        pack_s = time.perf_counter() - t0
        inputs, spec = _pack_inputs(batch, st, self.mesh)
        layers = tuple(hidden_layers)
        program = StepProgram(spec, self.cfg, self.plan, mode, mesh=self.mesh,
                              num_draft_tokens=num_draft_tokens, hidden_layers=layers)
        key = (program,)
        new = key not in self.compiled_keys
        out, self._last_tokens, self.kv_pool = _jit_verify(
            self.params, self.kv_pool, inputs, self._last_tokens, program=program)
        r = st.seeds.shape[0]
        shape = (num_draft_tokens + 1, r)
        out_spec = ((shape, "int32"), (shape, "float32"))
        if layers:
            out_spec += (((r, num_draft_tokens + 1, len(layers), self.cfg.hidden_size),
                          "float32"),)
        pending = PendingStep(out, out_spec, len(rows), 0, key, new, t0, time.perf_counter(),
                              pack_s, multi=True)
        pending.has_hidden = bool(layers)
        return self._dispatched(pending)

    def fetch(self, pending: "PendingStep") -> tuple[HostSample, StepTiming]:
        """Wait for a dispatched step and bring its sampled ids to the host. The timing's
        compile_s is the dispatch's (the engine books it on the step that dispatched)."""
        timing = StepTiming(pack_s=pending.pack_s, compile_s=pending.compile_s,
                            compiled=pending.new)
        t_wait = time.perf_counter()
        arrays = transfer.unpack_host(np.asarray(pending.out), pending.out_spec)
        if self._pending_offloads:    # copied to the host while the step ran
            self._land_offloads()
        if pending.multi:
            n = pending.num_rows
            host = HostSample(arrays[0][:, :n], arrays[1][:, :n],
                              np.zeros((n, 0), np.int32), np.zeros((n, 0), np.float32),
                              hidden=arrays[2][:n] if pending.has_hidden else None)
        else:
            host = HostSample(*arrays[:7], hidden=arrays[7] if pending.has_hidden else None,
                              spans=pending.spans)
        timing.device_s = time.perf_counter() - t_wait
        timing.host_s = pending.t_dispatched - pending.t_start
        return host, timing

    def precompile(self, num_scheduler_steps: int = 1, use_tqdm: bool = True) -> int:
        """Compile every step program of `precompile.reachable_step_shapes` in each sampler
        mode (greedy, sampled, sampled with top-k/top-p/min-p; `precompile.SAMPLERS`), and the
        multi-step decode of each decode bucket when `num_scheduler_steps` > 1, so no request
        of a plain workload waits on a compilation. Call before the first request: the dummy
        steps write only the null block. Returns the programs compiled."""
        from paxkv.runner.precompile import SAMPLERS, dummy_step, reachable_step_shapes
        shapes = reachable_step_shapes(self.config)
        work = [(shape, sampler, steps) for shape in shapes for sampler in SAMPLERS
                for steps in ((1, num_scheduler_steps) if shape.decode_only and num_scheduler_steps > 1
                              else (1,))]
        before, saved = self.num_compilations, self._last_tokens
        if use_tqdm:
            from tqdm.auto import tqdm
            work = tqdm(work, desc="Precompiling step shapes", dynamic_ncols=True)
        for shape, sampler, steps in work:
            items, rows = dummy_step(shape, self.config, sampler)
            if steps > 1:
                self.fetch(self.dispatch_multi_decode(items, rows, steps))
            else:
                self.fetch(self.dispatch(items, rows))
        self._last_tokens = saved
        return self.num_compilations - before

    def step_scratch_bytes(self, items: Sequence[WorkItem], rows: Sequence[SampleRow]) -> int:
        """Device memory one step over `items` needs beyond its inputs, by XLA's analysis of
        the compiled program (so it does not depend on what else the process allocated)."""
        batch, decode_only, st, mode, k = self.pack_step(items, rows)
        inputs, spec = _pack_inputs(batch, st, self.mesh, None)
        program = StepProgram(spec, self.cfg, self.plan, mode, decode_only=decode_only,
                              num_logprobs=k, mesh=self.mesh)
        compiled = _jit_step.lower(self.params, self.kv_pool, inputs, self._last_tokens,
                                   program=program).compile()
        mem = compiled.memory_analysis()
        if mem is None:
            return 0
        outputs = mem.output_size_in_bytes - mem.alias_size_in_bytes
        return int(mem.temp_size_in_bytes + max(0, outputs))

    def release(self, params: bool = True) -> None:
        """Free the device memory held here (the pool, and the params unless told not to:
        a profile runner shares the engine's) now, not when garbage collected."""
        held = (self.params if params else None, self.kv_pool, self._last_tokens)
        for leaf in jax.tree.leaves(held):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
        self.params = None
        self.kv_pool = None
        self.host_pool = None
        self.offload_pool = None
        self._pending_offloads = []

    def execute(self, items: Sequence[WorkItem], rows: Sequence[SampleRow],
                fill_masks: Callable[[list[SampleRow]], list[SampleRow]] | None = None,
                ) -> tuple[HostSample, StepTiming]:
        """Run one step over `items` and sample `rows`; blocks until the sampled ids are on host."""
        return self.fetch(self.dispatch(items, rows, fill_masks))

    def execute_multi_decode(self, items: Sequence[WorkItem], rows: Sequence[SampleRow],
                             num_steps: int) -> tuple[HostSample, StepTiming]:
        """`dispatch_multi_decode` then `fetch`: tokens and logprobs `[num_steps, len(items)]`."""
        return self.fetch(self.dispatch_multi_decode(items, rows, num_steps))


@dataclasses.dataclass
class PendingStep:
    """A dispatched step whose results are still on the device."""

    out: jax.Array                  # the packed result buffer
    out_spec: transfer.Spec
    num_rows: int
    num_logprobs: int
    key: tuple                      # its shape bucket (compile accounting)
    new: bool                       # first call of that bucket: its dispatch compiled
    t_start: float
    t_dispatched: float
    pack_s: float
    multi: bool = False
    compile_s: float = 0.0          # set at dispatch for a new bucket
    spans: Any = None               # prompt logprobs / hidden states: where each item's are
    has_hidden: bool = False
