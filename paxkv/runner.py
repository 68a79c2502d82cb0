"""The one door between host and device: scheduled work -> padded arrays -> jitted step.

The runner owns the device state (params, KV pool, host swap pool) and the compiled step.
It pads every step to a shape bucket (tokens, sequences, block-table width, sampling rows),
so a steady workload reuses a handful of compiled programs; it counts compilations so tests
and benchmarks can check that steady state compiles nothing.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paxkv import transfer
from paxkv.cache import kv_pool as kvp
from paxkv.config import ModelConfig
from paxkv.model.batch import StepBatch
from paxkv.sampler import SamplingTensors, sample
from paxkv.sampling.rows import (FeatureSpans, ItemFeatures, RowFeatures, pack_item_features,
                                 pack_masks, pack_row_features)

NUM_BANNED = 8  # width of the per-row banned-token list (min_tokens: eos + stop ids)
_NO_PROMPT_LOGPROBS = (np.zeros(0, np.int32), np.zeros(0, np.int32))


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """Powers of two from lo up to (and including) hi, hi itself as the last bucket."""
    out, b = [], max(1, lo)
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return out


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass
class WorkItem:
    """One scheduled chunk, as the runner needs it: tokens to compute and where they go."""

    token_ids: Sequence[int]     # the tokens computed this step
    start: int                   # position of the first of them
    block_table: Sequence[int]
    features: ItemFeatures | None = None   # prompt logprobs / hidden states wanted back


class SampleRow(NamedTuple):
    """One token to sample, from the logits of work item `item` (a tuple: cheap to build)."""

    item: int
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    step: int = 0
    banned: Sequence[int] = ()
    num_logprobs: int = 0
    features: RowFeatures | None = None   # penalties, bias, bans, grammar mask


@dataclasses.dataclass
class HostSample:
    tokens: np.ndarray          # [R]
    logprobs: np.ndarray        # [R]
    top_ids: np.ndarray         # [R, K]
    top_logprobs: np.ndarray    # [R, K]
    # Per work item, through `spans`: prompt logprobs and hidden states (empty when unasked).
    prompt_logprobs: np.ndarray | None = None      # [P]
    prompt_top_ids: np.ndarray | None = None       # [P, KP]
    prompt_top_logprobs: np.ndarray | None = None  # [P, KP]
    hidden: np.ndarray | None = None               # [H, len(spans.hidden_layers), hidden]
    spans: FeatureSpans | None = None


@dataclasses.dataclass
class StepTiming:
    host_s: float = 0.0         # packing + dispatch on the host
    pack_s: float = 0.0         # of which: building the padded numpy arrays
    device_s: float = 0.0       # waiting for the device result
    compile_s: float = 0.0      # first call of a new shape bucket (traced + compiled)
    compiled: bool = False


def _unpack_inputs(buf: jax.Array, spec: transfer.Spec) -> tuple[StepBatch, SamplingTensors, jax.Array]:
    """-> (batch, sampling tensors, hidden-state token indices)."""
    arrays = transfer.unpack_device(buf, spec)
    n = len(StepBatch._fields)
    m = n + len(SamplingTensors._fields)
    return StepBatch(*arrays[:n]), SamplingTensors(*arrays[n:m]), arrays[m]


def _step_fn(params: Any, kv_pool: kvp.KVPool, inputs: jax.Array, *, spec: transfer.Spec,
             cfg: ModelConfig, backend: str, decode_only: bool, all_greedy: bool,
             num_logprobs: int, num_prompt_logprobs: int = 0,
             hidden_layers: tuple[int, ...] = ()) -> tuple[jax.Array, kvp.KVPool]:
    """One step; `inputs` is the packed StepBatch + SamplingTensors, and the sampled
    tokens, logprobs and top-k come back packed in one int32 buffer (`transfer.py`).

    Prompt logprobs ask the model for logits at the prompt positions too (appended after the
    S per-sequence rows); hidden states come out of the same forward pass.
    """
    from paxkv.model.llama import forward
    batch, st, hidden_at = _unpack_inputs(inputs, spec)
    fed = batch.token_ids[batch.logits_indices[st.logits_rows]]    # each row's newest token
    if st.prompt_positions.shape[0]:
        batch = batch._replace(logits_indices=jnp.concatenate([batch.logits_indices,
                                                               st.prompt_positions]))
    out = forward(params, batch, kv_pool, cfg, backend=backend, decode_only=decode_only,
                  hidden_at=hidden_at, hidden_layers=hidden_layers)
    logits, kv_pool = out[0], out[1]
    result = sample(logits, st, all_greedy=all_greedy, num_logprobs=num_logprobs,
                    num_prompt_logprobs=num_prompt_logprobs, fed_tokens=fed)
    arrays = tuple(result) + ((out[2].reshape(-1),) if hidden_layers else ())
    return transfer.pack_device(arrays), kv_pool


_jit_step = jax.jit(_step_fn, static_argnames=("spec", "cfg", "backend", "decode_only", "all_greedy",
                                               "num_logprobs", "num_prompt_logprobs",
                                               "hidden_layers"), donate_argnums=(1,))


def _forward_fn(params: Any, kv_pool: kvp.KVPool, inputs: jax.Array, *, spec: transfer.Spec,
                cfg: ModelConfig, backend: str, decode_only: bool,
                hidden_layers: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array, jax.Array, kvp.KVPool]:
    """The forward half of a split step: -> (logits, fed tokens, hidden or [0], new pool)."""
    from paxkv.model.llama import forward
    batch, st, hidden_at = _unpack_inputs(inputs, spec)
    fed = batch.token_ids[batch.logits_indices[st.logits_rows]]
    if st.prompt_positions.shape[0]:
        batch = batch._replace(logits_indices=jnp.concatenate([batch.logits_indices,
                                                               st.prompt_positions]))
    out = forward(params, batch, kv_pool, cfg, backend=backend, decode_only=decode_only,
                  hidden_at=hidden_at, hidden_layers=hidden_layers)
    hidden = out[2].reshape(-1) if hidden_layers else jnp.zeros((0,), jnp.float32)
    return out[0], fed, hidden, out[1]


def _sample_fn(logits: jax.Array, fed: jax.Array, hidden: jax.Array, inputs: jax.Array,
               masks: jax.Array, *, spec: transfer.Spec, all_greedy: bool, num_logprobs: int,
               num_prompt_logprobs: int, has_hidden: bool) -> jax.Array:
    """The sampling half of a split step, with the grammar masks that arrived meanwhile."""
    _, st, _ = _unpack_inputs(inputs, spec)
    result = sample(logits, st._replace(masks=masks), all_greedy=all_greedy,
                    num_logprobs=num_logprobs, num_prompt_logprobs=num_prompt_logprobs,
                    fed_tokens=fed)
    return transfer.pack_device(tuple(result) + ((hidden,) if has_hidden else ()))


_jit_forward = jax.jit(_forward_fn, static_argnames=("spec", "cfg", "backend", "decode_only",
                                                     "hidden_layers"), donate_argnums=(1,))
_jit_sample = jax.jit(_sample_fn, static_argnames=("spec", "all_greedy", "num_logprobs",
                                                   "num_prompt_logprobs", "has_hidden"))


def _multi_decode_fn(params: Any, kv_pool: kvp.KVPool, inputs: jax.Array, *, spec: transfer.Spec,
                     cfg: ModelConfig, backend: str, all_greedy: bool,
                     num_steps: int) -> tuple[jax.Array, kvp.KVPool]:
    """`num_steps` decode steps in one device call, each sampled token fed to the next step.

    Row i of the batch is sequence i (one token each) and sampling row i samples it. Padding
    rows (context 0) stay padding: they write to the null block and read nothing. Returns
    tokens and logprobs `[num_steps, rows]` packed in one buffer.
    """
    from paxkv.model.llama import forward
    batch, st, _ = _unpack_inputs(inputs, spec)
    num_seqs = batch.context_lens.shape[0]
    block_size = kv_pool.block_size
    valid = batch.context_lens > 0
    rows = jnp.arange(num_seqs, dtype=jnp.int32)

    def body(j, carry):
        pool, tokens, positions, context, out_tok, out_lp = carry
        slots = batch.block_tables[rows, positions // block_size] * block_size + positions % block_size
        slots = jnp.where(valid, slots, rows % block_size)
        step = batch._replace(token_ids=tokens, positions=positions, slot_mapping=slots,
                              context_lens=context)
        logits, pool = forward(params, step, pool, cfg, backend=backend, decode_only=True)
        res = sample(logits, st._replace(steps=st.steps + j), all_greedy=all_greedy, num_logprobs=0,
                     fed_tokens=tokens)
        out_tok = out_tok.at[j].set(res.tokens)
        out_lp = out_lp.at[j].set(res.logprobs)
        inc = valid.astype(jnp.int32)
        return pool, jnp.where(valid, res.tokens, 0), positions + inc, context + inc, out_tok, out_lp

    init = (kv_pool, batch.token_ids, batch.positions, batch.context_lens,
            jnp.zeros((num_steps, num_seqs), jnp.int32), jnp.zeros((num_steps, num_seqs), jnp.float32))
    kv_pool, _, _, _, out_tok, out_lp = jax.lax.fori_loop(0, num_steps, body, init)
    return transfer.pack_device((out_tok, out_lp)), kv_pool


_jit_multi_decode = jax.jit(_multi_decode_fn, static_argnames=("spec", "cfg", "backend", "all_greedy",
                                                               "num_steps"), donate_argnums=(1,))


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy_blocks(pool: kvp.KVPool, src: jax.Array, dst: jax.Array) -> kvp.KVPool:
    return kvp.copy_blocks(pool, src, dst)


_gather_blocks = jax.jit(kvp.gather_blocks)          # pages and (quantized pools) scales
_scatter_blocks = jax.jit(kvp.scatter_blocks, donate_argnums=(0,))


def profile_activation_bytes(cfg: ModelConfig, params: Any, *, backend: str, block_size: int,
                             kv_dtype: Any, max_num_seqs: int, max_num_batched_tokens: int,
                             max_model_len: int) -> int:
    """Device bytes the largest step needs beyond weights and pool (vLLM's profile run).

    Runs one prefill step of `max_num_batched_tokens` tokens over a two-block pool (every
    slot in the null block) and reads the allocator's peak. 0 where the device reports no
    memory statistics (CPU).
    """
    device = jax.devices()[0]
    before = (device.memory_stats() or {}).get("bytes_in_use", 0)
    runner = Runner(cfg, params, num_blocks=2, block_size=block_size, kv_dtype=kv_dtype,
                    backend=backend, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                    fixed_shapes=True)
    tokens = min(max_num_batched_tokens, max_model_len - 1)
    item = WorkItem([0] * tokens, 0, [0] * math.ceil(tokens / block_size))
    runner.execute([item], [SampleRow(0)])
    stats = device.memory_stats() or {}
    pool_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(runner.kv_pool))
    del runner
    return max(0, stats.get("peak_bytes_in_use", 0) - before - pool_bytes)


def _pack_inputs(batch: StepBatch, st: SamplingTensors,
                 hidden_at: np.ndarray | None = None) -> tuple[jax.Array, transfer.Spec]:
    """A step's host arrays -> one device buffer (one transfer) and its static spec."""
    if hidden_at is None:
        hidden_at = np.zeros(0, np.int32)
    buf, spec = transfer.pack_host(tuple(batch) + tuple(st) + (hidden_at,))
    return jax.device_put(buf), spec


class Runner:
    """Owns params, the KV pool and the host swap pool; runs one scheduled step at a time."""

    def __init__(self, cfg: ModelConfig, params: Any, *, num_blocks: int, block_size: int,
                 kv_dtype: Any, backend: str, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, num_host_blocks: int = 0, min_seq_bucket: int = 4,
                 min_token_bucket: int = 16, fixed_shapes: bool = False) -> None:
        """`fixed_shapes` (GPU): block tables always `max_model_len` wide and prefill/mixed
        steps always `max_num_seqs` rows, so a whole run compiles a handful of programs; the
        Pallas kernels loop over real lengths, so the padding costs them nothing."""
        self.cfg = cfg
        self.params = params
        self.block_size = block_size
        self.backend = backend
        self.kv_pool = kvp.init_pool(cfg, num_blocks, block_size, kv_dtype)
        max_blocks = math.ceil(max_model_len / block_size)
        self.token_buckets = pow2_buckets(min_token_bucket, max(min_token_bucket, max_num_batched_tokens))
        self.seq_buckets = pow2_buckets(min_seq_bucket, max(min_seq_bucket, max_num_seqs))
        self.block_buckets = [max_blocks] if fixed_shapes else pow2_buckets(4, max(4, max_blocks))
        self.fixed_shapes = fixed_shapes
        self.row_buckets = pow2_buckets(4, max(4, max_num_seqs * 4))
        self.copy_buckets = pow2_buckets(4, max(4, num_blocks))
        # Host swap pool: the device pool's layout (scales included) in numpy, num_host_blocks deep.
        self.host_pool: kvp.KVPool | None = jax.tree.map(
            lambda x: np.zeros((num_host_blocks,) + x.shape[1:], x.dtype),
            self.kv_pool) if num_host_blocks else None
        self.compiled_keys: set[tuple] = set()
        self.num_compilations = 0
        self.compile_time_s = 0.0

    # ---- block movement (copy-on-write, swap) -------------------------------------------
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: all of a step's block copies in one jitted gather/scatter."""
        if not pairs:
            return
        n = pick_bucket(len(pairs), self.copy_buckets)
        src = np.zeros(n, np.int32)
        dst = np.zeros(n, np.int32)
        src[:len(pairs)], dst[:len(pairs)] = zip(*pairs)
        self.kv_pool = _copy_blocks(self.kv_pool, jnp.asarray(src), jnp.asarray(dst))

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Device blocks -> host pool (preemption by swapping)."""
        if not pairs:
            return
        dev, host = (np.asarray(x, np.int32) for x in zip(*pairs))
        n = len(dev)
        padded = np.zeros(pick_bucket(n, self.copy_buckets), np.int32)  # pad: the null block
        padded[:n] = dev
        blocks = _gather_blocks(self.kv_pool, jnp.asarray(padded))
        for h, d in zip(jax.tree.leaves(self.host_pool), jax.tree.leaves(blocks)):
            h[host] = np.asarray(d)[:n]

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Host pool -> device blocks."""
        if not pairs:
            return
        host, dev = (np.asarray(x, np.int32) for x in zip(*pairs))
        n = len(dev)
        size = pick_bucket(n, self.copy_buckets)   # bucketed: a new count compiles nothing
        host_p = np.full(size, host[0], np.int32)
        host_p[:n] = host
        dev_p = np.zeros(size, np.int32)           # padding rows land in the null block
        dev_p[:n] = dev
        blocks = jax.tree.map(lambda h: jnp.asarray(h[host_p]), self.host_pool)
        self.kv_pool = _scatter_blocks(self.kv_pool, jnp.asarray(dev_p), blocks)

    # ---- the step -----------------------------------------------------------------------
    def pack(self, items: Sequence[WorkItem]) -> tuple[StepBatch, bool]:
        """Ragged work -> padded StepBatch arrays (numpy) of a bucketed shape."""
        bs = self.block_size
        n = len(items)
        q_lens = np.fromiter((len(it.token_ids) for it in items), np.int32, n)
        decode_only = n > 0 and bool(np.all(q_lens == 1))
        num_seqs = pick_bucket(n, self.seq_buckets)
        if self.fixed_shapes and not decode_only:
            num_seqs = self.seq_buckets[-1]
        width = pick_bucket(max(len(it.block_table) for it in items), self.block_buckets)
        tables = np.zeros((num_seqs, width), np.int32)
        for i, it in enumerate(items):
            tables[i, :len(it.block_table)] = it.block_table
        starts = np.fromiter((it.start for it in items), np.int32, n)
        cu = np.zeros(num_seqs + 1, np.int32)
        np.cumsum(q_lens, out=cu[1:n + 1])
        cu[n + 1:] = cu[n]
        context = np.zeros(num_seqs, np.int32)
        context[:n] = starts + q_lens
        if decode_only:   # the hot path: one token per sequence, no per-token Python
            num_tokens = num_seqs
            tokens = np.zeros(num_tokens, np.int32)
            tokens[:n] = np.fromiter((it.token_ids[0] for it in items), np.int32, n)
            positions = np.zeros(num_tokens, np.int32)
            positions[:n] = starts
            slots = np.arange(num_tokens, dtype=np.int32) % bs
            slots[:n] = tables[np.arange(n), starts // bs] * bs + starts % bs
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
            slots[real] = tables[rows[real], pos // bs] * bs + pos % bs
        logits_idx = np.maximum(cu[1:] - 1, 0).astype(np.int32)
        return StepBatch(tokens, positions, slots, tables, context, cu, logits_idx), decode_only

    def pack_sampling(self, rows: Sequence[SampleRow]) -> tuple[SamplingTensors, bool, int]:
        r = pick_bucket(max(1, len(rows)), self.row_buckets)
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
        all_greedy = not bool(np.any(temperature[:n] > 0.0))
        k = max(cols[8]) if n else 0
        k = 0 if k == 0 else min(self.cfg.vocab_size, 1 << (k - 1).bit_length())
        return st, all_greedy, k

    def _account(self, key: tuple, new: bool, timing: StepTiming, t0: float, t1: float,
                 t2: float) -> None:
        """A new shape bucket's first call is compile time; otherwise split host / device."""
        if new:
            self.compiled_keys.add(key)
            self.num_compilations += 1
            timing.compiled = True
            timing.compile_s = t2 - t0
            self.compile_time_s += t2 - t0
        else:
            timing.host_s = t1 - t0
            timing.device_s = t2 - t1

    def execute_multi_decode(self, items: Sequence[WorkItem], rows: Sequence[SampleRow],
                             num_steps: int) -> tuple[HostSample, StepTiming]:
        """`num_steps` decode steps over `items` (one token each, row i samples item i).

        Blocks for all the steps' tokens must already be reserved. Returns tokens and logprobs
        of shape `[num_steps, len(items)]`.
        """
        timing = StepTiming()
        t0 = time.perf_counter()
        batch, decode_only = self.pack(items)
        if not decode_only:
            raise ValueError("execute_multi_decode needs one new token per sequence")
        num_seqs = batch.context_lens.shape[0]
        n = len(items)
        padded = list(rows) + [SampleRow(i) for i in range(n, num_seqs)]
        st, all_greedy, _ = self.pack_sampling(padded)
        st = jax.tree.map(lambda x: x[:num_seqs], st)
        timing.pack_s = time.perf_counter() - t0
        key = ("multi", num_seqs, batch.block_tables.shape[1], st.banned.shape[1], all_greedy, num_steps)
        new = key not in self.compiled_keys
        inputs, spec = _pack_inputs(batch, st)
        out, self.kv_pool = _jit_multi_decode(
            self.params, self.kv_pool, inputs, spec=spec, cfg=self.cfg, backend=self.backend,
            all_greedy=all_greedy, num_steps=num_steps)
        t1 = time.perf_counter()
        shape = (num_steps, num_seqs)
        out_tok, out_lp = transfer.unpack_host(np.asarray(out), ((shape, "int32"), (shape, "float32")))
        host = HostSample(out_tok[:, :n], out_lp[:, :n],
                          np.zeros((n, 0), np.int32), np.zeros((n, 0), np.float32))
        self._account(key, new, timing, t0, t1, time.perf_counter())
        return host, timing

    def execute(self, items: Sequence[WorkItem], rows: Sequence[SampleRow],
                fill_masks: Callable[[list[SampleRow]], list[SampleRow]] | None = None,
                ) -> tuple[HostSample, StepTiming]:
        """Run one step over `items` and sample `rows`; blocks until the sampled ids are on host.

        `fill_masks` (structured outputs): rows whose grammar masks are still to be computed
        -> the rows with them. The step then runs in two halves: the forward is dispatched
        first, the host computes the masks while the device runs it, and the sampler follows
        with the masks (one more small transfer).
        """
        timing = StepTiming()
        t0 = time.perf_counter()
        batch, decode_only = self.pack(items)
        st, all_greedy, k = self.pack_sampling(rows)
        hidden_at, spans = None, None
        if any(it.features is not None for it in items):
            prompt_pos, prompt_targets, hidden_at, spans = pack_item_features(
                [it.features for it in items], batch.cu_q_lens, batch.logits_indices)
            st = st._replace(prompt_positions=prompt_pos, prompt_targets=prompt_targets)
        kp = min(spans.num_prompt_logprobs, self.cfg.vocab_size) if spans else 0
        layers = spans.hidden_layers if spans else ()
        timing.pack_s = time.perf_counter() - t0
        masks_shape = st.masks.shape
        if fill_masks is not None:     # the masks travel in the second half
            st = st._replace(masks=np.zeros((0, masks_shape[1]), np.int32))
        inputs, spec = _pack_inputs(batch, st, hidden_at)
        key = (spec, decode_only, all_greedy, k, kp, layers, fill_masks is not None, masks_shape)
        new = key not in self.compiled_keys
        if fill_masks is None:
            out, self.kv_pool = _jit_step(
                self.params, self.kv_pool, inputs, spec=spec, cfg=self.cfg, backend=self.backend,
                decode_only=decode_only, all_greedy=all_greedy, num_logprobs=k,
                num_prompt_logprobs=kp, hidden_layers=layers)
        else:
            logits, fed, hidden, self.kv_pool = _jit_forward(
                self.params, self.kv_pool, inputs, spec=spec, cfg=self.cfg, backend=self.backend,
                decode_only=decode_only, hidden_layers=layers)
            t_mask = time.perf_counter()
            rows = fill_masks(list(rows))          # host work while the device runs the forward
            masks = pack_masks([r.features for r in rows], self.cfg.vocab_size)
            timing.pack_s += time.perf_counter() - t_mask
            out = _jit_sample(logits, fed, hidden, inputs, jax.device_put(masks), spec=spec,
                              all_greedy=all_greedy, num_logprobs=k, num_prompt_logprobs=kp,
                              has_hidden=bool(layers))
        t1 = time.perf_counter()
        r = st.seeds.shape[0]
        p = st.prompt_positions.shape[0]
        out_spec = [((r,), "int32"), ((r,), "float32"), ((r, k), "int32"), ((r, k), "float32"),
                    ((p,), "float32"), ((p, kp), "int32"), ((p, kp), "float32")]
        if layers:
            h = 0 if hidden_at is None else hidden_at.shape[0]
            out_spec.append(((h, len(layers), self.cfg.hidden_size), "float32"))
        parts = transfer.unpack_host(np.asarray(out), tuple(out_spec))
        host = HostSample(*parts[:7], hidden=parts[7] if layers else None, spans=spans)
        self._account(key, new, timing, t0, t1, time.perf_counter())
        return host, timing
