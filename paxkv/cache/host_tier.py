"""The host KV tier (`LLM(kv_offloading_size=GiB)`, vLLM's name): blocks the device's prefix
cache evicts are kept in host memory under their prefix keys, so that a later request with
the same prefix copies them back instead of computing them again.

This module keeps the tier's bookkeeping only: which key sits in which host slot, its own
LRU, and slots pinned while a copy back is pending. The runner holds the host arrays and
moves the data (`runner.Runner.offload` / `load`); the block manager decides what moves.
Plain Python (host side).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

BlockKey = Hashable


class HostKVTier:
    """`num_blocks` host slots of KV blocks, keyed by the prefix key of their tokens."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host KV tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._slots: OrderedDict[BlockKey, int] = OrderedDict()   # least recently used first
        self._free = list(range(num_blocks - 1, -1, -1))
        self._pinned: set[int] = set()
        self.num_stored = 0
        self.num_loaded = 0
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._slots

    def lookup(self, key: BlockKey) -> int | None:
        """The slot holding `key` (now the most recently used), or None."""
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
        return slot

    def store(self, key: BlockKey) -> int | None:
        """A slot for a block evicted from the device under `key`: a free one, else the
        least recently used one not pinned. None when `key` is here already (its copy is
        the same tokens) or every slot is pinned."""
        if key in self._slots:
            self._slots.move_to_end(key)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, s in self._slots.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
            self.num_evictions += 1
        self._slots[key] = slot
        self.num_stored += 1
        return slot

    def pin(self, slot: int) -> None:
        """Keep `slot` from being reused until `unpin_all`: a copy back from it is pending."""
        self._pinned.add(slot)
        self.num_loaded += 1

    def unpin_all(self) -> None:
        self._pinned.clear()

    def reset(self) -> int:
        """Forget every block (the weights changed, or the cache was reset); returns how many."""
        n = len(self._slots)
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._slots.clear()
        self._pinned.clear()
        return n
