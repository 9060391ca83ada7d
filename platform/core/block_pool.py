"""Fixed-size KV blocks: ref counts, an O(1) free list, and the hash -> block prefix cache.

Free blocks that still hold a cached prefix stay findable by hash until they are reused; the
free list is ordered so the least recently freed block is reused (evicted) first.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass


def hash_block(parent: bytes | None, token_ids: tuple[int, ...], extra_keys: tuple = ()) -> bytes:
    """Chained hash of one full block: equal hashes mean equal token prefixes under equal extra
    keys (adapter content hash, grammar, ...)."""
    return hashlib.sha256(pickle.dumps((parent, token_ids, extra_keys), protocol=5)).digest()


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev_free: "Block | None" = None
    next_free: "Block | None" = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


# Stands in a request's block table for a block it gave back because no query can read it again (sliding
# window): its id is the tables' padding id, and no kernel reads an entry before the window. It belongs to
# no pool: never counted, touched, cached or freed.
NULL_BLOCK = Block(0)


def live(blocks: list[Block]) -> list[Block]:
    """The blocks of a table that the pool holds references for (all but the null entries)."""
    return [b for b in blocks if b is not NULL_BLOCK]


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the head, append at the tail, remove any
    block in O(1) when a prefix-cache hit revives it."""

    def __init__(self, blocks: list[Block]) -> None:
        self.head = Block(-1)  # sentinels
        self.tail = Block(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        last = self.tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free += 1

    def appendleft(self, block: Block) -> None:
        first = self.head.next_free
        first.prev_free, block.next_free = block, first
        block.prev_free, self.head.next_free = self.head, block
        self.num_free += 1

    def remove(self, block: Block) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free list")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> Block:
        if self.num_free == 0:
            raise RuntimeError("no free blocks")
        block = self.head.next_free
        self.remove(block)
        return block

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self):
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.enable_caching = enable_caching

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-free blocks included: they can be evicted)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def get_cached_block(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[Block], first: bool = False) -> None:
        """Drop one reference each; pass them in eviction order (first = evicted first). `first`: those freed go
        to the head of the free queue, reused before any cached block is evicted (blocks whose content no one
        will look up)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (self.free_queue.appendleft if first else self.free_queue.append)(block)

    def cache_block(self, block: Block, block_hash: bytes) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:  # same content already cached in another block
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
