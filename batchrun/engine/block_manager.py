"""Bookkeeping of the paged KV pool: free list, block tables, ref counts, prefix cache.

Only this class touches block tables and ref counts. The scheduler asks whether slots can be
allocated; `False` is a normal answer that leads to preemption.
"""
from __future__ import annotations

from collections import OrderedDict

from batchrun.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}           # chained hash -> block id
        # Blocks with ref count 0, least recently used first; cached ones stay reusable until evicted.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_hits = 0                       # tokens served from the cache, cumulative

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Leading full blocks of the request's tokens already in the cache (verified, not only hashed).

        Capped one token short of the request so the last token's logits are computed. None for a request that
        asks for its prompt's logprobs: those come from computing every prompt token.
        """
        if not self.enable_prefix_caching or request.params.prompt_logprobs:
            return []
        tokens = request.token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hits, parent = [], request.adapter   # KV depends on the adapter: its name roots the chain
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            parent = self.chain_hash(parent, chunk)
            block = self.cached.get(parent)
            if block is None or self.block_tokens[block] != chunk:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the cache hits)."""
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        have = len(request.block_table) + len(computed_blocks)
        need = max(0, self.blocks_needed(num_computed + num_new_tokens) - have)
        hits_now_free = sum(1 for b in computed_blocks if b in self.free)
        if need > self.num_free_blocks - hits_now_free:
            return False
        for block in computed_blocks:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
        request.block_table.extend(computed_blocks)
        self.prefix_hits += len(computed_blocks) * self.block_size
        for _ in range(need):
            request.block_table.append(self._take_free_block())
        return True

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full within its first `num_tokens` tokens in the prefix cache.

        The scheduler registers the blocks a step will fill as it plans the step (as vLLM does), so a request
        admitted later in the same step reads them instead of computing the same prefix again: within each layer
        the forward writes every new K/V before any attention reads the pool. A forward that fails takes them
        back (uncache_unwritten)."""
        if not self.enable_prefix_caching:
            return
        hashes = request.block_hashes
        for i in range(len(hashes), num_tokens // self.block_size):
            chunk = tuple(request.token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(self.chain_hash(hashes[-1] if hashes else request.adapter, chunk))
            block = request.block_table[i]
            # A block identical to one cached already stays private.
            if self.block_hash[block] is None and hashes[-1] not in self.cached:
                self.block_hash[block], self.block_tokens[block] = hashes[-1], chunk
                self.cached[hashes[-1]] = block

    def uncache_unwritten(self, request: Request) -> set[int]:
        """The step that was to compute the request's tokens after its computed ones failed: drop the blocks it
        registered for them from the cache (and their hashes, registered again when computed). Returns them."""
        full = request.num_computed_tokens // self.block_size
        dropped = set()
        for i, h in enumerate(request.block_hashes[full:], start=full):
            block = request.block_table[i]
            if self.cached.get(h) == block:
                del self.cached[h]
                self.block_hash[block] = self.block_tokens[block] = None
                dropped.add(block)
        del request.block_hashes[full:]
        return dropped

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefix of every block no request holds; returns how many. Blocks in use keep theirs."""
        forgotten = 0
        for block in self.free:
            if self.block_hash[block] is not None:
                del self.cached[self.block_hash[block]]
                self.block_hash[block] = self.block_tokens[block] = None
                forgotten += 1
        return forgotten

    def fork(self, parent: Request, child: Request, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give `child` the parent's first `num_tokens` tokens of KV: the full blocks shared (one more reference
        each), the last partial block as a fresh block (copy on write: both will append to it). Returns the
        (source, destination) block copies to make in the KV pool; None when no block is free for the copy (the
        child then gets no blocks and recomputes)."""
        full, partial = divmod(num_tokens, self.block_size)
        if partial and not self.free:
            return None
        shared = parent.block_table[:full]
        for block in shared:
            self.ref_counts[block] += 1
        child.block_table = list(shared)
        if not partial:
            return []
        child.block_table.append(self._take_free_block())
        return [(parent.block_table[full], child.block_table[-1])]

    def _take_free_block(self) -> int:
        block, _ = self.free.popitem(last=False)
        if self.block_hash[block] is not None:   # evict the least recently used cached block
            del self.cached[self.block_hash[block]]
            self.block_hash[block] = self.block_tokens[block] = None
        self.ref_counts[block] = 1
        return block

    def free_request(self, request: Request) -> None:
        # Tail blocks first, so they are evicted before the shared prefix blocks.
        for block in reversed(request.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed twice")
            if self.ref_counts[block] == 0:
                self.free[block] = None
        request.block_table = []

    def check_integrity(self) -> None:
        """Free list and ref counts agree; every cached hash points at a block carrying it."""
        for block, refs in enumerate(self.ref_counts):
            if refs < 0 or (refs == 0) != (block in self.free):
                raise AssertionError(f"block {block}: ref count {refs}, in free list: {block in self.free}")
        for h, block in self.cached.items():
            if self.block_hash[block] != h:
                raise AssertionError(f"cached hash {h} points at block {block} with hash {self.block_hash[block]}")
