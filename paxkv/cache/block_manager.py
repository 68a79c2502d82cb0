"""Host-side bookkeeping of the paged KV pool: which physical block holds which tokens.

The device pool is `num_blocks` pages of `block_size` token slots. This module never touches
the pages; it hands out block ids and tells the caller which block copies to run:

- Free pool and reference counts. Block 0 is the null block (padding writes there): never
  allocated, never freed. A block is always exactly one of: null, free, evictable-cached
  (content kept for prefix reuse, no owner), or referenced (ref count = number of block
  tables that hold it).
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

Plain Python on purpose: per step work is a few list operations per sequence.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from paxkv.engine.sequence import Sequence

BlockKey = tuple  # (parent hash | None, tuple of block_size token ids)
Plan = Iterable[tuple[Sequence, int]]  # (sequence, number of new tokens to compute)

NULL_BLOCK = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _as_list(seqs: Sequence | Iterable[Sequence]) -> list[Sequence]:
    return [seqs] if isinstance(seqs, Sequence) else list(seqs)


class BlockManager:
    """Allocation, ref counts, copy-on-write, prefix cache and swap map of one KV pool."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.01) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark = watermark
        self.watermark_blocks = int(watermark * num_blocks)

        self._ref = [0] * num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # a stack; pops 1, 2, ... first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._block_key: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}

        self._host_ref = [0] * num_host_blocks
        self._host_free = list(range(num_host_blocks - 1, -1, -1))

        self._device_seqs: dict[int, Sequence] = {}  # sequences whose table is on device
        self._host_seqs: dict[int, Sequence] = {}    # sequences whose table is on host

        # Counters for metrics.
        self.prefix_cache_queries = 0      # tokens of sequences looked up in the cache
        self.prefix_cache_hits = 0         # of those, tokens served from cached blocks
        self.num_evictions = 0
        self.num_cow_copies = 0
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0

    # ------------------------------------------------------------------ accounting
    @property
    def num_free_blocks(self) -> int:
        """Blocks holding nothing useful (excludes evictable cached blocks)."""
        return len(self._free)

    @property
    def num_cached_evictable_blocks(self) -> int:
        """Unowned blocks kept for prefix reuse; reclaimed LRU when needed."""
        return len(self._evictable)

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can take: free + evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Physical blocks held by at least one block table."""
        return self.num_blocks - 1 - len(self._free) - len(self._evictable)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    @property
    def num_used_host_blocks(self) -> int:
        return self.num_host_blocks - len(self._host_free)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def logical_blocks_in_use(self) -> int:
        """Blocks the device-resident sequences would need with no sharing at all.

        Counts tokens whose K/V is written (the just-sampled token has none yet), so it
        compares like for like with the physical blocks in use.
        """
        bs = self.block_size
        return sum(_cdiv(s.num_computed_tokens, bs) for s in self._device_seqs.values())

    def num_tokens_in_use(self) -> int:
        """Token slots the device-resident sequences fill (shared tokens counted per sequence)."""
        return sum(len(s.token_ids) for s in self._device_seqs.values())

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def is_on_device(self, seq: Sequence) -> bool:
        return seq.seq_id in self._device_seqs

    def is_on_host(self, seq: Sequence) -> bool:
        return seq.seq_id in self._host_seqs

    # ------------------------------------------------------------------ block pool
    def _take_block(self) -> int:
        """A fresh block with ref 1: from the free pool, else evict the LRU cached block."""
        if self._free:
            b = self._free.pop()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            del self._cached[self._block_key[b]]
            self._block_key[b] = None
            self.num_evictions += 1
        else:
            raise RuntimeError("KV pool exhausted: check can_allocate / can_append first")
        self._ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        r = self._ref[b] - 1
        self._ref[b] = r
        if r == 0:
            if self._block_key[b] is not None:
                self._evictable[b] = None  # most recently used end
            else:
                self._free.append(b)

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

    def _lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks of the longest cached prefix of a new sequence.

        Capped at (num_tokens - 1) // block_size blocks so at least the last token is
        computed: the step that computes it produces the logits to sample from.
        """
        if not self.enable_prefix_caching or not self._cached or seq.skip_prefix_cache:
            return []
        cap = (len(seq.token_ids) - 1) // self.block_size
        keys = self._ensure_keys(seq, cap)
        hits = []
        cached = self._cached
        for i in range(cap):
            b = cached.get(keys[i])
            if b is None:
                break
            hits.append(b)
        return hits

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens `allocate` would serve from the prefix cache for this new sequence."""
        if seq.seq_id in self._device_seqs:
            return 0
        return len(self._lookup(seq)) * self.block_size

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
        table = seq.block_table
        for i in range(start, full):
            b = table[i]
            if self._block_key[b] is None:
                key = keys[i]
                if key not in self._cached:
                    self._cached[key] = b
                    self._block_key[b] = key
        seq.num_registered_blocks = full

    def reset_prefix_cache(self) -> int:
        """Drop every evictable cached block back to the free pool; returns how many."""
        n = len(self._evictable)
        for b in self._evictable:
            del self._cached[self._block_key[b]]
            self._block_key[b] = None
            self._free.append(b)
        self._evictable.clear()
        return n

    # ------------------------------------------------------------------ allocation
    def _blocks_to_allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks that `allocate(seq, num_tokens)` takes out of the available pool."""
        table = seq.block_table
        if seq.seq_id in self._device_seqs:
            return max(0, _cdiv(num_tokens, self.block_size) - len(table))
        hits = self._lookup(seq)
        from_evictable = sum(1 for b in hits if self._ref[b] == 0)
        return from_evictable + max(0, _cdiv(num_tokens, self.block_size) - len(hits))

    def blocks_to_allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `allocate(seq, num_tokens)` would take (evictable prefix hits included)."""
        return self._blocks_to_allocate(seq, num_tokens)

    def can_allocate(self, seq: Sequence, num_tokens: int, use_watermark: bool = True) -> bool:
        """Whether `allocate(seq, num_tokens)` fits, keeping the watermark free for admissions."""
        reserve = self.watermark_blocks if use_watermark else 0
        return self._blocks_to_allocate(seq, num_tokens) <= self.num_available_blocks - reserve

    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Make `seq.block_table` cover `num_tokens` tokens; returns the prefix-cached tokens.

        For a sequence the manager does not hold yet (new, or re-admitted after a recompute
        preemption) the table first takes the cached blocks of its longest cached prefix;
        the caller sets `num_computed_tokens` to the returned count. For a held sequence it
        only appends fresh blocks (no copy-on-write: use `append_slots` before writing).
        """
        if seq.seq_id in self._host_seqs:
            raise ValueError(f"sequence {seq.seq_id} is swapped out: swap_in before allocating")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if self._blocks_to_allocate(seq, num_tokens) > self.num_available_blocks:
            raise RuntimeError(f"cannot allocate {num_tokens} tokens for sequence {seq.seq_id}: "
                               f"{self.num_available_blocks} blocks available")
        table = seq.block_table
        cached_tokens = 0
        if seq.seq_id not in self._device_seqs:
            if table:
                raise ValueError(f"sequence {seq.seq_id} has a block_table the manager does not own")
            hits = self._lookup(seq)
            for b in hits:
                if self._ref[b] == 0:
                    del self._evictable[b]
                self._ref[b] += 1
                table.append(b)
            cached_tokens = len(hits) * self.block_size
            if self.enable_prefix_caching:
                self.prefix_cache_queries += len(seq.token_ids)
                self.prefix_cache_hits += cached_tokens
            seq.num_registered_blocks = len(hits)
            self._device_seqs[seq.seq_id] = seq
        for _ in range(_cdiv(num_tokens, self.block_size) - len(table)):
            table.append(self._take_block())
        return cached_tokens

    def _blocks_needed(self, plan: Plan, refs: list[int]) -> int:
        """Fresh blocks to write the planned new tokens: table growth + copy-on-write."""
        bs = self.block_size
        taken: dict[int, int] = {}
        total = 0
        for seq, n in plan:
            table = seq.block_table
            start = seq.num_computed_tokens
            end_block = _cdiv(start + n, bs)
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
        """Blocks `append_slots` would take for each (sequence, new tokens) in order."""
        return self._blocks_needed(plan, self._ref)

    def decode_blocks_needed(self, seq: Sequence) -> int:
        """`blocks_needed([(seq, 1)])` in O(1): a new block, a copy-on-write, or none."""
        table = seq.block_table
        idx = seq.num_computed_tokens // self.block_size
        if idx >= len(table):
            return 1
        return 1 if self._ref[table[idx]] > 1 else 0

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        return self._blocks_needed(((seq, num_new_tokens),), self._ref) <= self.num_available_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Room to write K/V of tokens [num_computed, num_computed + num_new_tokens).

        Returns copy-on-write pairs (src, dst) the device must copy before the step.
        """
        if seq.seq_id not in self._device_seqs:
            raise ValueError(f"sequence {seq.seq_id} holds no device blocks: allocate it first")
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        need = self._blocks_needed(((seq, num_new_tokens),), self._ref)
        if need > self.num_available_blocks:
            raise RuntimeError(f"cannot append {num_new_tokens} tokens to sequence {seq.seq_id}: "
                               f"needs {need} blocks, {self.num_available_blocks} available")
        return self._append_slots_unchecked(seq, num_new_tokens)

    def _append_slots_unchecked(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """`append_slots` without the checks, for callers that checked `blocks_needed`
        (the scheduler checks a whole group at once, on its per-step hot path)."""
        bs = self.block_size
        table = seq.block_table
        start = seq.num_computed_tokens
        if num_new_tokens == 1:  # decode fast path
            idx = start // bs
            if idx >= len(table):
                table.append(self._take_block())
                return []
            b = table[idx]
            if self._ref[b] == 1:
                return []
        end_block = _cdiv(start + num_new_tokens, bs)
        copies = []
        ref = self._ref
        for idx in range(start // bs, min(len(table), end_block)):
            b = table[idx]
            if ref[b] > 1:
                nb = self._take_block()
                ref[b] -= 1  # stays >= 1: another table still holds it
                table[idx] = nb
                if idx * bs < start:  # holds computed tokens of this sequence: copy them
                    copies.append((b, nb))
        for _ in range(end_block - len(table)):
            table.append(self._take_block())
        if copies:
            self.num_cow_copies += len(copies)
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (ref counts +1)."""
        if parent.seq_id not in self._device_seqs:
            raise ValueError(f"parent sequence {parent.seq_id} holds no device blocks")
        if child.seq_id in self._device_seqs or child.seq_id in self._host_seqs or child.block_table:
            raise ValueError(f"child sequence {child.seq_id} already holds blocks")
        child.block_table = list(parent.block_table)
        for b in child.block_table:
            self._ref[b] += 1
        child.num_registered_blocks = parent.num_registered_blocks
        self._device_seqs[child.seq_id] = child

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references (device or host); a no-op if it holds none."""
        if seq.seq_id in self._device_seqs:
            # Reverse order: the tail of a sequence is the least reusable prefix, so it
            # should be evicted first.
            for b in reversed(seq.block_table):
                self._release(b)
            del self._device_seqs[seq.seq_id]
        elif seq.seq_id in self._host_seqs:
            for h in seq.block_table:
                self._release_host(h)
            del self._host_seqs[seq.seq_id]
        seq.block_table = []
        seq.num_registered_blocks = 0

    # ------------------------------------------------------------------ swap
    def _release_host(self, h: int) -> None:
        r = self._host_ref[h] - 1
        self._host_ref[h] = r
        if r == 0:
            self._host_free.append(h)

    def can_swap_out(self, seqs: Sequence | Iterable[Sequence]) -> bool:
        seqs = _as_list(seqs)
        if any(s.seq_id not in self._device_seqs for s in seqs):
            return False
        distinct = {b for s in seqs for b in s.block_table}
        return len(distinct) <= len(self._host_free)

    def swap_out(self, seqs: Sequence | Iterable[Sequence]) -> list[tuple[int, int]]:
        """Move the sequences' tables to the host pool; returns (device, host) copies.

        The device must run the copies before anything else writes this step (the freed
        device blocks may be handed out again in the same schedule).
        """
        seqs = _as_list(seqs)
        if not self.can_swap_out(seqs):
            raise RuntimeError("cannot swap out: sequence not on device or host pool too small")
        mapping: dict[int, int] = {}
        pairs = []
        for s in seqs:
            host_table = []
            for d in s.block_table:
                h = mapping.get(d)
                if h is None:
                    h = self._host_free.pop()
                    mapping[d] = h
                    pairs.append((d, h))
                self._host_ref[h] += 1
                host_table.append(h)
            for d in reversed(s.block_table):
                self._release(d)
            s.block_table = host_table
            s.num_registered_blocks = 0
            del self._device_seqs[s.seq_id]
            self._host_seqs[s.seq_id] = s
        self.num_blocks_swapped_out += len(pairs)
        return pairs

    def swap_in_blocks_needed(self, seqs: Sequence | Iterable[Sequence], plan: Plan = ()) -> int:
        """Device blocks to swap `seqs` in and then append the planned new tokens."""
        distinct = {h for s in _as_list(seqs) for h in s.block_table}
        return len(distinct) + self._blocks_needed(plan, self._host_ref)

    def can_swap_in(self, seqs: Sequence | Iterable[Sequence], num_extra_blocks: int = 0,
                    use_watermark: bool = True) -> bool:
        seqs = _as_list(seqs)
        if any(s.seq_id not in self._host_seqs for s in seqs):
            return False
        distinct = {h for s in seqs for h in s.block_table}
        reserve = self.watermark_blocks if use_watermark else 0
        return len(distinct) + num_extra_blocks <= self.num_available_blocks - reserve

    def swap_in(self, seqs: Sequence | Iterable[Sequence]) -> list[tuple[int, int]]:
        """Move the sequences' tables back to fresh device blocks; returns (host, device) copies."""
        seqs = _as_list(seqs)
        if not self.can_swap_in(seqs, use_watermark=False):
            raise RuntimeError("cannot swap in: sequence not swapped out or device pool too small")
        mapping: dict[int, int] = {}
        pairs = []
        for s in seqs:
            device_table = []
            for h in s.block_table:
                d = mapping.get(h)
                if d is None:
                    d = self._take_block()
                    mapping[h] = d
                    pairs.append((h, d))
                else:
                    self._ref[d] += 1
                device_table.append(d)
            for h in s.block_table:
                self._release_host(h)
            s.block_table = device_table
            s.num_registered_blocks = 0  # fresh blocks: register again once computed
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
        if self._ref[NULL_BLOCK] != 0 or NULL_BLOCK in self._evictable or self._block_key[NULL_BLOCK]:
            fail("null block 0 is in use")
        free = set(self._free)
        if len(free) != len(self._free):
            fail("duplicate blocks in the free list")
        if NULL_BLOCK in free:
            fail("null block 0 is in the free list")
        evictable = set(self._evictable)
        if free & evictable:
            fail(f"blocks both free and evictable: {sorted(free & evictable)}")
        counts = [0] * n
        for s in self._device_seqs.values():
            if s.seq_id in self._host_seqs:
                fail(f"sequence {s.seq_id} is on device and host")
            if len(s.block_table) * self.block_size < s.num_computed_tokens:
                fail(f"sequence {s.seq_id}: table too short for its computed tokens")
            for b in s.block_table:
                if not 0 < b < n:
                    fail(f"sequence {s.seq_id} holds invalid block {b}")
                counts[b] += 1
        for b in range(1, n):
            if counts[b] != self._ref[b]:
                fail(f"block {b}: ref count {self._ref[b]} but held by {counts[b]} tables")
            states = (b in free) + (b in evictable) + (self._ref[b] > 0)
            if states != 1:
                fail(f"block {b} is in {states} of free/evictable/referenced")
            key = self._block_key[b]
            if b in free and key is not None:
                fail(f"free block {b} is still registered")
            if b in evictable and key is None:
                fail(f"evictable block {b} is not registered")
            if key is not None and self._cached.get(key) != b:
                fail(f"block {b}'s key maps to block {self._cached.get(key)}")
        if len(self._cached) != sum(k is not None for k in self._block_key):
            fail("prefix cache index and block keys disagree")
        if self.num_available_blocks + self.num_used_blocks != n - 1:
            fail("block accounting does not add up")
        host_free = set(self._host_free)
        if len(host_free) != len(self._host_free):
            fail("duplicate blocks in the host free list")
        host_counts = [0] * self.num_host_blocks
        for s in self._host_seqs.values():
            for h in s.block_table:
                if not 0 <= h < self.num_host_blocks:
                    fail(f"sequence {s.seq_id} holds invalid host block {h}")
                host_counts[h] += 1
        for h in range(self.num_host_blocks):
            if host_counts[h] != self._host_ref[h]:
                fail(f"host block {h}: ref count {self._host_ref[h]} but held by {host_counts[h]}")
            if (h in host_free) == (self._host_ref[h] > 0):
                fail(f"host block {h} is both or neither free and referenced")
