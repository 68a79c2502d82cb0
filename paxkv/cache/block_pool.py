"""One pool of KV blocks: reference counts, the free list, the LRU list and the prefix index.

A pool only knows block ids; which sequence holds which block (block tables, copy-on-write,
fork, swap maps) is the `BlockManager`'s business, which keeps one pool for the device KV
pages and one for the host swap space. Every block of a pool is in exactly one state:

- reserved: the null block (block 0 of the device pool, where padding writes): never handed
  out, never freed;
- free: holds nothing anyone will read;
- evictable: no table holds it, but it is registered in the prefix index under the key of
  the tokens it holds, so a later request with the same prefix can take it back (`touch`);
- referenced: `ref_count(b)` tables hold it (registered or not).

Allocation takes a free block first and evicts only when none is left, least recently
released first: a cached prefix survives as long as anything else can be handed out. The
free list is a stack, so the block released last is handed out next.

Plain Python on purpose: the scheduler's per-step path makes a few of these calls per
sequence.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from collections.abc import Sequence as SequenceOf

BlockKey = Hashable  # names a block's contents: the BlockManager uses (parent hash, tokens)

NULL_BLOCK = 0


class BlockPool:
    """Ref counts, free list, LRU of evictable cached blocks and prefix index of one pool.

    `reserve_null_block` keeps block 0 out of circulation (the device pool's padding slot).
    With `enable_caching` off, nothing is ever registered: a released block goes straight
    back to the free list and the pool never evicts.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = False,
                 reserve_null_block: bool = False, name: str = "block") -> None:
        first = 1 if reserve_null_block else 0
        if num_blocks < first:
            raise ValueError(f"num_blocks must be >= {first}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.null_block: int | None = NULL_BLOCK if reserve_null_block else None
        self.name = name
        self._first = first
        # Read-only outside this class (hot loops read it without a call per block).
        self.ref_counts: list[int] = [0] * num_blocks
        self._free = list(range(num_blocks - 1, first - 1, -1))  # a stack: pops `first` first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._key: list[BlockKey | None] = [None] * num_blocks
        self._index: dict[BlockKey, int] = {}
        self.num_evictions = 0
        # Called with (block, key) as a cached block is evicted, before its id is reused
        # (the host KV tier keeps a copy: `BlockManager`).
        self.on_evict: Callable[[int, BlockKey], None] | None = None

    # ------------------------------------------------------------------ accounting
    @property
    def num_usable(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - self._first

    @property
    def num_free(self) -> int:
        """Blocks holding nothing useful (evictable cached blocks not included)."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no table holds: kept for prefix reuse, reclaimed LRU when needed."""
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free + evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one table."""
        return self.num_blocks - self._first - len(self._free) - len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix index (referenced or evictable)."""
        return len(self._index)

    def ref_count(self, block: int) -> int:
        return self.ref_counts[block]

    # ------------------------------------------------------------------ references
    def get_new_block(self) -> int:
        """A block with ref count 1 and no key: a free one, else the LRU evictable one."""
        if self._free:
            b = self._free.pop()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(b, self._key[b])
            del self._index[self._key[b]]
            self._key[b] = None
            self.num_evictions += 1
        else:
            raise RuntimeError(f"{self.name} pool exhausted ({self.num_usable} blocks all held)")
        self.ref_counts[b] = 1
        return b

    def get_new_blocks(self, n: int) -> list[int]:
        """`n` new blocks, in the order `get_new_block` hands them out; all or none."""
        if n > self.num_available:
            raise RuntimeError(f"cannot take {n} blocks from the {self.name} pool: "
                               f"{self.num_available} available")
        return [self.get_new_block() for _ in range(n)]

    def touch(self, blocks: Iterable[int]) -> None:
        """One more reference to each block (a fork, a prefix hit, a shared swap-in).

        A cached block no table held leaves the evictable list.
        """
        ref = self.ref_counts
        for b in blocks:
            r = ref[b]
            if r == 0:
                if b not in self._evictable:
                    raise ValueError(f"{self.name} block {b} is free (or reserved): "
                                     "only held or cached blocks can be touched")
                del self._evictable[b]
            ref[b] = r + 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block, in order.

        A block nobody holds any more becomes evictable if it is registered (the first of
        `blocks` to get there is evicted first), else free.
        """
        ref = self.ref_counts
        for b in blocks:
            r = ref[b] - 1
            if r < 0 or b < self._first:
                raise ValueError(f"{self.name} block {b} is not held: double free?")
            ref[b] = r
            if r == 0:
                if self._key[b] is not None:
                    self._evictable[b] = None  # most recently released end
                else:
                    self._free.append(b)

    # ------------------------------------------------------------------ prefix index
    def get_cached_block(self, key: BlockKey) -> int | None:
        """The block registered under `key` (held or evictable), or None."""
        return self._index.get(key)

    def cache_block(self, block: int, key: BlockKey) -> bool:
        """Register a held block under `key`; returns whether it was registered.

        A block that already has a key keeps it, and a key that already names another
        block is left alone: the second copy of a prefix stays unregistered and is freed
        normally when released, so the index never holds two blocks for one key.
        """
        if not self.enable_caching:
            raise ValueError(f"the {self.name} pool keeps no prefix index")
        if self.ref_counts[block] == 0:
            raise ValueError(f"{self.name} block {block} is not held: only held blocks are cached")
        if self._key[block] is not None or key in self._index:
            return False
        self._index[key] = block
        self._key[block] = key
        return True

    def reset_prefix_cache(self) -> int:
        """Drop every evictable cached block back to the free list; returns how many.

        Held blocks stay registered: they still hold their tokens.
        """
        n = len(self._evictable)
        for b in self._evictable:
            del self._index[self._key[b]]
            self._key[b] = None
            self._free.append(b)
        self._evictable.clear()
        return n

    # ------------------------------------------------------------------ checks
    def check_invariants(self, holders: SequenceOf[int]) -> None:
        """Raise AssertionError unless the pool agrees with `holders[b]`, the number of
        tables that hold block b (used by tests)."""
        name = self.name

        def fail(msg: str) -> None:
            raise AssertionError(f"{name} pool: {msg}")

        n = self.num_blocks
        if len(holders) != n:
            fail(f"{len(holders)} holder counts for {n} blocks")
        free = set(self._free)
        if len(free) != len(self._free):
            fail("duplicate blocks in the free list")
        evictable = set(self._evictable)
        if free & evictable:
            fail(f"blocks both free and evictable: {sorted(free & evictable)}")
        if self.null_block is not None:
            b = self.null_block
            if (self.ref_counts[b] or holders[b] or b in free or b in evictable
                    or self._key[b] is not None):
                fail(f"null block {b} is in use")
        for b in range(self._first, n):
            ref = self.ref_counts[b]
            if holders[b] != ref:
                fail(f"block {b}: ref count {ref} but held by {holders[b]} tables")
            states = (b in free) + (b in evictable) + (ref > 0)
            if states != 1:
                fail(f"block {b} is in {states} of free/evictable/referenced")
            key = self._key[b]
            if b in free and key is not None:
                fail(f"free block {b} is still registered")
            if b in evictable and key is None:
                fail(f"evictable block {b} is not registered")
            if key is not None and self._index.get(key) != b:
                fail(f"block {b}'s key maps to block {self._index.get(key)}")
        if len(self._index) != sum(k is not None for k in self._key):
            fail("prefix index and block keys disagree")
        if not self.enable_caching and self._index:
            fail("blocks registered with caching off")
        if self.num_available + self.num_used != self.num_usable:
            fail("block accounting does not add up")
