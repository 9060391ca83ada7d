"""Per-request block tables on top of the block pool: prefix-cache lookups, allocation for the
tokens a step computes, copy-on-write of shared blocks, forks (n > 1) and freeing.

When every layer of the model has a sliding window (W at most), a query at position q reads nothing
before q - W + 1: each allocation gives back the blocks wholly before the oldest position the
request's next queries can see, and their table entries become `NULL_BLOCK` (the tables keep their
layout; no kernel reads an entry before the window). A full block given back stays cached-free, so
prefix hits still find it until it is reused; a prefix hit before the window is not even taken.
"""

from __future__ import annotations

from loraplex.platform.core.block_pool import NULL_BLOCK, Block, BlockPool, hash_block, live
from loraplex.platform.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def reclaim_window(windows: tuple[int | None, ...]) -> int | None:
    """The window past which blocks can be freed, from each layer's (`ModelConfig.layer_windows`): the widest
    when every layer slides; None (nothing is freed) when any layer attends globally."""
    return max(windows) if windows and all(w is not None for w in windows) else None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window  # every layer's window fits in it (`reclaim_window`); None: global
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) for copy-on-write
        self.num_queries = 0  # prefix-cache hit rate, in tokens
        self.num_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request.seq_id, [])]

    def block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks, extended lazily as its tokens grow."""
        hashes = self._hashes.setdefault(request.seq_id, [])
        bs = self.block_size
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[-1] if hashes else None
            block = tuple(request.token_slice(i * bs, (i + 1) * bs))
            hashes.append(hash_block(parent, block, request.extra_keys))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of the request, capped so its last token is always computed."""
        if not self.pool.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        self.num_queries += num_tokens
        self.num_hits += num_hit

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[Block] | None = None) -> list[Block] | None:
        """Make room for `num_new_tokens` after the request's computed ones (plus any prefix-cache
        hit in `computed_blocks`), giving back the blocks no query of it can read again (sliding window:
        they count as free for this allocation). Returns the new blocks, or None when the pool is too small
        (then nothing changed)."""
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.setdefault(request.seq_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        unreadable = self._num_unreadable(num_computed)
        dead = self._still_held(blocks, unreadable)
        dead_hits = max(0, unreadable - len(blocks))  # hits before the window: not taken
        computed_blocks = [NULL_BLOCK] * dead_hits + computed_blocks[dead_hits:]
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new = max(0, num_needed - len(blocks) - len(computed_blocks))
        cow = self._needs_copy_on_write(blocks, num_computed, num_new_tokens)
        # cached-free hits leave the free list when touched; given-back blocks no one else holds join it
        num_revived = sum(1 for b in live(computed_blocks) if b.ref_cnt == 0)
        num_released = sum(1 for i in dead if blocks[i].ref_cnt == 1)
        if num_new + cow > self.pool.num_free_blocks + num_released - num_revived:
            if not blocks:
                del self.req_blocks[request.seq_id]
            return None
        self._release(blocks, dead)
        self.pool.touch(live(computed_blocks))
        blocks.extend(computed_blocks)
        if cow:
            self._copy_on_write(blocks, num_computed // self.block_size)
        new_blocks = self.pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return new_blocks

    def _num_unreadable(self, num_computed: int) -> int:
        """Leading blocks that no query at position `num_computed` or later can read (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    @staticmethod
    def _still_held(blocks: list[Block], upto: int) -> range:
        """The indices of blocks[:upto] not given back yet, newest first. The null entries are a prefix (the
        window only moves forward), so the walk back stops at the first one: O(blocks to give back)."""
        hi = lo = min(upto, len(blocks))
        while lo > 0 and blocks[lo - 1] is not NULL_BLOCK:
            lo -= 1
        return range(hi - 1, lo - 1, -1)

    def _release(self, blocks: list[Block], dead: range) -> None:
        """Give `dead` back to the pool (newest first, so a prompt's first blocks, which later prompts may
        share, stay cached longest); their table entries become NULL_BLOCK."""
        if dead:
            self.pool.free_blocks([blocks[i] for i in dead])
            for i in dead:
                blocks[i] = NULL_BLOCK

    def _needs_copy_on_write(self, blocks: list[Block], num_computed: int, num_new_tokens: int) -> bool:
        idx = num_computed // self.block_size
        partial = num_computed % self.block_size != 0
        return num_new_tokens > 0 and partial and idx < len(blocks) and blocks[idx].ref_cnt > 1

    def _copy_on_write(self, blocks: list[Block], idx: int) -> None:
        shared = blocks[idx]
        (fresh,) = self.pool.get_new_blocks(1)
        self.pool.free_blocks([shared])
        blocks[idx] = fresh
        self.pending_copies.append((shared.block_id, fresh.block_id))

    def _cache_full_blocks(self, request: Request, blocks: list[Block], num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        hashes = self.block_hashes(request)
        for i in range(min(num_tokens // self.block_size, len(hashes))):
            if blocks[i] is not NULL_BLOCK:
                self.pool.cache_block(blocks[i], hashes[i])

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's computed tokens (rejected drafts' positions). None of them is
        in the prefix cache (a block is cached only once every token in it is the request's own), so they go to
        the head of the free queue: the next allocation takes them back instead of evicting a cached block."""
        blocks = self.req_blocks.get(request.seq_id)
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if blocks is not None and len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            self.pool.free_blocks(live(extra), first=True)

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent; writes into a shared block copy it."""
        blocks = self.req_blocks[parent.seq_id]
        self.pool.touch(live(blocks))
        self.req_blocks[child.seq_id] = list(blocks)

    def free(self, request: Request) -> None:
        # tail blocks first: they are the least likely to be shared by another prompt
        blocks = self.req_blocks.pop(request.seq_id, [])
        self.pool.free_blocks(list(reversed(live(blocks))))

    def forget(self, request: Request) -> None:
        """Drop everything kept for a finished request."""
        self.free(request)
        self._hashes.pop(request.seq_id, None)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0
