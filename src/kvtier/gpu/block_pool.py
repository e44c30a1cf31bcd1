"""The block pool: every block, the free queue, the prefix-cache index and its events."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import cast

from kvtier.gpu.block import KVCacheBlock
from kvtier.gpu.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvtier.gpu.free_queue import FreeKVCacheBlockQueue
from kvtier.types import BlockHash

EvictionHook = Callable[[BlockHash], None]
NULL_BLOCK_REF_CNT = 1 << 62


class BlockPool:
    """Owns `num_gpu_blocks` blocks; hands them out, takes them back, caches full ones.

    A cached block stays in the hash index while it sits in the free queue, so a later
    request can revive it; it leaves the index only when the free queue hands its
    memory to someone else ("evicted", one `BlockRemoved` each). Identical blocks are
    not de-duplicated (block tables only ever grow by appending), so one hash may name
    several blocks; a lookup returns the earliest cached one.

    With `with_null_block`, block 0 is taken out at start as the placeholder that
    sliding-window block tables hold for blocks they no longer need (as vLLM does). Its
    reference count starts huge, so taking and dropping references on it never brings
    it to 0: the hot loops need no special case for it. It is never cached.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        *,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        with_null_block: bool = False,
        on_evict: EvictionHook | None = None,
    ) -> None:
        minimum = 2 if with_null_block else 1
        if isinstance(num_gpu_blocks, bool) or not isinstance(num_gpu_blocks, int):
            raise ValueError(f"num_gpu_blocks must be an int, got {num_gpu_blocks!r}")
        if num_gpu_blocks < minimum:
            raise ValueError(f"num_gpu_blocks must be >= {minimum}, got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.on_evict = on_evict
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block: KVCacheBlock | None = None
        if with_null_block:
            self.null_block = self.free_block_queue.popleft()
            self.null_block.is_null = True
            self.null_block.ref_cnt = NULL_BLOCK_REF_CNT
        # hash -> the block, or {block_id: block} in caching order when duplicated.
        self._cached: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        # How many hashes name several blocks (usually none: then a hash's entry is the
        # block that holds it, and an eviction needs no check).
        self._num_duplicated = 0
        self._events: list[KVCacheEvent] = []
        # Cached blocks evicted so far (their hash dropped to reuse their memory): what
        # a caller that needs no hashes counts, without a hook call per block.
        self.num_evicted = 0

    # --- the prefix-cache index -------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The earliest cached block with this hash, or None."""
        entry = self._cached.get(block_hash)
        if entry is None or type(entry) is KVCacheBlock:
            return entry
        assert isinstance(entry, dict)
        return next(iter(entry.values()))

    def find_longest_prefix(
        self, block_hashes: Sequence[BlockHash], max_num_blocks: int
    ) -> list[KVCacheBlock]:
        """The cached blocks of the first `max_num_blocks` hashes, up to the first miss."""
        get = self._cached.get
        blocks: list[KVCacheBlock] = []
        append = blocks.append
        for i in range(max_num_blocks):
            entry = get(block_hashes[i])
            if entry is None:
                break
            if type(entry) is dict:
                entry = next(iter(entry.values()))
            # a block now (no `cast`: a call per block)
            append(entry)  # type: ignore[arg-type]
        return blocks

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    def contains_many(self, block_hashes: Iterable[BlockHash]) -> list[bool]:
        """`h in pool` for each hash, in one C-level pass (a replay asks it per block)."""
        return list(map(self._cached.__contains__, block_hashes))

    @property
    def num_cached_hashes(self) -> int:
        """Distinct hashes in the index."""
        return len(self._cached)

    def cached_items(self) -> list[tuple[BlockHash, list[KVCacheBlock]]]:
        """Every (hash, blocks) pair of the index (inspection and tests; O(n))."""
        return [
            (h, [e] if isinstance(e, KVCacheBlock) else list(e.values()))
            for h, e in self._cached.items()
        ]

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached: int,
        num_full: int,
        block_size: int,
        token_ids: Sequence[int] | None,
        lora_name: str | None,
    ) -> None:
        """Register `blocks[num_cached:num_full]` under `block_hashes[num_cached:num_full]`."""
        # Never a null block in this range: blocks leave a sliding window only after
        # they were full, hence cached (or never hashable at all).
        setdefault = self._cached.setdefault
        for i in range(num_cached, num_full):
            block = blocks[i]
            block_hash = block_hashes[i]
            block.block_hash = block_hash
            entry = setdefault(block_hash, block)
            if entry is not block:
                self._add_duplicate(block_hash, entry, block)
        if self.enable_kv_cache_events:
            tokens = (
                ()
                if token_ids is None
                else token_ids[num_cached * block_size : num_full * block_size]
            )
            self._events.append(
                BlockStored(
                    block_hashes=tuple(block_hashes[num_cached:num_full]),
                    parent_block_hash=block_hashes[num_cached - 1] if num_cached else None,
                    token_ids=tuple(tokens),
                    block_size=block_size,
                    lora_name=lora_name,
                )
            )

    def _add_duplicate(
        self,
        block_hash: BlockHash,
        entry: KVCacheBlock | dict[int, KVCacheBlock],
        block: KVCacheBlock,
    ) -> None:
        if type(entry) is dict:
            entry[block.block_id] = block
        else:
            first = cast(KVCacheBlock, entry)
            self._cached[block_hash] = {first.block_id: first, block.block_id: block}
            self._num_duplicated += 1

    def _restore_duplicates(
        self, block: KVCacheBlock, block_hash: BlockHash, duplicates: dict[int, KVCacheBlock]
    ) -> None:
        """An evicted copy of a duplicated hash: the other copies stay cached."""
        del duplicates[block.block_id]
        first = next(iter(duplicates.values()))
        self._cached[block_hash] = duplicates if len(duplicates) > 1 else first
        if len(duplicates) == 1:
            self._num_duplicated -= 1

    # --- allocation -------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (reference count > 0), the null block included."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_gpu_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the free-queue head, evicting their cached hashes; ref count 1.

        Each eviction restores the other copies of a duplicated hash, records a
        `BlockRemoved` (events on), then calls the hook, in that order, block by block.
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)
        hook = self.on_evict
        if not self._num_duplicated and not self.enable_kv_cache_events:
            # The usual case: each cached hash names its block, and there are no events.
            # The leanest loop (a `del`, no call but the hook's): this runs for every block.
            cached = self._cached
            num_cached = len(cached)
            for block in blocks:
                block_hash = block.block_hash
                if block_hash is not None:
                    block.block_hash = None
                    del cached[block_hash]
                    if hook is not None:
                        hook(block_hash)
                block.ref_cnt = 1
            self.num_evicted += num_cached - len(cached)  # one key per eviction here
            return blocks
        pop = self._cached.pop
        events = self._events if self.enable_kv_cache_events else None
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:  # evict it from the prefix cache
                self.num_evicted += 1
                block.block_hash = None
                entry = pop(block_hash)
                if entry is not block:
                    self._restore_duplicates(
                        block, block_hash, cast(dict[int, KVCacheBlock], entry)
                    )
                if events is not None:
                    events.append(BlockRemoved(block_hashes=(block_hash,)))
                if hook is not None:
                    hook(block_hash)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving those sitting in the free queue.

        A block listed twice (a request whose hashes repeat) leaves the queue once: it is
        revived by its first reference only, as in vLLM.
        """
        revived: list[KVCacheBlock] = []
        for block in blocks:
            if block.ref_cnt == 0:
                revived.append(block)
            block.ref_cnt += 1
        self.free_block_queue.remove_all(revived)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the tail in the given order."""
        self.free_block_queue.release_n(ordered_blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        num_reserved = 0 if self.null_block is None else 1
        if self.num_gpu_blocks - self.get_num_free_blocks() > num_reserved:
            return False
        self._cached.clear()
        self._num_duplicated = 0
        for block in self.blocks:
            block.block_hash = None
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, in order (and forget them)."""
        events, self._events = self._events, []
        return events
