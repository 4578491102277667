"""The physical KV blocks: reference counts, the LRU free queue and the prefix-cache hash map.

A block is either referenced by at least one request's block table (ref_cnt > 0) or sits in the
free queue (ref_cnt 0), never both. A free block may still carry the hash of the full block of
tokens it holds: it stays reusable by a prefix-cache hit until allocation evicts it from the head
of the queue, so the least recently freed cached content goes first.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

_HASH_BYTES = 32  # sha256 digest size
_ROOT_HASH = bytes(_HASH_BYTES)  # the parent of a sequence's first block


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full block, chained on the hash of the block before it (None for the first).

    sha256 rather than Python's `hash`: the cache is shared by all tenants, and a collision would
    serve one user's KV to another user's different prompt. The digest is kept as an int because
    `Request.block_hashes` is a list of ints.
    """
    parent = _ROOT_HASH if parent_hash is None else parent_hash.to_bytes(_HASH_BYTES, "big")
    payload = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return int.from_bytes(hashlib.sha256(parent + payload).digest(), "big")


def adapter_root_hash(lora_int_id: int) -> int:
    """The parent hash of the first block of a request that uses adapter `lora_int_id`.

    K/V depend on the adapter, so requests of different adapters (or of the base model) must
    never share blocks: chaining from an adapter-specific root keeps their hash spaces apart.
    """
    payload = b"flexserve-lora\0" + lora_int_id.to_bytes(8, "little")
    return int.from_bytes(hashlib.sha256(payload).digest(), "big")


class KVCacheBlock:
    """One block of `block_size` token slots in the paged KV cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id  # index into the worker's KV tensors, 0..num_blocks-1
        self.ref_cnt = 0  # block tables that hold this block
        self.block_hash: int | None = None  # set while the block is in the prefix-cache map
        self.prev_free: KVCacheBlock | None = None  # free-queue links; None when not queued
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else ", cached"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order: O(1) pop, append and remove-by-block.

    A prefix-cache hit on a free block takes it out of the middle of the queue, which a deque
    cannot do in O(1); the links live on the blocks themselves, so no per-node objects are made.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no None checks at the ends
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """Owns every KV block: hands out free ones, takes back released ones, maps hashes to blocks."""

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # One block per hash: when two requests fill equal blocks independently (greedy siblings
        # decoding the same tokens), the first registered wins and the other stays uncached.
        self.cached_blocks: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached or not: all of them can be allocated."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the head of the free queue, evicting their cached hashes."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} are free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 go to the tail in the order given."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> bool:
        """Register a full block under its hash; False when the hash already names another block."""
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every hash (blocks in use keep their contents, they are just never hit again).

        Returns the number of blocks that were cached. Needed when cached KV goes stale, e.g.
        after the weights change, and by benchmarks that must start cold.
        """
        num_cached = len(self.cached_blocks)
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return num_cached

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def check_invariants(self) -> None:
        """Raise AssertionError if the queue, the ref counts and the hash map disagree (tests)."""
        queued_ids = [block.block_id for block in self.free_block_queue]
        assert len(queued_ids) == len(set(queued_ids)) == self.num_free_blocks, "free queue count"
        queued = set(queued_ids)
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"negative ref_cnt on {block}"
            assert (block.ref_cnt == 0) == (block.block_id in queued), f"queue/ref_cnt: {block}"
            if block.block_id not in queued:
                assert block.prev_free is None and block.next_free is None, f"stale links {block}"
            if block.block_hash is not None:
                assert self.cached_blocks.get(block.block_hash) is block, f"unmapped {block}"
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, f"hash map points at {block}"
