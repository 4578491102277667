"""Per-request KV block tables on top of the block pool, with automatic prefix caching.

A request's block table covers exactly its computed-and-scheduled tokens: block i holds token
positions [i * block_size, (i + 1) * block_size). Prefix caching keys every full block by a hash
chained over all tokens up to its end, so a hit on block i implies equal tokens in blocks 0..i.
Requests with a LoRA adapter chain from an adapter-specific root, so they share blocks only with
requests of the same adapter registration.
"""

from __future__ import annotations

from collections.abc import Sequence

from flexserve.engine.block_pool import (
    BlockPool,
    KVCacheBlock,
    adapter_root_hash,
    hash_block_tokens,
)
from flexserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates, caches and frees requests' KV blocks (bookkeeping only: the worker owns memory)."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}  # request id -> block table
        # request id -> the same table as block ids, kept in step so that building a plan row
        # costs one list copy, not a pass over the blocks every step
        self.req_to_block_ids: dict[str, list[int]] = {}
        # request id -> leading blocks of its table already offered to the hash map, so each full
        # block is hashed and registered once however many steps it took to fill
        self.num_cached_blocks: dict[str, int] = {}
        self.num_prefix_cache_query_tokens = 0  # tokens of admitted requests looked up
        self.num_prefix_cache_hit_tokens = 0  # of those, tokens served from the cache

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (including cached ones that allocation may evict)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return self.block_pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.num_prefix_cache_query_tokens == 0:
            return 0.0
        return self.num_prefix_cache_hit_tokens / self.num_prefix_cache_query_tokens

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (a new list; empty when it holds none)."""
        block_ids = self.req_to_block_ids.get(request_id)
        return [] if block_ids is None else block_ids.copy()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of the request's leading full blocks found in the prefix cache.

        Returns the blocks and the number of tokens they hold. At most (num_tokens - 1) //
        block_size blocks hit, so even a fully cached prompt computes its last token, whose
        logits are needed to sample. Takes no references: pass the blocks to `allocate_slots`.
        Only meaningful for a request that holds no blocks (not yet admitted, or preempted).
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request, request.num_tokens)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed_blocks = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed_blocks.append(block)
        return computed_blocks, len(computed_blocks) * self.block_size

    def get_num_blocks_to_allocate(
        self, request: Request, num_total_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> int:
        """Free blocks consumed if the request's table grew to cover `num_total_tokens` tokens.

        Counts fresh blocks plus prefix-cache hits that sit in the free queue (taking them
        removes them from it); hits already held by another request cost nothing.
        """
        num_held = len(self.req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        num_fresh = max(0, cdiv(num_total_tokens, self.block_size) - num_held)
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        return num_fresh + num_revived

    def allocate_slots(
        self, request: Request, num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None, cache_blocks: bool = True,
    ) -> list[int] | None:
        """Grow the request's table to cover its computed tokens, the hits and `num_new_tokens`.

        `new_computed_blocks` are the hits from `get_computed_blocks` for a request being
        admitted; passing it (even empty) marks an admission, which is what the prefix-cache
        stats count. Does not change `request.num_computed_tokens`: the scheduler advances it.
        Returns the ids of the freshly allocated blocks (possibly an empty list), or None, with
        nothing allocated, when the free queue is too short.

        Every block that the scheduled tokens fill is registered in the prefix cache right away,
        before the worker has written it: the worker writes all new KV of a step before
        attention reads any in each layer, so a request admitted later in the same step may
        already share it. `cache_blocks=False` keeps them out of the prefix cache (fine-tuning
        sequences: their K/V comes from an adapter that changes every optimizer step).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None and new_computed_blocks is None:
            # Fast path of a running request (most decode steps): its table may already cover
            # the new tokens, so nothing is allocated.
            num_total_tokens = request.num_computed_tokens + num_new_tokens
            if num_total_tokens <= len(blocks) * self.block_size:
                if num_total_tokens > request.num_tokens:
                    raise ValueError(
                        f"request {request.request_id}: {num_total_tokens} tokens scheduled, "
                        f"{request.num_tokens} known"
                    )
                if self.enable_prefix_caching and cache_blocks:
                    self._cache_full_blocks(request, blocks, num_total_tokens)
                return []
        hits = list(new_computed_blocks or ())
        if hits and (blocks or request.num_computed_tokens):
            raise ValueError(f"request {request.request_id} already has computed tokens")
        num_total_tokens = (
            request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        )
        if num_total_tokens > request.num_tokens:
            raise ValueError(
                f"request {request.request_id}: {num_total_tokens} tokens scheduled, "
                f"{request.num_tokens} known"
            )
        num_needed = self.get_num_blocks_to_allocate(request, num_total_tokens, hits)
        if num_needed > self.num_free_blocks:
            return None

        if blocks is None:
            blocks = self.req_to_blocks[request.request_id] = []
            self.req_to_block_ids[request.request_id] = []
            self.num_cached_blocks[request.request_id] = 0
        block_ids = self.req_to_block_ids[request.request_id]
        if new_computed_blocks is not None and self.enable_prefix_caching:
            self.num_prefix_cache_query_tokens += request.num_tokens
            self.num_prefix_cache_hit_tokens += len(hits) * self.block_size
        self.block_pool.touch(hits)
        blocks.extend(hits)
        block_ids.extend(block.block_id for block in hits)
        self.num_cached_blocks[request.request_id] += len(hits)
        num_fresh = max(0, cdiv(num_total_tokens, self.block_size) - len(blocks))
        new_blocks = self.block_pool.get_new_blocks(num_fresh)
        blocks.extend(new_blocks)
        new_block_ids = [block.block_id for block in new_blocks]
        block_ids.extend(new_block_ids)
        if self.enable_prefix_caching and cache_blocks:
            self._cache_full_blocks(request, blocks, num_total_tokens)
        return new_block_ids

    def allocate_lookahead(self, request: Request, num_tokens: int) -> bool:
        """Grow a running request's table by `num_tokens` positions past its computed tokens,
        whose token ids the host does not know yet (asynchronous scheduling). Such blocks are
        not registered in the prefix cache here: a later `allocate_slots` of the request does
        that once their tokens are known. False, with nothing allocated, when the request holds
        no table or the free queue is too short."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            return False
        num_fresh = cdiv(request.num_computed_tokens + num_tokens, self.block_size) - len(blocks)
        if num_fresh > self.num_free_blocks:
            return False
        if num_fresh > 0:
            new_blocks = self.block_pool.get_new_blocks(num_fresh)
            blocks.extend(new_blocks)
            self.req_to_block_ids[request.request_id].extend(b.block_id for b in new_blocks)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks; freeing a request that holds none is a no-op.

        The table goes back in reverse so the request's last blocks reach the head of the
        eviction order first: a later request sharing its prefix more likely needs the early
        blocks, and evicting a middle block would make the blocks after it unreachable anyway.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> int:
        """Forget all cached hashes; returns how many blocks were cached."""
        return self.block_pool.reset_prefix_cache()

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes to the full blocks among its first `num_tokens` tokens."""
        hashes = request.block_hashes
        block_size = self.block_size
        token_ids = request.all_token_ids
        root = adapter_root_hash(request.lora_int_id) if request.lora_int_id else None
        for i in range(len(hashes), num_tokens // block_size):
            parent = hashes[i - 1] if i > 0 else root
            hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size]))

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_total_tokens: int
    ) -> None:
        num_full = num_total_tokens // self.block_size
        num_done = self.num_cached_blocks[request.request_id]
        if num_full <= num_done:
            return
        self._update_block_hashes(request, num_full * self.block_size)
        for i in range(num_done, num_full):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def check_invariants(self) -> None:
        """Raise AssertionError unless every block is free xor held, with exact ref counts."""
        self.block_pool.check_invariants()
        holders = [0] * self.num_blocks
        for request_id, blocks in self.req_to_blocks.items():
            ids = [block.block_id for block in blocks]
            assert len(ids) == len(set(ids)), f"{request_id} holds a block twice: {ids}"
            assert self.num_cached_blocks[request_id] <= len(blocks), request_id
            assert self.req_to_block_ids[request_id] == ids, f"{request_id}: stale block ids"
            for block_id in ids:
                holders[block_id] += 1
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block} is held by {holders[block.block_id]} tables"
            )
        assert self.req_to_blocks.keys() == self.num_cached_blocks.keys(), "bookkeeping keys"
        assert self.req_to_blocks.keys() == self.req_to_block_ids.keys(), "bookkeeping keys"
