"""Paged KV cache bookkeeping: a block pool with reference counts and prefix caching.

The device memory itself lives in the worker; this module only decides which block ids a
request owns. Blocks are shared between requests through prefix caching: a *full* block is
identified by a chained hash of its tokens (``hash(parent_hash, tokens)``), so two prompts
with the same first ``k * block_size`` tokens map to the same ``k`` blocks.

Invariants:
- A block is in the free queue iff its reference count is 0.
- A block with a hash is findable in ``cached`` until it is evicted (reallocated).
- Only blocks whose every token is real (sampled and received, or prompt) are hashed; a
  position still holding an async placeholder never enters the cache.
- ``free(request)`` releases the request's blocks and forgets its block table, so each
  allocation is released once: freeing a request that holds no blocks (never admitted,
  already preempted, or freed before) is a no-op, which the scheduler relies on when it
  finishes a preempted request. A block released more often than it was taken trips
  ``BlockPool.release``'s double-free assert.
"""
from __future__ import annotations

import logging
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import xxhash

from tandem.types.request import Request

logger = logging.getLogger(__name__)

_ROOT_HASH = 0x7A6E_6465_6D00  # arbitrary parent of the first block


def hash_block(parent: int, tokens: list[int] | tuple[int, ...]) -> int:
    """xxh3 of the parent hash (8 bytes) and the tokens (4 bytes each), little-endian."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<Q{len(tokens)}I", parent, *tokens))


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[int] = None


class BlockPool:
    """Fixed set of blocks. Freed blocks queue up in LRU order; cached ones stay reusable."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, oldest freed first: eviction takes from the front.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict the cached content it held
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits (removing them from the free queue)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free_queue[b.block_id]
            b.ref_cnt += 1

    def release(self, blocks: list[KVCacheBlock]) -> None:
        # Free in reverse so a request's tail blocks are evicted before its shared prefix.
        for b in reversed(blocks):
            assert b.ref_cnt > 0, f"double free of block {b.block_id}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None or not self.enable_caching:
                    b.block_hash = None
                self.free_queue[b.block_id] = b

    def lookup(self, block_hash: int) -> Optional[KVCacheBlock]:
        return self.cached.get(block_hash)

    def set_hash(self, block: KVCacheBlock, block_hash: int) -> None:
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        # Keep the first holder of a hash: another request may have computed the same
        # content in a block of its own in the same step; both are valid.
        self.cached.setdefault(block_hash, block)


class KVCacheManager:
    """Per-request block tables on top of the block pool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[int, list[KVCacheBlock]] = {}  # id(request) -> blocks
        self.req_num_hashed: dict[int, int] = {}
        self.stats_queries = 0
        self.stats_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(id(request), [])]

    # -- hashing -------------------------------------------------------------------
    def _update_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` over every full block of *real* tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        if (len(hashes) + 1) * bs > request.num_tokens:
            return  # no new full block (the common case: checked before copying the tokens)
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            j = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block(parent, tokens[j * bs:(j + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in blocks, leaving >= 1 token to compute.

        A request that wants prompt logprobs gets no hit: the logprobs of a prompt position
        come from the forward over it, which a cached prefix would skip. Its own blocks are
        still published for later requests (their KV is the same)."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        self.stats_queries += request.num_tokens
        self.stats_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    # -- allocation -----------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Optional[list[KVCacheBlock]] = None
    ) -> Optional[list[int]]:
        """Make room for ``num_new_tokens`` more tokens; return the new block ids or None."""
        key = id(request)
        owned = self.req_blocks.get(key)
        n_owned = 0 if owned is None else len(owned)
        if not computed_blocks:  # the per-step path of a running request: usually no new block
            need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - n_owned
            if need <= 0:
                return []
            if need > self.pool.num_free_blocks:
                return None
            new = self.pool.allocate(need)
            if owned is None:
                self.req_blocks[key] = owned = new
            else:
                owned.extend(new)
            request.kv_num_slots = len(owned) * self.block_size
            return [b.block_id for b in new]
        owned = owned or []
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(owned) - len(computed_blocks)
        # Cached hits that sit in the free queue are consumed by touching them.
        hits_in_free = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need + hits_in_free > self.pool.num_free_blocks:
            return None
        if computed_blocks:
            self.pool.touch(computed_blocks)
        new = self.pool.allocate(max(need, 0))
        blocks = owned + computed_blocks + new
        self.req_blocks[key] = blocks
        request.kv_num_slots = len(blocks) * self.block_size
        return [b.block_id for b in computed_blocks + new]

    def cache_full_blocks(self, request: Request, num_real_computed: int) -> None:
        """Publish the request's full blocks whose tokens are all real and computed.

        Sets ``request.kv_publish_at``: while fewer tokens than that are real and computed,
        a call would publish nothing, so the scheduler's hot loops skip it."""
        if not self.enable_prefix_caching:
            return
        key = id(request)
        start = self.req_num_hashed.get(key, 0)
        request.kv_publish_at = (start + 1) * self.block_size
        if request.kv_publish_at > num_real_computed:
            return  # no block filled since the last call (most decode steps)
        blocks = self.req_blocks.get(key)
        if not blocks:
            return
        self._update_hashes(request)
        n_full = min(num_real_computed // self.block_size, len(request.block_hashes), len(blocks))
        for j in range(start, n_full):
            self.pool.set_hash(blocks[j], request.block_hashes[j])
        if n_full > start:
            self.req_num_hashed[key] = n_full
            request.kv_publish_at = (n_full + 1) * self.block_size

    def uncache(self, request: Request) -> None:
        """Withdraw the request's blocks from the prefix cache (their KV is not trusted)."""
        for b in self.req_blocks.get(id(request), []):
            if b.block_hash is not None:
                if self.pool.cached.get(b.block_hash) is b:
                    del self.pool.cached[b.block_hash]
                b.block_hash = None
        self.req_num_hashed.pop(id(request), None)
        request.kv_publish_at = 0
        request.block_hashes.clear()

    def free(self, request: Request) -> None:
        """Release the request's blocks and forget its table; a no-op when it holds none."""
        key = id(request)
        blocks = self.req_blocks.pop(key, None)
        self.req_num_hashed.pop(key, None)
        request.kv_publish_at = 0
        request.kv_num_slots = 0
        if blocks:
            self.pool.release(blocks)

    def num_owned_total(self) -> int:
        return sum(len(b) for b in self.req_blocks.values())

    def num_owned(self, request: Request) -> int:
        return len(self.req_blocks.get(id(request), []))

    def check_integrity(self) -> None:
        """Assert the accounting invariants (cheap enough to run when idle)."""
        refs = [0] * self.pool.num_blocks
        for blocks in self.req_blocks.values():
            for b in blocks:
                refs[b.block_id] += 1
        for b in self.pool.blocks:
            assert b.ref_cnt == refs[b.block_id], f"block {b.block_id}: ref {b.ref_cnt} != owners {refs[b.block_id]}"
            assert (b.ref_cnt == 0) == (b.block_id in self.pool.free_queue), f"block {b.block_id} free-queue mismatch"
