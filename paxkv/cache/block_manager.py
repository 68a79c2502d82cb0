"""Host-side bookkeeping of the paged KV pool: which physical block holds which tokens.

The device pool is `num_blocks` pages of `block_size` token slots. This module never touches
the pages; it hands out block ids and tells the caller which block copies to run. The
blocks themselves (ref counts, free list, LRU of evictable cached blocks, prefix index) are
kept by two `BlockPool`s, one for the device pages and one for the host swap space; this
module keeps what is per sequence:

- Block tables. Block 0 is the null block (padding writes there): never allocated, never
  freed. A table holds a block once; a block's ref count is the number of tables holding it.
- Copy-on-write. Forked sequences share blocks. Before a step writes into a block that
  another table also holds, the writer gets a fresh block; if the shared block already holds
  computed tokens, a (src, dst) copy is returned for the device to run first. Full blocks
  are never written again, so they stay shared for their whole life.
- Prefix caching. A block that is full and computed is registered under the key
  (hash of the previous block's key, tokens of this block): the key names the whole prefix.
  A new sequence reuses the registered blocks of its longest cached prefix. Blocks no table
  holds stay registered ("evictable") and are recycled least-recently-used when the free
  pool is empty. Keys are compared exactly on the block's tokens; the parent link is a
  64-bit hash, so two different prefixes alias only on a hash collision of their parents.
- Swap. Preempted sequences can move to a host pool of `num_host_blocks`; a block shared by
  several of the sequences swapped together moves once.

- KV groups (`paxkv/cache/kv_layout.py`). A model whose layers attend differently keeps one
  table per group of layers (`seq.block_table` for group 0, `seq.group_tables` for the
  rest), all drawing block ids from one pool. A sliding-window group gives a block back to
  the pool as soon as no query the sequence will compute can see it (its table then holds
  the null block there), so its memory stays O(window). Its prefix hits need only the
  blocks the next query's window covers. Group 0 of a model with one group is exactly the
  single table of before, on the same code paths.

The scheduler's per-step call is `allocate_slots(plan)`: it checks a whole group's plan and
commits it in one step, or returns None and changes nothing (except giving back blocks no
window can see any more), so the caller can preempt and ask again.

Plain Python on purpose: per step work is a few list operations per sequence.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from paxkv.cache.block_pool import NULL_BLOCK, BlockPool
from paxkv.cache.host_tier import HostKVTier
from pallas_kernels.arith import cdiv
from paxkv.cache.kv_layout import blocks_held
from paxkv.config import CacheConfig

if TYPE_CHECKING:   # the manager only reads and writes the fields it owns
    from paxkv.engine.sequence import Sequence

BlockKey = tuple  # (parent hash | None, tuple of block_size token ids)
Plan = Iterable[tuple["Sequence", int]]  # (sequence, number of new tokens to compute)
Copies = list[tuple[int, int]]         # (src, dst) block copies for the device to run

__all__ = ["NULL_BLOCK", "BlockManager", "BlockKey", "Copies", "Plan"]


def _as_list(seqs: "Sequence | Iterable[Sequence]") -> list["Sequence"]:
    return [seqs] if hasattr(seqs, "seq_id") else list(seqs)


HOST_NULL = -1   # a host table's entry for a block a window had given back (host ids start at 0)


def tables(seq: "Sequence") -> list[list[int]]:
    """Every block table of `seq`, group 0 first."""
    return [seq.block_table, *seq.group_tables]


class BlockManager:
    """Block tables, copy-on-write, fork, prefix reuse, swap maps and the admission watermark
    over a device `BlockPool` and a host `BlockPool`.

    The host pool keeps no prefix index. Host blocks are a parking space, not a cache tier:
    a host block lives from the swap-out of its group to the group's swap-in (or free), the
    only thing that ever reads it is the copy back to the device, and the attention kernels
    read device pages only, so a prefix hit on the host would still cost a fresh device block
    and a copy. Keeping unowned host blocks around would only shrink the room for the next
    swap-out, which falls back to recomputation when the host pool is full. The prefix itself
    is not lost by swapping: swap-out releases the device blocks, and the registered ones stay
    in the device pool's index (evictable) until they are needed for something else.
    """

    def __init__(self, cache: CacheConfig, windows: tuple[int | None, ...] = (None,)) -> None:
        """`cache` with its pool sized (`num_gpu_blocks` set; `CacheConfig` checked the rest,
        `num_offload_blocks` the host KV tier's size); `windows`: each KV group's sliding
        window, None for full attention (`kv_layout.KVLayout.windows`; one full group by
        default)."""
        if cache.num_gpu_blocks is None:
            raise ValueError("CacheConfig.num_gpu_blocks is not set: size the pool first "
                             "(EngineConfig.with_pool)")
        self.cache = cache
        self.num_blocks = cache.num_gpu_blocks
        self.block_size = cache.block_size
        self.num_host_blocks = cache.num_cpu_blocks
        self.enable_prefix_caching = cache.enable_prefix_caching
        self.watermark = cache.watermark
        self.watermark_blocks = int(cache.watermark * self.num_blocks)
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must name each KV group's window (None or >= 1), "
                             f"got {windows}")
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        # The single full-attention table: every per-step path below keeps its old fast form.
        self._plain = self.windows == (None,)

        self.device_pool = BlockPool(self.num_blocks, enable_caching=self.enable_prefix_caching,
                                     reserve_null_block=True, name="device")
        self.host_pool = BlockPool(self.num_host_blocks, name="host")

        # The host KV tier: cached blocks the device pool evicts are copied there, and a
        # prefix hit on them copies them back (`host_tier.py`). The copies of one schedule
        # wait in the lists below until the scheduler takes them (`take_tier_copies`).
        self.host_tier: HostKVTier | None = None
        self._offloads: Copies = []    # (device block, tier slot), before the block is reused
        self._tier_loads: Copies = []  # (tier slot, device block), before the step reads it
        if cache.num_offload_blocks:
            if not self._plain or not self.enable_prefix_caching:
                raise ValueError("kv_offloading_size needs prefix caching and a model whose "
                                 "layers all attend to the full context (one KV group)")
            self.host_tier = HostKVTier(cache.num_offload_blocks)
            self.device_pool.on_evict = self._offload

        self._device_seqs: dict[int, Sequence] = {}  # sequences whose table is on device
        self._host_seqs: dict[int, Sequence] = {}    # sequences whose table is on host

        # Counters for metrics.
        self.prefix_cache_queries = 0      # tokens of sequences looked up in the cache
        self.prefix_cache_hits = 0         # of those, tokens served from cached blocks
        self.num_cow_copies = 0
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0

    # ------------------------------------------------------------------ accounting
    @property
    def num_free_blocks(self) -> int:
        """Blocks holding nothing useful (excludes evictable cached blocks)."""
        return self.device_pool.num_free

    @property
    def num_cached_evictable_blocks(self) -> int:
        """Unowned blocks kept for prefix reuse; reclaimed LRU when needed."""
        return self.device_pool.num_evictable

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can take: free + evictable."""
        return self.device_pool.num_available

    @property
    def num_used_blocks(self) -> int:
        """Physical blocks held by at least one block table."""
        return self.device_pool.num_used

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free

    @property
    def num_used_host_blocks(self) -> int:
        return self.host_pool.num_used

    @property
    def num_evictions(self) -> int:
        """Cached blocks recycled to make room (device pool)."""
        return self.device_pool.num_evictions

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def logical_blocks_in_use(self) -> int:
        """Blocks the device-resident sequences would need with no sharing at all.

        Counts tokens whose K/V is written (the just-sampled token has none yet), so it
        compares like for like with the physical blocks in use. A sliding group needs only
        the blocks its window still covers.
        """
        bs = self.block_size   # a list, not a generator: this runs every step, over every sequence
        if self._plain:
            return sum([-(-s.num_computed_tokens // bs) for s in self._device_seqs.values()])
        total = 0
        for s in self._device_seqs.values():
            held = -(-s.num_computed_tokens // bs)
            for w in self.windows:
                total += held - (0 if w is None else min(held, self._first_live(w, s.num_computed_tokens)))
        return total

    def num_tokens_in_use(self) -> int:
        """Token slots the device-resident sequences fill (shared tokens counted per sequence)."""
        return sum(len(s.token_ids) for s in self._device_seqs.values())

    def blocks_per_sequence(self, num_tokens: int, chunk: int | None = None) -> int:
        """Blocks one sequence of `num_tokens` tokens holds at most, over every group, when
        it is computed in chunks of at most `chunk` tokens (None: all at once): a sliding
        group holds its window plus the chunk being written."""
        return sum(blocks_held(w, num_tokens, self.block_size, chunk) for w in self.windows)

    def ref_count(self, block: int) -> int:
        """Tables holding device block `block`."""
        return self.device_pool.ref_counts[block]

    def is_on_device(self, seq: Sequence) -> bool:
        return seq.seq_id in self._device_seqs

    def is_on_host(self, seq: Sequence) -> bool:
        return seq.seq_id in self._host_seqs

    # ------------------------------------------------------------------ windows
    def _first_live(self, window: int, start: int) -> int:
        """The first block a query at position `start` or later can still see through
        `window`: keys at positions > query - window."""
        return max(0, start - window + 1) // self.block_size

    def _release_out_of_window(self, seq: Sequence, start: int) -> None:
        """Give back the blocks of `seq`'s sliding groups that no query at `start` or later
        can see: their table entries become the null block."""
        freed = seq.num_window_freed
        if not freed:
            freed.extend([0] * self.num_groups)
        pool = self.device_pool
        for g, (w, table) in enumerate(zip(self.windows, tables(seq))):
            if w is None:
                continue
            stop = min(self._first_live(w, start), len(table))
            if stop <= freed[g]:
                continue
            gone = [b for b in table[freed[g]:stop] if b != NULL_BLOCK]
            table[freed[g]:stop] = [NULL_BLOCK] * (stop - freed[g])
            pool.free(reversed(gone))
            freed[g] = stop

    # ------------------------------------------------------------------ prefix cache
    def _ensure_keys(self, seq: Sequence, num_full_blocks: int) -> list[BlockKey]:
        keys = seq.block_hashes
        bs = self.block_size
        toks = seq.token_ids
        while len(keys) < num_full_blocks:
            i = len(keys)
            parent = hash(keys[-1]) if keys else None
            keys.append((parent, tuple(toks[i * bs:(i + 1) * bs])))
        return keys

    @staticmethod
    def _group_key(group: int, key: BlockKey) -> BlockKey:
        """Group g's pages of a prefix are other blocks than group 0's: its own key."""
        return key if group == 0 else (group, key)

    def _lookup(self, seq: Sequence) -> list[list[int]]:
        """Each group's cached blocks of the longest prefix every group has cached, for a new
        sequence (empty lists: no hit); a sliding group's list holds the null block before
        the blocks the first uncached query's window covers.

        Capped at (num_tokens - 1) // block_size blocks so at least the last token is
        computed: the step that computes it produces the logits to sample from.
        """
        pool = self.device_pool
        if not self.enable_prefix_caching or not pool.num_cached or seq.skip_prefix_cache:
            return [[] for _ in self.windows]
        cap = (len(seq.token_ids) - 1) // self.block_size
        keys = self._ensure_keys(seq, cap)
        get = pool.get_cached_block
        if self._plain:
            hits = []
            for i in range(cap):
                b = get(keys[i])
                if b is None:
                    break
                hits.append(b)
            return [hits]
        found: list[dict[int, int | None]] = [{} for _ in self.windows]

        def hit(g: int, i: int) -> int | None:
            if i not in found[g]:
                found[g][i] = get(self._group_key(g, keys[i]))
            return found[g][i]

        h = cap
        for g, w in enumerate(self.windows):         # full groups: consecutive from block 0
            if w is None:
                h = next((i for i in range(h) if hit(g, i) is None), h)
        moved = True
        while moved and h > 0:                       # sliding groups: the blocks they read
            moved = False
            for g, w in enumerate(self.windows):
                if w is None:
                    continue
                lo = self._first_live(w, h * self.block_size)
                miss = next((i for i in range(h - 1, lo - 1, -1) if hit(g, i) is None), None)
                if miss is not None:
                    h, moved = miss, True
        out = []
        for g, w in enumerate(self.windows):
            lo = 0 if w is None else self._first_live(w, h * self.block_size)
            out.append([NULL_BLOCK] * lo + [hit(g, i) for i in range(lo, h)])
        return out

    def _tier_hits(self, seq: Sequence, start: int) -> list[BlockKey]:
        """The keys of the blocks after the device's `start` cached ones that the host tier
        holds, consecutively (as `_lookup`, capped to leave the last token to compute)."""
        tier = self.host_tier
        if tier is None or not len(tier) or seq.skip_prefix_cache:
            return []
        cap = (len(seq.token_ids) - 1) // self.block_size
        keys = self._ensure_keys(seq, cap)
        out = []
        for i in range(start, cap):
            if keys[i] not in tier:
                break
            out.append(keys[i])
        return out

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens `allocate` would serve from the prefix cache (the device's, then the host
        tier's) for this new sequence."""
        if seq.seq_id in self._device_seqs:
            return 0
        hits = len(self._lookup(seq)[0])
        return (hits + len(self._tier_hits(seq, hits))) * self.block_size

    def _offload(self, block: int, key: BlockKey) -> None:
        """The device pool evicts cached `block`: keep a copy in the host tier."""
        slot = self.host_tier.store(key)
        if slot is not None:
            self._offloads.append((block, slot))

    def take_tier_copies(self) -> tuple[Copies, Copies]:
        """The host tier's copies this schedule made: (device block, tier slot) offloads,
        to run before anything writes those blocks, and (tier slot, device block) loads, to
        run before the step reads them. Clears both."""
        offloads, loads = self._offloads, self._tier_loads
        self._offloads, self._tier_loads = [], []
        if self.host_tier is not None:
            self.host_tier.unpin_all()
        return offloads, loads

    def mark_computed(self, seq: Sequence, num_computed_tokens: int | None = None) -> None:
        """Register the sequence's blocks that are now full and computed in the prefix cache.

        A block whose key is already registered (the same prefix computed twice, e.g. by two
        requests admitted in the same step) stays unregistered and is freed normally.
        """
        if not self.enable_prefix_caching or seq.seq_id not in self._device_seqs:
            return
        n = seq.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        full = min(n, len(seq.token_ids)) // self.block_size
        start = seq.num_registered_blocks
        if full <= start:
            return
        keys = self._ensure_keys(seq, full)
        cache_block = self.device_pool.cache_block
        for g, table in enumerate(tables(seq)):
            for i in range(start, full):
                if table[i] != NULL_BLOCK:       # given back by a window before it was full
                    cache_block(table[i], self._group_key(g, keys[i]))
        seq.num_registered_blocks = full

    def reset_prefix_cache(self) -> int:
        """Drop every evictable cached block back to the free pool, and the host tier's;
        returns how many device blocks."""
        if self.host_tier is not None:
            self.host_tier.reset()
        return self.device_pool.reset_prefix_cache()

    # ------------------------------------------------------------------ allocation
    def _blocks_to_allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks that `allocate(seq, num_tokens)` takes out of the available pool.

        The one place both `blocks_to_allocate` and `can_allocate` count from (a subclass
        that reserves differently overrides this).
        """
        want = cdiv(num_tokens, self.block_size)
        if seq.seq_id in self._device_seqs:
            return sum(max(0, want - len(t)) for t in tables(seq))
        refs = self.device_pool.ref_counts
        total = 0
        for hits in self._lookup(seq):
            total += sum(1 for b in hits if b != NULL_BLOCK and refs[b] == 0)
            total += max(0, want - len(hits))
        return total

    def blocks_to_allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `allocate(seq, num_tokens)` would take (evictable prefix hits included)."""
        return self._blocks_to_allocate(seq, num_tokens)

    def can_allocate(self, seq: Sequence, num_tokens: int, use_watermark: bool = True) -> bool:
        """Whether `allocate(seq, num_tokens)` fits, keeping the watermark free for admissions."""
        reserve = self.watermark_blocks if use_watermark else 0
        return self._blocks_to_allocate(seq, num_tokens) <= self.num_available_blocks - reserve

    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Make `seq`'s tables cover `num_tokens` tokens; returns the prefix-cached tokens.

        For a sequence the manager does not hold yet (new, or re-admitted after a recompute
        preemption) the tables first take the cached blocks of its longest cached prefix;
        the caller sets `num_computed_tokens` to the returned count. For a held sequence it
        only appends fresh blocks (no copy-on-write: use `allocate_slots` before writing).
        """
        if seq.seq_id in self._host_seqs:
            raise ValueError(f"sequence {seq.seq_id} is swapped out: swap_in before allocating")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if self._blocks_to_allocate(seq, num_tokens) > self.num_available_blocks:
            raise RuntimeError(f"cannot allocate {num_tokens} tokens for sequence {seq.seq_id}: "
                               f"{self.num_available_blocks} blocks available")
        pool = self.device_pool
        cached_tokens = 0
        if seq.seq_id not in self._device_seqs:
            if seq.block_table or any(seq.group_tables):
                raise ValueError(f"sequence {seq.seq_id} has a block_table the manager does not own")
            hits = self._lookup(seq)
            seq.group_tables = [[] for _ in range(self.num_groups - 1)]
            for table, group_hits in zip(tables(seq), hits):
                pool.touch([b for b in group_hits if b != NULL_BLOCK])
                table.extend(group_hits)
            # A sliding group's hits start with null blocks: those before its window.
            seq.num_window_freed = ([] if self._plain else
                                    [sum(1 for b in group_hits if b == NULL_BLOCK)
                                     for group_hits in hits])
            cached_tokens = len(hits[0]) * self.block_size
            if self.host_tier is not None:   # the prefix continues in the host tier
                for key in self._tier_hits(seq, len(hits[0])):
                    slot = self.host_tier.lookup(key)
                    self.host_tier.pin(slot)
                    block = pool.get_new_block()
                    self._tier_loads.append((slot, block))
                    pool.cache_block(block, key)
                    seq.block_table.append(block)
                    cached_tokens += self.block_size
            if self.enable_prefix_caching:
                self.prefix_cache_queries += len(seq.token_ids)
                self.prefix_cache_hits += cached_tokens
            seq.num_registered_blocks = cached_tokens // self.block_size
            self._device_seqs[seq.seq_id] = seq
        want = cdiv(num_tokens, self.block_size)
        for table in tables(seq):
            if want > len(table):
                table.extend(pool.get_new_blocks(want - len(table)))
        return cached_tokens

    def _blocks_needed(self, plan: Plan, refs: list[int]) -> int:
        """Fresh blocks to write the planned new tokens: table growth + copy-on-write.

        `refs` are the ref counts of the pool the tables point into (the host pool's for
        sequences about to be swapped in: their blocks keep the same sharing on the device).
        """
        bs = self.block_size
        taken: dict[int, int] = {}
        total = 0
        for seq, n in plan:
            start = seq.num_computed_tokens
            end_block = cdiv(start + n, bs)
            for table in ((seq.block_table,) if self._plain else tables(seq)):
                stop = min(len(table), end_block)
                for idx in range(start // bs, stop):
                    b = table[idx]
                    t = taken.get(b, 0)
                    if refs[b] - t > 1:  # still shared when this writer gets to it
                        total += 1
                        taken[b] = t + 1
                if end_block > len(table):
                    total += end_block - len(table)
        return total

    def blocks_needed(self, plan: Plan) -> int:
        """Blocks `allocate_slots(plan)` would take for each (sequence, new tokens) in order."""
        return self._blocks_needed(plan, self.device_pool.ref_counts)

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        return self.blocks_needed(((seq, num_new_tokens),)) <= self.num_available_blocks

    def allocate_slots(self, plan: Plan) -> Copies | None:
        """Room to write every planned chunk, all or nothing.

        For each (sequence, n) of `plan`, in order, the sequence's tables must cover tokens
        [num_computed, num_computed + n); a shared block in that range is replaced by a
        fresh one (copy-on-write). If the whole plan fits the available blocks it is
        committed and the (src, dst) copies the device must run before the step are
        returned, in plan order. Otherwise returns None and changes nothing but this: blocks
        no window of the plan's sequences can see any more go back to the pool first. The
        caller can then preempt something and ask again. Members of one plan may share
        blocks (the sequences of one request): the count is exact for writing them in plan
        order.
        """
        if not isinstance(plan, (list, tuple)):
            plan = list(plan)
        pool = self.device_pool
        if len(plan) == 1 and self._plain:
            seq, n = plan[0]
            if n == 1 and seq.seq_id in self._device_seqs:  # one decode: the common case
                table = seq.block_table
                idx = seq.num_computed_tokens // self.block_size
                if idx >= len(table):  # the new token opens a block
                    if not pool.num_available:
                        return None
                    table.append(pool.get_new_block())
                    return []
                if pool.ref_counts[table[idx]] == 1:  # writes in place
                    return []
                if not pool.num_available:  # shared: copy-on-write
                    return None
                return self._commit_slots(seq, 1)
        device_seqs = self._device_seqs
        for seq, n in plan:
            if seq.seq_id not in device_seqs:
                raise ValueError(f"sequence {seq.seq_id} holds no device blocks: allocate it first")
            if n < 1:
                raise ValueError(f"number of new tokens must be >= 1, got {n} "
                                 f"for sequence {seq.seq_id}")
        if not self._plain:
            for seq, _ in plan:
                self._release_out_of_window(seq, seq.num_computed_tokens)
        if self._blocks_needed(plan, pool.ref_counts) > pool.num_available:
            return None
        copies: Copies = []
        for seq, n in plan:
            copies += self._commit_slots(seq, n)
        return copies

    def _commit_slots(self, seq: Sequence, num_new_tokens: int) -> Copies:
        """The writes of `allocate_slots` for one sequence, once the plan is known to fit."""
        bs = self.block_size
        pool = self.device_pool
        refs = pool.ref_counts
        start = seq.num_computed_tokens
        end_block = cdiv(start + num_new_tokens, bs)
        copies = []
        for table in ((seq.block_table,) if self._plain else tables(seq)):
            for idx in range(start // bs, min(len(table), end_block)):
                b = table[idx]
                if refs[b] > 1:
                    nb = pool.get_new_block()
                    pool.free((b,))  # stays held: another table still has it
                    table[idx] = nb
                    if idx * bs < start:  # holds computed tokens of this sequence: copy them
                        copies.append((b, nb))
            if end_block > len(table):
                table.extend(pool.get_new_blocks(end_block - len(table)))
        if copies:
            self.num_cow_copies += len(copies)
        return copies

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> Copies:
        """`allocate_slots` for one sequence, raising RuntimeError when it does not fit.

        Returns copy-on-write pairs (src, dst) the device must copy before the step.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        copies = self.allocate_slots(((seq, num_new_tokens),))
        if copies is None:
            need = self.blocks_needed(((seq, num_new_tokens),))
            raise RuntimeError(f"cannot append {num_new_tokens} tokens to sequence {seq.seq_id}: "
                               f"needs {need} blocks, {self.num_available_blocks} available")
        return copies

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Give back `seq`'s device blocks past those its first `num_tokens` tokens need:
        slots reserved for speculative tokens the verify step rejected. Returns how many
        blocks went back. Models of one full-attention KV group only."""
        if not self._plain:
            raise ValueError("trim: only models of one full-attention KV group")
        if seq.seq_id not in self._device_seqs:
            return 0
        keep = cdiv(num_tokens, self.block_size)
        table = seq.block_table
        if len(table) <= keep:
            return 0
        gone = table[keep:]
        del table[keep:]
        self.device_pool.free(reversed(gone))
        return len(gone)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (ref counts +1)."""
        if parent.seq_id not in self._device_seqs:
            raise ValueError(f"parent sequence {parent.seq_id} holds no device blocks")
        if (child.seq_id in self._device_seqs or child.seq_id in self._host_seqs
                or child.block_table or any(child.group_tables)):
            raise ValueError(f"child sequence {child.seq_id} already holds blocks")
        child.block_table = list(parent.block_table)
        child.group_tables = [list(t) for t in parent.group_tables]
        child.num_window_freed = list(parent.num_window_freed)
        for table in tables(child):
            self.device_pool.touch([b for b in table if b != NULL_BLOCK] if not self._plain
                                   else table)
        child.num_registered_blocks = parent.num_registered_blocks
        self._device_seqs[child.seq_id] = child

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references (device or host); a no-op if it holds none."""
        if seq.seq_id in self._device_seqs:
            # Reverse order: the tail of a sequence is the least reusable prefix, so it
            # should be evicted first.
            for table in reversed(tables(seq)):
                self.device_pool.free(reversed([b for b in table if b != NULL_BLOCK]
                                               if not self._plain else table))
            del self._device_seqs[seq.seq_id]
        elif seq.seq_id in self._host_seqs:
            for table in tables(seq):
                self.host_pool.free([h for h in table if h != HOST_NULL])
            del self._host_seqs[seq.seq_id]
        seq.block_table = []
        seq.group_tables = []
        seq.num_window_freed = []
        seq.num_registered_blocks = 0

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, seqs: Sequence | Iterable[Sequence]) -> bool:
        seqs = _as_list(seqs)
        if any(s.seq_id not in self._device_seqs for s in seqs):
            return False
        distinct = {b for s in seqs for t in tables(s) for b in t if b != NULL_BLOCK}
        return len(distinct) <= self.host_pool.num_available

    def swap_out(self, seqs: Sequence | Iterable[Sequence]) -> Copies:
        """Move the sequences' tables to the host pool; returns (device, host) copies.

        The device must run the copies before anything else writes this step (the freed
        device blocks may be handed out again in the same schedule). Entries a window gave
        back stay empty (`HOST_NULL`) and move nothing.
        """
        seqs = _as_list(seqs)
        if not self.can_swap_out(seqs):
            raise RuntimeError("cannot swap out: sequence not on device or host pool too small")
        pairs = self._move(seqs, self.device_pool, self.host_pool, NULL_BLOCK, HOST_NULL)
        for s in seqs:
            del self._device_seqs[s.seq_id]
            self._host_seqs[s.seq_id] = s
        self.num_blocks_swapped_out += len(pairs)
        return pairs

    @staticmethod
    def _move(seqs: list[Sequence], src: BlockPool, dst: BlockPool, src_null: int,
              dst_null: int) -> Copies:
        """Every table of `seqs` from `src` blocks to fresh `dst` blocks (a block shared by
        several of them moves once; empty entries stay empty) -> the (src, dst) copies."""
        mapping: dict[int, int] = {src_null: dst_null}
        pairs = []
        for s in seqs:
            moved = []
            for table in tables(s):
                new = []
                for b in table:
                    d = mapping.get(b)
                    if d is None:
                        d = dst.get_new_block()
                        mapping[b] = d
                        pairs.append((b, d))
                    elif d != dst_null:
                        dst.touch((d,))
                    new.append(d)
                src.free(reversed([b for b in table if b != src_null]))
                moved.append(new)
            s.block_table, s.group_tables = moved[0], moved[1:]
            s.num_registered_blocks = 0   # fresh blocks: registered again once computed
        return pairs

    def swap_in_blocks_needed(self, seqs: Sequence | Iterable[Sequence], plan: Plan = ()) -> int:
        """Device blocks to swap `seqs` in and then `allocate_slots(plan)` for them."""
        distinct = {h for s in _as_list(seqs) for t in tables(s) for h in t if h != HOST_NULL}
        # The entries a plan writes are never empty: `HOST_NULL` is not looked up.
        return len(distinct) + self._blocks_needed(plan, self.host_pool.ref_counts)

    def can_swap_in(self, seqs: Sequence | Iterable[Sequence], num_extra_blocks: int = 0,
                    use_watermark: bool = True) -> bool:
        seqs = _as_list(seqs)
        if any(s.seq_id not in self._host_seqs for s in seqs):
            return False
        distinct = {h for s in seqs for t in tables(s) for h in t if h != HOST_NULL}
        reserve = self.watermark_blocks if use_watermark else 0
        return len(distinct) + num_extra_blocks <= self.num_available_blocks - reserve

    def swap_in(self, seqs: Sequence | Iterable[Sequence]) -> Copies:
        """Move the sequences' tables back to fresh device blocks; returns (host, device) copies."""
        seqs = _as_list(seqs)
        if not self.can_swap_in(seqs, use_watermark=False):
            raise RuntimeError("cannot swap in: sequence not swapped out or device pool too small")
        pairs = self._move(seqs, self.host_pool, self.device_pool, HOST_NULL, NULL_BLOCK)
        for s in seqs:
            del self._host_seqs[s.seq_id]
            self._device_seqs[s.seq_id] = s
        self.num_blocks_swapped_in += len(pairs)
        return pairs

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        def fail(msg: str) -> None:
            raise AssertionError(msg)

        n = self.num_blocks
        counts = [0] * n
        for s in self._device_seqs.values():
            if s.seq_id in self._host_seqs:
                fail(f"sequence {s.seq_id} is on device and host")
            if len(tables(s)) != self.num_groups:
                fail(f"sequence {s.seq_id} holds {len(tables(s))} tables for "
                     f"{self.num_groups} KV groups")
            for g, (w, table) in enumerate(zip(self.windows, tables(s))):
                if len(table) * self.block_size < s.num_computed_tokens:
                    fail(f"sequence {s.seq_id}: table too short for its computed tokens")
                freed = s.num_window_freed[g] if w is not None and s.num_window_freed else 0
                if freed > self._first_live(w or 1, max(s.num_computed_tokens, len(table) * self.block_size)):
                    fail(f"sequence {s.seq_id}: group {g} gave back blocks its window still reads")
                for i, b in enumerate(table):
                    if b == NULL_BLOCK and i < freed:
                        continue      # given back by the window
                    if not 0 < b < n:
                        fail(f"sequence {s.seq_id} holds invalid block {b}")
                    counts[b] += 1
        self.device_pool.check_invariants(counts)
        host_counts = [0] * self.num_host_blocks
        for s in self._host_seqs.values():
            for table in tables(s):
                for h in table:
                    if h == HOST_NULL:
                        continue
                    if not 0 <= h < self.num_host_blocks:
                        fail(f"sequence {s.seq_id} holds invalid host block {h}")
                    host_counts[h] += 1
        self.host_pool.check_invariants(host_counts)
