"""KV cache manager / block pool: accounting, reference counts, prefix caching, eviction.

The manager only hands out block ids; these tests drive it the way the scheduler does
(``get_computed_blocks`` -> ``allocate_slots`` -> advance ``num_computed_tokens`` ->
``cache_full_blocks``; ``free`` at the end) and check the pool's invariants after every
operation, including a hypothesis state machine that also tracks what every block *holds*
(so a prefix hit on a block with the wrong content is caught).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tandem.scheduler.kv_cache import _ROOT_HASH, BlockPool, KVCacheManager, hash_block
from tandem.types.request import Request
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)

BS = 4


def mkreq(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64), [1], 64)


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None):
    """What the scheduler does for a waiting request; returns (new block ids, num hit tokens)."""
    hits, n_hit = kv.get_computed_blocks(req)
    n = req.num_tokens - n_hit if num_new is None else num_new
    ids = kv.allocate_slots(req, n, hits)
    if ids is None:
        return None, n_hit
    req.num_computed_tokens = n_hit + n
    kv.cache_full_blocks(req, min(req.num_computed_tokens, req.num_tokens))
    return ids, n_hit


def snapshot(kv: KVCacheManager):
    pool = kv.pool
    return (
        list(pool.free_queue.keys()),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {h: b.block_id for h, b in pool.cached.items()},
        {k: [b.block_id for b in v] for k, v in kv.req_blocks.items()},
        dict(kv.req_num_hashed),
    )


def full_check(kv: KVCacheManager) -> None:
    kv.check_integrity()
    pool = kv.pool
    for h, b in pool.cached.items():
        assert b.block_hash == h, f"cached[{h}] is block {b.block_id} with hash {b.block_hash}"
    owned = set()
    for blocks in kv.req_blocks.values():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), "a request holds the same block twice"
        owned |= set(ids)
    assert kv.num_free_blocks == pool.num_blocks - len(owned)
    assert len(pool.free_queue) == len(set(pool.free_queue))


# -- allocation / free accounting ------------------------------------------------------------
@pytest.mark.timeout(60)
def test_allocate_and_free_accounting():
    kv = KVCacheManager(10, BS, enable_prefix_caching=False)
    r = mkreq("r", list(range(10, 20)))  # 10 tokens -> 3 blocks
    ids, hit = admit(kv, r)
    assert hit == 0 and len(ids) == 3 and len(set(ids)) == 3
    assert kv.num_free_blocks == 7 and kv.num_owned(r) == 3 and kv.block_ids(r) == ids
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in ids)
    full_check(kv)
    # decode: positions 10, 11 fit in block 3; position 12 needs a 4th
    for pos, expect_new in [(10, 0), (11, 0), (12, 1), (13, 0)]:
        r.output_token_ids.append(5)
        got = kv.allocate_slots(r, 1)
        assert got is not None and len(got) == expect_new
        r.num_computed_tokens += 1
        full_check(kv)
    assert kv.num_owned(r) == 4 and kv.num_free_blocks == 6
    assert kv.num_owned_total() == 4
    kv.free(r)
    assert kv.num_free_blocks == 10 and kv.num_owned(r) == 0 and kv.block_ids(r) == []
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    full_check(kv)


@pytest.mark.timeout(60)
def test_blocks_needed():
    kv = KVCacheManager(4, BS, True)
    assert [kv.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


@pytest.mark.timeout(60)
def test_chunked_allocation_grows_block_table():
    kv = KVCacheManager(10, BS, True)
    r = mkreq("r", list(range(10, 23)))  # 13 tokens
    ids1, _ = admit(kv, r, num_new=5)
    assert len(ids1) == 2 and r.num_computed_tokens == 5
    ids2 = kv.allocate_slots(r, 5)
    r.num_computed_tokens += 5
    assert len(ids2) == 1
    ids3 = kv.allocate_slots(r, 3)
    r.num_computed_tokens += 3
    assert len(ids3) == 1
    assert kv.block_ids(r) == ids1 + ids2 + ids3
    full_check(kv)


# -- prefix caching ------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_shared_prefix_ref_counts():
    kv = KVCacheManager(16, BS, True)
    prefix = list(range(100, 108))  # two full blocks
    a = mkreq("a", prefix + [1, 2, 3])
    ids_a, hit = admit(kv, a)
    assert hit == 0 and len(ids_a) == 3
    b = mkreq("b", prefix + [7, 8])
    ids_b, hit = admit(kv, b)
    assert hit == 8
    assert ids_b[:2] == ids_a[:2], "b reuses a's two prefix blocks"
    assert len(ids_b) == 3 and ids_b[2] != ids_a[2]
    assert [kv.pool.blocks[i].ref_cnt for i in ids_a] == [2, 2, 1]
    assert kv.num_free_blocks == 16 - 4
    full_check(kv)
    c = mkreq("c", prefix + [9])
    ids_c, hit = admit(kv, c)
    assert hit == 8 and [kv.pool.blocks[i].ref_cnt for i in ids_a[:2]] == [3, 3]
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in ids_a] == [2, 2, 0]
    assert ids_a[0] not in kv.pool.free_queue and ids_a[2] in kv.pool.free_queue
    kv.free(b)
    kv.free(c)
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks) and kv.num_free_blocks == 16
    # freed blocks stay findable: a fourth request hits them from the free queue
    d = mkreq("d", prefix + [4])
    _, hit = admit(kv, d)
    assert hit == 8
    full_check(kv)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n_tokens, expect_hit", [(4, 0), (5, 4), (7, 4), (8, 4), (9, 8), (11, 8), (12, 8),
                                                  (13, 12)])
def test_prefix_hit_only_full_blocks_and_never_the_whole_prompt(n_tokens, expect_hit):
    kv = KVCacheManager(16, BS, True)
    toks = list(range(200, 216))
    a = mkreq("a", toks)  # 4 full blocks cached
    admit(kv, a)
    assert len(kv.pool.cached) == 4
    b = mkreq("b", toks[:n_tokens])
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == expect_hit == len(hits) * BS
    assert n_hit % BS == 0 and n_hit <= n_tokens - 1, "at least one token is always left to compute"
    assert [h.block_id for h in hits] == kv.block_ids(a)[:len(hits)]


@pytest.mark.timeout(60)
def test_partial_block_is_not_cached():
    kv = KVCacheManager(16, BS, True)
    a = mkreq("a", list(range(10)))  # blocks: [0..3], [4..7], [8, 9]
    admit(kv, a)
    assert len(a.block_hashes) == 2 and len(kv.pool.cached) == 2
    tail = kv.pool.blocks[kv.block_ids(a)[2]]
    assert tail.block_hash is None
    kv.free(a)
    assert tail.block_hash is None and len(kv.pool.cached) == 2


@pytest.mark.timeout(60)
def test_chained_hashes_depend_on_the_prefix():
    same = [50, 51, 52, 53]
    h_a = hash_block(hash_block(_ROOT_HASH, [1, 2, 3, 4]), same)
    h_b = hash_block(hash_block(_ROOT_HASH, [9, 9, 9, 9]), same)
    assert h_a != h_b
    assert hash_block(_ROOT_HASH, same) not in (h_a, h_b)
    assert hash_block(_ROOT_HASH, [1, 2, 3, 4]) == hash_block(_ROOT_HASH, (1, 2, 3, 4))
    assert hash_block(_ROOT_HASH, [1, 2]) != hash_block(_ROOT_HASH, [2, 1])

    kv = KVCacheManager(16, BS, True)
    a = mkreq("a", [1, 2, 3, 4] + same + [0])
    admit(kv, a)
    assert a.block_hashes == [hash_block(_ROOT_HASH, [1, 2, 3, 4]), h_a]
    # b shares a's *second* block content but not its first: no hit at all
    b = mkreq("b", [9, 9, 9, 9] + same + [0])
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 0 and hits == []
    assert b.block_hashes[1] == h_b != a.block_hashes[1]


@pytest.mark.timeout(60)
def test_hashes_cover_output_tokens_too():
    kv = KVCacheManager(16, BS, True)
    a = mkreq("a", [1, 2, 3])
    admit(kv, a)
    a.output_token_ids.append(4)  # sampled; its KV is computed by the next step
    kv.cache_full_blocks(a, a.num_computed_tokens)
    # (hashes are computed lazily, when a block can be published: nothing is cached yet)
    assert len(kv.pool.cached) == 0, "position 3 not computed yet"
    kv.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    kv.cache_full_blocks(a, a.num_computed_tokens)
    assert len(kv.pool.cached) == 1
    b = mkreq("b", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(b)[1] == 4


@pytest.mark.timeout(60)
def test_prefix_caching_disabled():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = mkreq("a", list(range(9)))
    admit(kv, a)
    b = mkreq("b", list(range(9)))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.pool.cached == {} and all(blk.block_hash is None for blk in kv.pool.blocks)
    kv.free(a)
    assert all(blk.block_hash is None for blk in kv.pool.blocks)


# -- eviction / free queue -----------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_eviction_takes_unreferenced_cached_blocks_in_lru_order():
    kv = KVCacheManager(6, BS, True)
    reqs = [mkreq(f"r{i}", [10 * i + j for j in range(4)] + [999]) for i in range(3)]
    for r in reqs:
        admit(kv, r)  # each: one cached full block + one partial block
    assert kv.num_free_blocks == 0
    for r in reqs:
        kv.free(r)  # r0 freed first (oldest), r2 last
    full_blocks = [kv.pool.lookup(r.block_hashes[0]) for r in reqs]
    assert all(b is not None and b.ref_cnt == 0 for b in full_blocks)
    # free queue: per request its tail (partial) block first, then its cached prefix block
    order = list(kv.pool.free_queue)
    assert order.index(full_blocks[0].block_id) < order.index(full_blocks[1].block_id) \
        < order.index(full_blocks[2].block_id)
    # Allocating 3 blocks evicts the three oldest freed: r0's tail, r0's full block, r1's tail.
    x = mkreq("x", list(range(500, 512)))
    ids, hit = admit(kv, x)
    assert hit == 0 and ids == order[:3]
    assert kv.pool.lookup(reqs[0].block_hashes[0]) is None, "oldest cached block evicted"
    assert full_blocks[0].block_hash == x.block_hashes[ids.index(full_blocks[0].block_id)]  # holds x now
    assert kv.pool.lookup(reqs[1].block_hashes[0]) is full_blocks[1]
    assert kv.pool.lookup(reqs[2].block_hashes[0]) is full_blocks[2]
    full_check(kv)
    # r1 and r2 can still hit their prefix
    again = mkreq("again", reqs[2].prompt_token_ids)
    assert kv.get_computed_blocks(again)[1] == 4


@pytest.mark.timeout(60)
def test_release_order_evicts_request_tail_before_its_prefix():
    kv = KVCacheManager(3, BS, True)
    a = mkreq("a", list(range(12)))  # 3 full blocks, all cached
    ids, _ = admit(kv, a)
    kv.free(a)
    assert list(kv.pool.free_queue) == list(reversed(ids))
    # one new block evicts a's last block: a's first two blocks are still a hit
    kv.allocate_slots(mkreq("x", [7]), 1)
    b = mkreq("b", list(range(12)))
    assert kv.get_computed_blocks(b)[1] == 8


@pytest.mark.timeout(60)
def test_hit_on_cached_block_in_free_queue_removes_it_from_the_queue():
    kv = KVCacheManager(8, BS, True)
    a = mkreq("a", list(range(9)))
    ids_a, _ = admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 8 and all(i in kv.pool.free_queue for i in ids_a)
    b = mkreq("b", list(range(9)))
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 8
    got = kv.allocate_slots(b, 1, hits)
    assert got[:2] == ids_a[:2]
    for blk in hits:
        assert blk.block_id not in kv.pool.free_queue and blk.ref_cnt == 1
    assert kv.num_free_blocks == 8 - 3
    full_check(kv)
    # the hit blocks can no longer be handed out by allocate()
    others = kv.pool.allocate(kv.num_free_blocks)
    assert not ({b.block_id for b in others} & set(ids_a[:2]))
    assert kv.num_free_blocks == 0


@pytest.mark.timeout(60)
def test_allocating_with_hits_does_not_evict_the_hits():
    """A hit that sits at the front of the free queue must be taken before new blocks are popped."""
    kv = KVCacheManager(3, BS, True)
    a = mkreq("a", list(range(8)))
    ids_a, _ = admit(kv, a)
    kv.free(a)  # queue: [free never-used block, a's 2nd, a's 1st]
    b = mkreq("b", list(range(4)) + [77, 78, 79, 80, 81])  # hits a's first block only
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 4
    ids_b = kv.allocate_slots(b, 5, hits)  # 9 tokens: the hit + 2 new blocks = all 3
    assert ids_b is not None and ids_b[0] == ids_a[0] and len(set(ids_b)) == 3
    assert kv.pool.blocks[ids_a[0]].block_hash == a.block_hashes[0]
    assert kv.pool.lookup(a.block_hashes[0]) is kv.pool.blocks[ids_a[0]]
    full_check(kv)


@pytest.mark.timeout(60)
def test_same_content_computed_twice_keeps_first_holder():
    kv = KVCacheManager(8, BS, True)
    a = mkreq("a", list(range(5)))
    b = mkreq("b", list(range(5)))
    # both allocate before either publishes (same scheduler step)
    ha, _ = kv.get_computed_blocks(a)
    hb, _ = kv.get_computed_blocks(b)
    ids_a = kv.allocate_slots(a, 5, ha)
    ids_b = kv.allocate_slots(b, 5, hb)
    a.num_computed_tokens = b.num_computed_tokens = 5
    kv.cache_full_blocks(a, 5)
    kv.cache_full_blocks(b, 5)
    assert ids_a[0] != ids_b[0]
    assert kv.pool.lookup(a.block_hashes[0]).block_id == ids_a[0]
    kv.free(a)
    kv.free(b)
    full_check(kv)
    # evicting b's duplicate must not drop a's entry
    kv.pool.free_queue.move_to_end(ids_a[0])
    for _ in range(7):
        kv.pool.allocate(1)
    assert kv.pool.blocks[ids_b[0]].block_hash is None  # b's copy was reused
    assert kv.pool.lookup(a.block_hashes[0]).block_id == ids_a[0]
    assert all(blk.block_hash == h for h, blk in kv.pool.cached.items())


# -- double free / failed allocation ----------------------------------------------------------
@pytest.mark.timeout(60)
def test_double_free_is_impossible():
    kv = KVCacheManager(8, BS, True)
    a = mkreq("a", list(range(9)))
    ids, _ = admit(kv, a)
    releases = []
    orig = kv.pool.release
    kv.pool.release = lambda blocks: (releases.append([b.block_id for b in blocks]), orig(blocks))[1]
    kv.free(a)
    kv.free(a)
    assert releases == [ids]
    assert kv.num_free_blocks == 8
    full_check(kv)
    with pytest.raises(AssertionError, match="double free"):
        orig([kv.pool.blocks[ids[0]]])
    # the same through a shared block: two owners, two releases, then no more
    kv2 = KVCacheManager(8, BS, True)
    x, y = mkreq("x", list(range(9))), mkreq("y", list(range(9)))
    admit(kv2, x)
    admit(kv2, y)
    shared = kv2.pool.blocks[kv2.block_ids(x)[0]]
    assert shared.ref_cnt == 2
    kv2.free(x)
    kv2.free(x)
    assert shared.ref_cnt == 1 and shared.block_id not in kv2.pool.free_queue
    kv2.free(y)
    assert shared.ref_cnt == 0 and shared.block_id in kv2.pool.free_queue
    full_check(kv2)


@pytest.mark.timeout(60)
def test_allocate_slots_out_of_blocks_returns_none_and_changes_nothing():
    kv = KVCacheManager(5, BS, True)
    a = mkreq("a", list(range(9)))  # 3 blocks
    admit(kv, a)
    before = snapshot(kv)
    big = mkreq("big", list(range(100, 112)))  # needs 3, only 2 free
    hits, n_hit = kv.get_computed_blocks(big)
    assert kv.allocate_slots(big, 12, hits) is None
    assert snapshot(kv) == before and kv.num_owned(big) == 0
    # a running request asking for more than is free
    a.output_token_ids += [5] * 20
    assert kv.allocate_slots(a, 20) is None
    assert snapshot(kv) == before
    full_check(kv)


@pytest.mark.timeout(60)
def test_allocate_slots_fails_when_hits_in_free_queue_leave_too_little():
    """Touching a free-queue hit consumes a free block: the check must count it, and touch nothing on failure."""
    kv = KVCacheManager(4, BS, True)
    a = mkreq("a", list(range(8)))
    admit(kv, a)
    kv.free(a)  # 2 cached blocks in the free queue, 4 free in total
    keep = mkreq("keep", [500])
    admit(kv, keep)  # takes the never-used block at the front of the queue: 3 free, 2 of them a's
    before = snapshot(kv)
    b = mkreq("b", list(range(8)) + list(range(300, 309)))  # 17 tokens: 5 blocks, 2 hits at most
    hits, n_hit = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, b.num_tokens - n_hit, hits) is None
    assert snapshot(kv) == before
    for blk in hits:
        assert blk.ref_cnt == 0 and blk.block_id in kv.pool.free_queue
    full_check(kv)


@pytest.mark.timeout(60)
def test_pool_allocate_more_than_free_raises():
    pool = BlockPool(2, True)
    pool.allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(1)


# -- randomized: state machine -------------------------------------------------------------------
class KVMachine(RuleBasedStateMachine):
    """Random admits (with prefix hits), chunked prefill, decodes, preemption-style frees.

    Shadow state: what each full block *contains* (the token prefix it was computed for);
    every prefix hit must hand out blocks whose content is exactly the request's prefix.
    """

    @initialize(num_blocks=st.integers(3, 14), bs=st.sampled_from([1, 2, 4]), caching=st.booleans())
    def setup(self, num_blocks, bs, caching):
        self.kv = KVCacheManager(num_blocks, bs, caching)
        self.bs = bs
        self.live: list[Request] = []
        self.content: dict[int, tuple[int, ...]] = {}
        self.n = 0

    def _written(self, req: Request, new_ids: list[int], start: int, end: int) -> None:
        for bid in new_ids:
            self.content.pop(bid, None)  # fresh block: old content gone
        table = self.kv.block_ids(req)
        toks = req.all_token_ids
        for j in range(start // self.bs, end // self.bs):
            if (j + 1) * self.bs <= end:
                self.content[table[j]] = tuple(toks[:(j + 1) * self.bs])

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14), chunk=st.integers(1, 14))
    def admit(self, prompt, chunk):
        self.n += 1
        r = mkreq(f"r{self.n}", prompt)
        hits, n_hit = self.kv.get_computed_blocks(r)
        assert n_hit == len(hits) * self.bs and n_hit <= len(prompt) - 1
        if not self.kv.enable_prefix_caching:
            assert n_hit == 0
        for j, b in enumerate(hits):
            assert self.content.get(b.block_id) == tuple(prompt[:(j + 1) * self.bs]), "hit on wrong content"
        n = min(chunk, len(prompt) - n_hit)
        before = snapshot(self.kv)
        ids = self.kv.allocate_slots(r, n, hits)
        if ids is None:
            assert snapshot(self.kv) == before
            return
        assert ids[:len(hits)] == [b.block_id for b in hits]
        r.num_computed_tokens = n_hit + n
        self._written(r, ids[len(hits):], n_hit, n_hit + n)
        self.kv.cache_full_blocks(r, r.num_computed_tokens)
        self.live.append(r)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tok=st.integers(0, 2), chunk=st.integers(1, 6))
    def advance(self, data, tok, chunk):
        r = data.draw(st.sampled_from(self.live))
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(tok)  # "sampled" at the end of the known tokens
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        before = snapshot(self.kv)
        ids = self.kv.allocate_slots(r, n)
        if ids is None:
            assert snapshot(self.kv) == before
            return
        start = r.num_computed_tokens
        r.num_computed_tokens += n
        self._written(r, ids, start, start + n)
        self.kv.cache_full_blocks(r, r.num_computed_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), twice=st.booleans())
    def free(self, data, twice):
        r = data.draw(st.sampled_from(self.live))
        self.live.remove(r)
        self.kv.free(r)
        if twice:
            self.kv.free(r)  # must be a no-op

    @invariant()
    def integrity(self):
        if not hasattr(self, "kv"):
            return
        full_check(self.kv)
        for r in self.live:
            assert self.kv.num_owned(r) == self.kv.blocks_needed(r.num_computed_tokens)
            assert len(r.block_hashes) <= r.num_tokens // self.bs
        for h, b in self.kv.pool.cached.items():
            assert b.block_id in self.content, "a cached block with no computed content"

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for r in self.live:
            self.kv.free(r)
        full_check(self.kv)
        assert self.kv.num_free_blocks == self.kv.num_blocks


KVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
TestKVMachine = KVMachine.TestCase
