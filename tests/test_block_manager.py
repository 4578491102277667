"""KV block pool and KVCacheManager: exact accounting, prefix caching, eviction order."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from flexserve.engine.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock, hash_block_tokens
from flexserve.engine.kv_cache_manager import KVCacheManager
from flexserve.engine.request import Request
from flexserve.sampling_params import SamplingParams


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(), eos_token_id=None, max_tokens=16)


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None):
    """What the scheduler does on admission; returns the hit token count or None on refusal."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit_tokens
    if manager.allocate_slots(request, num_new_tokens, hits) is None:
        return None
    request.num_computed_tokens = num_hit_tokens + num_new_tokens
    return num_hit_tokens


# ---------------------------------------------------------------------------- unit tests


def test_hash_chains_parent_and_tokens():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, [1, 2, 3, 4])
    assert first != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(first, [5, 6]) != hash_block_tokens(None, [5, 6])
    # int64 packing: tokens that would collide when concatenated as bytes or digits do not
    assert hash_block_tokens(None, [1, 23]) != hash_block_tokens(None, [12, 3])
    assert 0 <= first < 2**256


def test_free_queue_remove_from_middle_and_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2]
    assert len(queue) == 4
    with pytest.raises(ValueError):
        queue.append(blocks[2])
    with pytest.raises(ValueError):
        queue.remove(blocks[0])


def test_two_requests_sharing_two_full_blocks():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    shared = [7, 7, 7, 7, 8, 8, 8, 8]
    a = make_request("a", shared + [1, 2])
    b = make_request("b", shared + [3])
    assert admit(manager, a) == 0
    assert admit(manager, b) == 8
    table_a, table_b = manager.get_block_ids("a"), manager.get_block_ids("b")
    assert table_a[:2] == table_b[:2] and table_a[2] != table_b[2]
    assert [manager.block_pool.blocks[i].ref_cnt for i in table_a] == [2, 2, 1]
    assert manager.num_free_blocks == 10 - 4
    assert manager.num_prefix_cache_query_tokens == 10 + 9
    assert manager.num_prefix_cache_hit_tokens == 8
    manager.check_invariants()


def test_fully_cached_prompt_still_computes_its_last_token():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(8)))
    admit(manager, a)
    manager.free(a)
    again = make_request("again", list(range(8)))
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert num_hit_tokens == 4 and len(hits) == 1  # (8 - 1) // 4 blocks, not 2
    longer = make_request("longer", list(range(9)))
    assert manager.get_computed_blocks(longer)[1] == 8
    assert admit(manager, again) == 4
    manager.check_invariants()


def test_hit_on_free_block_revives_it_from_the_queue():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 4 and manager.usage == 0.0
    b = make_request("b", [1, 2, 3, 4, 9])
    assert admit(manager, b) == 4
    assert manager.num_free_blocks == 1
    assert manager.usage == 0.75
    manager.check_invariants()


def test_cached_blocks_are_evicted_when_the_pool_is_full():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    admit(manager, a)
    assert len(manager.block_pool.cached_blocks) == 4
    table = manager.get_block_ids("a")
    manager.free(a)
    # Freed in reverse: the tail block is evicted first, the head block last.
    assert [b.block_id for b in manager.block_pool.free_block_queue] == table[::-1]
    b = make_request("b", [9, 9, 9])  # two fresh blocks: evicts blocks 3 and 2
    assert admit(manager, b) == 0
    assert manager.get_block_ids("b") == table[::-1][:2]
    cached = manager.block_pool.cached_blocks
    assert [h in cached for h in a.block_hashes] == [True, True, False, False]
    again = make_request("again", [1, 2, 3, 4, 5, 6, 7, 8])
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert [h.block_id for h in hits] == [0, 1] and num_hit_tokens == 4
    manager.free(b)
    assert admit(manager, again) == 4
    manager.check_invariants()


def test_refusal_allocates_nothing():
    manager = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(8)))
    admit(manager, a)
    b = make_request("b", list(range(100, 109)))
    assert manager.allocate_slots(b, 9, []) is None
    assert manager.get_block_ids("b") == [] and manager.num_free_blocks == 1
    assert manager.num_prefix_cache_query_tokens == 8  # refused admissions are not counted
    manager.check_invariants()


def test_no_double_free():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(6)))
    admit(manager, a)
    manager.free(a)
    manager.free(a)  # a request holding nothing: no-op
    assert manager.num_free_blocks == 4
    manager.check_invariants()
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([block])
    pool.check_invariants()


def test_decode_allocates_a_block_only_at_the_boundary_and_caches_it():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    admit(manager, a)
    assert len(manager.get_block_ids("a")) == 2
    a.append_output_token_id(4)
    assert manager.allocate_slots(a, 1) == []  # fills the second block
    a.num_computed_tokens += 1
    assert len(manager.block_pool.cached_blocks) == 2
    a.append_output_token_id(5)
    assert len(manager.allocate_slots(a, 1)) == 1
    assert a.block_hashes == [hash_block_tokens(None, [1, 2]),
                              hash_block_tokens(a.block_hashes[0], [3, 4])]


def test_without_prefix_caching_nothing_is_hashed_or_hit():
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a, b = make_request("a", [1, 2, 3, 4, 5]), make_request("b", [1, 2, 3, 4, 5])
    assert admit(manager, a) == 0 and admit(manager, b) == 0
    assert manager.block_pool.cached_blocks == {} and a.block_hashes == []
    assert manager.num_free_blocks == 2 and manager.num_prefix_cache_query_tokens == 0


def test_reset_prefix_cache_forgets_hashes():
    manager = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(manager, a)
    assert manager.reset_prefix_cache() == 2
    assert manager.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([], 0)
    manager.check_invariants()
    manager.free(a)
    assert manager.num_free_blocks == 8


# ---------------------------------------------------------------------------- stateful model

# A tiny alphabet and shared prefixes make equal full blocks (prefix hits) common.
_PREFIXES = [[], [1, 1, 2, 2, 3, 3, 4, 4], [1, 1, 2, 2, 5, 5, 6, 6, 7],
             [1, 1, 2, 2, 3, 3, 4, 4, 5, 6, 7, 8, 1, 2, 3, 4]]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random add / chunked allocate / decode / preempt / finish / abort against a KV model.

    Besides the accounting invariants, a shadow "KV cache" records which token prefix each slot
    was written for; every prefix-cache hit must land on blocks holding exactly the request's
    own prefix, which is what sharing KV between requests requires.
    """

    @initialize(
        # Small pools most of the time: refusals and evictions need pressure.
        num_blocks=st.integers(4, 12) | st.integers(4, 64), block_size=st.integers(1, 8),
        caching=st.booleans(),
    )
    def setup(self, num_blocks, block_size, caching):
        self.manager = KVCacheManager(num_blocks, block_size, caching)
        self.block_size = block_size
        self.pending: dict[str, Request] = {}  # no blocks: new or preempted
        self.active: dict[str, Request] = {}  # holds blocks covering num_computed_tokens
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> prefix
        self.next_id = 0

    def _write(self, request: Request, start: int, end: int) -> None:
        table = self.manager.get_block_ids(request.request_id)
        for pos in range(start, end):
            slot = (table[pos // self.block_size], pos % self.block_size)
            self.slots[slot] = tuple(request.all_token_ids[:pos + 1])

    def _check_table(self, request: Request) -> None:
        table = self.manager.get_block_ids(request.request_id)
        assert len(table) == -(-request.num_computed_tokens // self.block_size)
        for pos in range(request.num_computed_tokens):
            slot = (table[pos // self.block_size], pos % self.block_size)
            assert self.slots[slot] == tuple(request.all_token_ids[:pos + 1])

    @rule(prefix=st.sampled_from(_PREFIXES), suffix=st.lists(st.integers(1, 2), max_size=12))
    def add(self, prefix, suffix):
        request = make_request(f"r{self.next_id}", prefix + suffix or [1])
        self.next_id += 1
        self.pending[request.request_id] = request

    # Rules without preconditions (a no-op when nothing applies): hypothesis gives up on runs
    # where too few rules are enabled.
    @rule(data=st.data())
    def admit(self, data):
        if not self.pending:
            return
        request_id = data.draw(st.sampled_from(sorted(self.pending)))
        request = self.pending[request_id]
        hits, num_hit_tokens = self.manager.get_computed_blocks(request)
        assert num_hit_tokens <= request.num_tokens - 1
        free_before = self.manager.num_free_blocks
        num_new = data.draw(st.integers(1, request.num_tokens - num_hit_tokens))
        if self.manager.allocate_slots(request, num_new, hits) is None:
            event("refused")
            assert self.manager.num_free_blocks == free_before
            assert self.manager.get_block_ids(request_id) == []
            return
        event(f"prefix hit: {num_hit_tokens > 0}")
        request.num_computed_tokens = num_hit_tokens
        self._check_table_prefix(request, num_hit_tokens)
        self._write(request, num_hit_tokens, num_hit_tokens + num_new)
        request.num_computed_tokens += num_new
        self.active[request_id] = self.pending.pop(request_id)
        self._check_table(request)

    def _check_table_prefix(self, request: Request, num_tokens: int) -> None:
        table = self.manager.get_block_ids(request.request_id)
        for pos in range(num_tokens):
            slot = (table[pos // self.block_size], pos % self.block_size)
            assert self.slots[slot] == tuple(request.all_token_ids[:pos + 1]), "bad prefix hit"

    @rule(data=st.data(), token=st.integers(1, 3))
    def step(self, data, token):
        """Next prefill chunk, or one decode token once the prompt is done."""
        if not self.active:
            return
        request = self.active[data.draw(st.sampled_from(sorted(self.active)))]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_id(token)
        start = request.num_computed_tokens
        num_new = data.draw(st.integers(1, request.num_tokens - start))
        table_before = self.manager.get_block_ids(request.request_id)
        if self.manager.allocate_slots(request, num_new) is None:
            event("refused")
            assert self.manager.get_block_ids(request.request_id) == table_before
            return
        self._write(request, start, start + num_new)
        request.num_computed_tokens += num_new
        self._check_table(request)

    @rule(data=st.data())
    def preempt(self, data):
        if not self.active:
            return
        request = self.active.pop(data.draw(st.sampled_from(sorted(self.active))))
        self.manager.free(request)
        request.num_computed_tokens = 0
        self.pending[request.request_id] = request

    @rule(data=st.data())
    def finish_or_abort(self, data):
        if not (self.active or self.pending):
            return
        request_id = data.draw(st.sampled_from(sorted(self.active) + sorted(self.pending)))
        request = self.active.pop(request_id, None) or self.pending.pop(request_id)
        self.manager.free(request)
        self.manager.free(request)  # a second free must be harmless
        assert self.manager.get_block_ids(request_id) == []

    @invariant()
    def accounting(self):
        if not hasattr(self, "manager"):
            return
        self.manager.check_invariants()
        held = {b for r in self.active.values() for b in self.manager.get_block_ids(r.request_id)}
        assert self.manager.num_free_blocks == self.manager.num_blocks - len(held)
        assert self.manager.usage == len(held) / self.manager.num_blocks
        for request in self.active.values():
            self._check_table(request)

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        for request in list(self.active.values()) + list(self.pending.values()):
            self.manager.free(request)
        self.manager.check_invariants()
        assert self.manager.usage == 0.0
        assert self.manager.num_free_blocks == self.manager.num_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
