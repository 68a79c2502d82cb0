"""Which layers share a block table: the KV cache's groups, for models with sliding windows.

A sliding layer never reads a key more than its window behind the query, so once a sequence
is past a block by more than the window, that layer's pages of the block can go back to the
pool. A full-attention layer reads every block to the end. When one block id held every
layer's pages (one table per sequence), a model with both kinds (Gemma 3: five sliding layers
to one global) could free nothing.

So layers are grouped, vLLM's hybrid KV cache manager's way: all groups have the same number
of layers, `slots`, and one pool of block ids serves them all; a block id holds `slots` layer
pages, and which layers those are depends on the group that allocated it. Each sequence holds
one block table per group; a sliding group's table has the null block where its pages were
freed. Layer `l` reads slot `slot_of(l)` of the blocks in its group's table.

- One kind of attention (Llama, Qwen, Mistral): one group of every layer, `slots` =
  `num_layers`; the pool and the table are exactly those of a model with no groups.
- Several kinds: `slots` is the smallest kind's layer count, each kind's layers are cut into
  groups of that many (the last one short, its unused slots idle). Gemma-3-1B (4 global, 22
  sliding layers): 7 groups of 4 slots, 2 slots of one group idle.

Plain Python (host side): the block manager, the runner and the pool all read the layout.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # config.py reads the layout: no import back at run time
    from paxkv.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table: their window (None: full attention), in slot order."""

    window: int | None
    layers: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """The groups of a model's layers and the layer pages per block id (`slots`)."""

    groups: tuple[KVGroup, ...]
    slots: int

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def has_sliding(self) -> bool:
        return any(g.window is not None for g in self.groups)

    def group_of(self, layer: int) -> int:
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g
        raise ValueError(f"layer {layer} is in no KV group")

    def slot_of(self, layer: int) -> int:
        return self.groups[self.group_of(layer)].layers.index(layer)

    def windows(self) -> tuple[int | None, ...]:
        """Each group's window (None: full attention), in group order."""
        return tuple(g.window for g in self.groups)


def kv_layout(cfg: "ModelConfig") -> KVLayout:
    """The groups of `cfg`'s layers (see the module docstring)."""
    kinds: dict[int | None, list[int]] = {}
    for layer in range(cfg.num_layers):
        kinds.setdefault(cfg.layer_window(layer), []).append(layer)
    if len(kinds) == 1:
        (window, layers), = kinds.items()
        return KVLayout((KVGroup(window, tuple(layers)),), cfg.num_layers)
    slots = min(len(layers) for layers in kinds.values())
    groups = []
    for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):   # full first
        layers = kinds[window]
        groups += [KVGroup(window, tuple(layers[i:i + slots])) for i in range(0, len(layers), slots)]
    return KVLayout(tuple(groups), slots)


def blocks_held(window: int | None, num_tokens: int, block_size: int,
                chunk: int | None = None) -> int:
    """Blocks one group holds at most for a sequence of `num_tokens` tokens computed in
    chunks of at most `chunk` tokens (None: at once): all of them for full attention; for a
    window, the blocks the window and the chunk being written can span."""
    full = -(-num_tokens // block_size)
    if window is None:
        return full
    step = num_tokens if chunk is None else min(chunk, num_tokens)
    return min(full, -(-(window - 1 + step) // block_size) + 1)
