"""Vision-encoder outputs cached by image content hash (least recently used out).

A repeated image or clip (same pixels) is encoded once: later requests, and a preempted
request recomputing its prompt, take its embeddings from here.

An adapter that adapts the vision tower (serve/lora/tower.py) makes its requests' tower outputs
its own: their items are keyed by image and adapter (`tower_key`: name and load version, so a
reload is not served the old weights' output), and no other adapter's entry can answer them.
Items of requests without an adapter, or with one that leaves the tower alone, keep the
image-only key, so they share their cache hits as before.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


def tower_key(content_hash: str, adapter: str, version: int) -> str:
    """The key of an item encoded with `adapter`'s LoRA on the tower (never equal to an image-only key)."""
    return f"{content_hash}|tower:{adapter}#{version}"


class EncoderCache:
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"encoder cache capacity must be >= 0 (0 = off), got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> torch.Tensor | None:
        value = self._items.get(key)
        if value is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return value

    def __contains__(self, key: str) -> bool:  # a look that is neither a hit nor a miss
        return key in self._items

    def put(self, key: str, value: torch.Tensor) -> None:
        if self.capacity == 0:
            return
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)
