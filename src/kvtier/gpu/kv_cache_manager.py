"""The request-level KV cache manager with prefix caching (vLLM v1's seed interface).

The scheduler loop per request:
1. `get_computed_blocks(request)` -> the cached prefix and how many tokens it covers;
2. `allocate_slots(request, num_new_tokens, computed_blocks)` for its first step;
3. `append_slots(request, num_tokens)` for every later step (decode or prefill chunk);
4. `free(request)` when it finishes, or `preempt(request)` to make room.

The scheduler owns `request.num_computed_tokens`, as in vLLM: the manager reads it
(the tokens already in the request's blocks) and never writes it, except `preempt`,
which plays the scheduler's part of starting the request over. So after a successful
`allocate_slots(request, n, computed_blocks)` the caller sets it to
`len(computed_blocks) * block_size + n` (plus what it held before), and after
`append_slots(request, n)` advances it by `n`. Decisions follow docs/semantics.md
section 2; a rejected call raises (bad input) or returns None (no room) and leaves
every block as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.gpu.block import KVCacheBlock
from kvtier.gpu.block_pool import BlockPool, EvictionHook
from kvtier.gpu.events import KVCacheEvent
from kvtier.gpu.prefix_cache_stats import PrefixCacheStats
from kvtier.gpu.sliding_window import (
    find_sliding_window_hit,
    num_window_blocks,
    skipped_block_indices,
)
from kvtier.hashing import HashAlgorithm, digest_function
from kvtier.request import Request
from kvtier.types import BlockHash
from kvtier.validate import positive_int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Prefix-caching block manager for one attention type (full or sliding window)."""

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        max_model_len: int,
        sliding_window: int | None = None,
        enable_caching: bool = True,
        num_preallocate_tokens: int = 64,
        *,
        hash_algorithm: HashAlgorithm = "sha256_cbor",
        enable_kv_cache_events: bool = False,
        log_stats: bool = True,
        on_evict: EvictionHook | None = None,
    ) -> None:
        """`on_evict(hash)` is called for every cached block the pool evicts (cheaper
        than draining events); `num_preallocate_tokens` extra slots are reserved per
        allocation so decode needs fewer calls that allocate."""
        self.block_size = positive_int("block_size", block_size)
        self.max_model_len = positive_int("max_model_len", max_model_len)
        if sliding_window is not None:
            positive_int("sliding_window", sliding_window)
        self.sliding_window = sliding_window
        positive_int("num_preallocate_tokens", num_preallocate_tokens, minimum=0)
        self.num_preallocate_tokens = num_preallocate_tokens
        self.num_preallocate_blocks = _cdiv(num_preallocate_tokens, block_size)
        self.max_num_blocks_per_req = _cdiv(max_model_len, block_size)
        digest_function(hash_algorithm)
        self.hash_algorithm: HashAlgorithm = hash_algorithm
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.block_pool = BlockPool(
            num_gpu_blocks,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            with_null_block=sliding_window is not None,
            on_evict=on_evict,
        )
        self.num_gpu_blocks = num_gpu_blocks
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # --- lookup ---------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request and the tokens it covers.

        Capped to `num_tokens - 1` tokens (whole blocks): the last token is always
        computed, because the engine needs its logits. Changes nothing but statistics.
        """
        if not self.enable_caching:
            return [], 0
        block_size = self.block_size
        hashes = request.get_block_hashes(block_size, self.hash_algorithm)
        max_num_blocks = min(len(hashes), (request.num_tokens - 1) // block_size)
        if self.sliding_window is None:
            blocks = self.block_pool.find_longest_prefix(hashes, max_num_blocks)
        else:
            assert self.block_pool.null_block is not None
            blocks = find_sliding_window_hit(
                self.block_pool.get_cached_block,
                hashes,
                max_num_blocks,
                num_window_blocks(self.sliding_window, block_size),
                self.block_pool.null_block,
            )
        num_hit_tokens = len(blocks) * block_size
        if self.log_stats:
            self.prefix_cache_stats.record(
                request.num_tokens,
                len(hashes),
                len(blocks),
                num_hit_tokens,
                request.num_preemptions,
            )
        return blocks, num_hit_tokens

    # --- allocation -----------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        computed_blocks: Sequence[KVCacheBlock] | None = None,
        *,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Give a new request its cached prefix plus new blocks for `num_tokens` tokens.

        Returns the NEW blocks (preallocation included), or None when the pool cannot
        hold the request right now (nothing changed). A cached block sitting in the free
        queue counts as free, except the ones this request is about to reuse.
        `delay_cache_blocks` (vLLM's flag for asynchronous loads): the new full blocks
        are not registered in the prefix cache until `cache_blocks`, so no other
        request can hit a block whose bytes have not arrived yet.
        """
        if type(num_tokens) is not int or num_tokens < 1:  # (checked inline: the hot path)
            positive_int("num_tokens", num_tokens)
        request_id = request.request_id
        if request_id in self._req_blocks:
            raise ValueError(f"request {request_id!r} already has blocks; use append_slots")
        if delay_cache_blocks and self.sliding_window is not None:
            raise ValueError(
                "delay_cache_blocks is not supported with a sliding window (a block may "
                "leave the window before it is cached)"
            )
        blocks = list(computed_blocks) if computed_blocks else []
        num_computed = len(blocks)
        num_computed_tokens = (
            request.num_computed_tokens + num_computed * self.block_size + num_tokens
        )
        self._check_length(request, num_computed_tokens)
        num_reused_free = self._check_computed_blocks(request, blocks)
        pool = self.block_pool
        free_queue = pool.free_block_queue
        num_required = -(-num_computed_tokens // self.block_size) - num_computed
        if num_required > free_queue.num_free_blocks - num_reused_free:
            return None
        if num_computed:
            pool.touch(blocks)
        num_new = min(
            num_required + self.num_preallocate_blocks,
            free_queue.num_free_blocks,
            self.max_num_blocks_per_req - num_computed,
        )
        new_blocks = pool.get_new_blocks(num_new)
        blocks += new_blocks
        self._req_blocks[request_id] = blocks
        self._num_cached_blocks[request_id] = num_computed
        if not delay_cache_blocks:
            self._cache_full_blocks(request, blocks, num_computed_tokens // self.block_size)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks up to `num_computed_tokens` tokens.

        For blocks allocated with `delay_cache_blocks`: called once their bytes are in
        place (vLLM's `cache_blocks`). Blocks already registered stay as they are.
        The count may not pass the tokens the request has slots for.
        """
        blocks = self._blocks_of(request.request_id)
        positive_int("num_computed_tokens", num_computed_tokens, minimum=0)
        limit = min(len(blocks) * self.block_size, request.num_tokens)
        if num_computed_tokens > limit:
            raise ValueError(
                f"request {request.request_id!r} has slots for {limit} tokens; "
                f"cache_blocks asked for {num_computed_tokens}"
            )
        self._cache_full_blocks(request, blocks, num_computed_tokens // self.block_size)

    def append_slots(self, request: Request, num_tokens: int) -> list[KVCacheBlock] | None:
        """Slots for `num_tokens` more tokens of a running request (decode or a chunk).

        Returns the new blocks (empty when the current ones have room), or None when the
        pool cannot hold them (nothing changed). With a sliding window, blocks that fell
        out of the window are released first. `num_tokens=0` is accepted, as in vLLM's
        seed (a scheduler step that schedules no token for the request): no new block.
        """
        positive_int("num_tokens", num_tokens, minimum=0)
        blocks = self._blocks_of(request.request_id)
        num_computed_tokens = request.num_computed_tokens + num_tokens
        self._check_length(request, num_computed_tokens)
        pool = self.block_pool
        skipped = self._skipped(request, blocks)
        num_released = sum(1 for i in skipped if blocks[i].ref_cnt == 1)
        num_required = _cdiv(num_computed_tokens, self.block_size) - len(blocks)
        if num_required > pool.get_num_free_blocks() + num_released:
            return None
        if skipped:
            assert pool.null_block is not None
            pool.free_blocks([blocks[i] for i in skipped])
            for i in skipped:
                blocks[i] = pool.null_block
        new_blocks: list[KVCacheBlock] = []
        if num_required > 0:
            num_new = min(
                num_required + self.num_preallocate_blocks,
                pool.get_num_free_blocks(),
                self.max_num_blocks_per_req - len(blocks),
            )
            new_blocks = pool.get_new_blocks(num_new)
            blocks.extend(new_blocks)
        self._cache_full_blocks(request, blocks, num_computed_tokens // self.block_size)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release a finished request's blocks, tail first (its end is evicted first).

        As in vLLM's seed: a request that holds no blocks (aborted while waiting,
        or freed already) is nothing to do, and with caching disabled the blocks go
        back in table order (no cached tail to keep longer).
        """
        blocks = self._req_blocks.pop(request.request_id, None)
        if blocks is None:
            return
        del self._num_cached_blocks[request.request_id]
        self.block_pool.free_blocks(reversed(blocks) if self.enable_caching else blocks)

    def preempt(self, request: Request) -> None:
        """Free a running request to make room; it keeps its hashes and starts over.

        Unlike `free`, a request without blocks is refused (KeyError): preempting a
        request that is not running is a scheduler bug, and this call would count it.
        """
        self._blocks_of(request.request_id)
        self.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    # --- inspection -----------------------------------------------------------------

    def get_num_common_prefix_blocks(self, request: Request, num_running_requests: int) -> int:
        """Leading blocks of this request shared by all running requests (cascade
        attention); always 0 with a sliding window, whose tables hold placeholders."""
        blocks = self._blocks_of(request.request_id)
        if self.sliding_window is not None:
            return 0
        count = 0
        for block in blocks:
            if block.ref_cnt != num_running_requests:
                break
            count += 1
        return count

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block table (a copy)."""
        return list(self._blocks_of(request_id))

    def get_block_ids(self, request_id: str) -> list[int]:
        # (a comprehension: `map` of an attrgetter costs twice as much per block)
        return [block.block_id for block in self._blocks_of(request_id)]

    def get_num_cached_blocks(self, request_id: str) -> int:
        """How many of the request's leading blocks are registered in the prefix cache."""
        self._blocks_of(request_id)
        return self._num_cached_blocks[request_id]

    def has_request(self, request_id: str) -> bool:
        return request_id in self._req_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def is_cached(self, block_hash: BlockHash) -> bool:
        """Whether some block in the pool holds this hash (in use or evictable)."""
        return block_hash in self.block_pool

    def are_cached(self, block_hashes: Iterable[BlockHash]) -> list[bool]:
        """`is_cached` of each hash, in one call."""
        return self.block_pool.contains_many(block_hashes)

    def take_events(self) -> list[KVCacheEvent]:
        """Stored / removed / cleared events since the last call, in order."""
        return self.block_pool.take_events()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The statistics since the last call (and start counting afresh)."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # --- internals ------------------------------------------------------------------

    def _blocks_of(self, request_id: str) -> list[KVCacheBlock]:
        blocks = self._req_blocks.get(request_id)
        if blocks is None:
            raise KeyError(
                f"request {request_id!r} holds no blocks (never allocated, or already freed)"
            )
        return blocks

    def _check_length(self, request: Request, num_computed_tokens: int) -> None:
        num_tokens = request.num_tokens
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        if num_computed_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} would reach {num_computed_tokens} tokens, "
                f"more than max_model_len={self.max_model_len}"
            )
        if num_computed_tokens > num_tokens:
            raise ValueError(
                f"request {request.request_id!r} has {num_tokens} tokens; slots for "
                f"{num_computed_tokens} asked (append its tokens first)"
            )

    def _check_computed_blocks(self, request: Request, computed: list[KVCacheBlock]) -> int:
        """Refuse blocks that do not (or no longer) hold this request's prefix.

        Returns how many of them sit in the free queue (they are not free for this
        request: it is about to take them).
        """
        if not computed:
            return 0
        if not self.enable_caching:
            raise ValueError("computed_blocks given, but prefix caching is disabled")
        hashes = request.get_block_hashes(self.block_size, self.hash_algorithm)
        if len(computed) > len(hashes):
            raise ValueError(
                f"{len(computed)} computed blocks for request {request.request_id!r}, "
                f"which has only {len(hashes)} full-block hashes"
            )
        num_in_free_queue = 0
        for block, block_hash in zip(computed, hashes, strict=False):
            if block.block_hash != block_hash and not block.is_null:
                raise ValueError(
                    f"computed block {block.block_id} does not hold request "
                    f"{request.request_id!r}'s prefix (evicted since get_computed_blocks?)"
                )
            if block.ref_cnt == 0:  # never true of the null block
                num_in_free_queue += 1
        return num_in_free_queue

    def _skipped(self, request: Request, blocks: list[KVCacheBlock]) -> list[int]:
        if self.sliding_window is None:
            return []
        return skipped_block_indices(
            blocks, request.num_computed_tokens, self.sliding_window, self.block_size
        )

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_full: int
    ) -> None:
        """Register the first `num_full` blocks (those with a hash) in the prefix cache."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_cached = self._num_cached_blocks[request_id]
        if num_full <= num_cached:
            return
        hashes = request.get_block_hashes(self.block_size, self.hash_algorithm)
        num_full = min(num_full, len(hashes))
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            blocks,
            hashes,
            num_cached,
            num_full,
            self.block_size,
            request.all_token_ids if request.has_token_ids else None,
            request.lora_name,
        )
        self._num_cached_blocks[request_id] = num_full
