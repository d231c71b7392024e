"""Paged K/V cache bookkeeping: fixed-size blocks, a free list, reference counts, block tables
and prefix sharing by content hash. Pure Python (no torch), so it is tested on any machine.

Prefix sharing: a *full* block whose K/V has been computed is registered under a hash of
(parent block's hash, its token ids, the content hashes of the images/clips whose
placeholders it covers); the chain starts from the sequence's adapter (name and load version), so two sequences share
a block only if everything that determines its K/V is equal. A freed block keeps its
registration while it waits in the free list (least recently freed first out), so a later
request can revive it; it is forgotten only when the block is handed out again. Sequences
only ever write past their shared blocks, so shared blocks need no copy-on-write.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    key: tuple | None = None  # what the hash was made of: checked on every hit


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_hit_tokens = 0  # served from the cache, over the manager's lifetime

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- hashing ----------------------------------------------------------------------
    def _block_key(self, seq: Sequence, index: int, parent: int) -> tuple:
        start, end = index * self.block_size, (index + 1) * self.block_size
        images = tuple(span.key for span in seq.mm_spans if span.start < end and span.end > start)
        return parent, tuple(seq.token_ids[start:end]), images

    def block_hash(self, seq: Sequence, index: int) -> tuple[int, tuple]:
        """(hash, key) of full block `index` of seq. Both are memoized on the sequence (a full block's tokens
        never change): the scheduler matches every waiting prompt's prefix several times a step, and building
        the key again each time was most of a step's planning with a few dozen requests queued."""
        while len(seq.block_hashes) <= index:
            i = len(seq.block_hashes)
            if (i + 1) * self.block_size > seq.num_tokens:
                raise ValueError(f"block {i} of {seq.request_id!r} is not full")
            parent = seq.block_hashes[i - 1] if i else hash(("root", seq.adapter, seq.adapter_version))
            key = self._block_key(seq, i, parent)
            seq.block_keys.append(key)
            seq.block_hashes.append(hash(key))
        return seq.block_hashes[index], seq.block_keys[index]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's leading full blocks. At least one token is left to compute
        (its logits are needed), so a prompt is never served from the cache entirely."""
        if not self.enable_prefix_cache or not seq.reuse_prefix:
            return []
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            h, key = self.block_hash(seq, i)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].key != key:
                break
            hits.append(block_id)
        return hits

    def num_cached_tokens(self, seq: Sequence) -> int:
        return len(self.match_prefix(seq)) * self.block_size

    # ---- admission ----------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Can a waiting seq get blocks for its first `num_tokens` tokens (cached prefix included)?"""
        hits = self.match_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # these sit in the free list
        return self.blocks_for(num_tokens) - len(hits) <= self.num_free_blocks - revived

    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Takes the cached prefix and fresh blocks up to `num_tokens`; returns the cached token count."""
        if seq.block_table:
            raise ValueError(f"{seq.request_id!r} already holds blocks")
        if not self.can_allocate(seq, num_tokens):
            raise RuntimeError(f"not enough free blocks for {seq.request_id!r}; check can_allocate first")
        hits = self.match_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        self.prefix_hit_tokens += seq.num_cached_tokens
        self._grow(seq, num_tokens)
        return seq.num_cached_tokens

    # ---- growth -----------------------------------------------------------------------
    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        if not self.can_append(seq, num_new_tokens):
            raise RuntimeError(f"not enough free blocks to grow {seq.request_id!r}; check can_append first")
        self._grow(seq, seq.num_computed_tokens + num_new_tokens)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * self.block_size < num_tokens:
            block_id, _ = self.free_blocks.popitem(last=False)  # least recently freed first
            block = self.blocks[block_id]
            if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.key, block.ref_count = None, None, 1
            seq.block_table.append(block_id)

    # ---- release and registration ---------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drops seq's references; blocks no one holds go back to the free list (tail blocks first out)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
            elif block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def forget_free(self) -> int:
        """Unregisters the cached content of every free block (blocks in use keep theirs), so later
        requests recompute it; returns how many were dropped. For measurements that replay the same
        inputs and must not find the previous run's K/V."""
        dropped = 0
        for block_id in self.free_blocks:
            block = self.blocks[block_id]
            if block.hash is not None:
                if self.hash_to_block.get(block.hash) == block_id:
                    del self.hash_to_block[block.hash]
                block.hash, block.key = None, None
                dropped += 1
        return dropped

    def commit(self, seq: Sequence) -> None:
        """Registers seq's full blocks whose K/V is now computed, so later requests can share them."""
        if not self.enable_prefix_cache:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        for i in range(seq.num_hashed_blocks, full):
            h, key = self.block_hash(seq, i)
            block = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block:  # the same content computed twice keeps the first copy
                self.hash_to_block[h] = block.block_id
                block.hash, block.key = h, key
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)
