"""The engine's KV cache as the data plane sees it: per-block byte segments.

Both engine layouts (see `kvtier.store.layout`) are reduced to a list of uint8
views `[num_blocks, segment_bytes]`; a host buffer of slots is cut the same way, so
one copy routine serves every direction. Copies are batched over runs of
consecutive block ids on both sides: the scheduler hands out consecutive slots
whenever it can, and one strided copy per run and segment costs a few microseconds
instead of one call per block.

With CUDA, copies run on a dedicated stream that first waits on an event recorded
on the compute stream when the job was submitted (so a store never reads a block
before the kernel that writes it has run), and the worker waits on the copy's own
event before reporting the job done. Without CUDA the same code runs on CPU tensors
and the events are skipped.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtier.store.layout import KVLayout
from kvtier.thread_names import name_native_thread


def allocate_kv_caches(
    layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    """Zeroed engine caches in `layout`'s shape (one per layer, or one in all)."""
    shape = cache_shape(layout, num_blocks)
    dtype = getattr(torch, layout.dtype)
    count = layout.num_layers if layout.per_layer else 1
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]


def cache_shape(layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
    """The shape of one engine cache tensor (see `kvtier.store.layout`)."""
    plane = (layout.block_size, layout.num_kv_heads, layout.head_size)
    if layout.per_layer:
        return (2, num_blocks, *plane)
    return (num_blocks, layout.num_layers, 2, *plane)


class DeviceKV:
    """The engine's caches, validated against a layout and cut into block segments."""

    def __init__(self, layout: KVLayout, caches: Sequence[torch.Tensor]) -> None:
        expected = layout.num_layers if layout.per_layer else 1
        if len(caches) != expected:
            raise ValueError(f"layout needs {expected} cache tensor(s), got {len(caches)}")
        self.layout = layout
        self.caches = list(caches)
        self.device = self.caches[0].device
        self.num_blocks = int(self.caches[0].shape[1 if layout.per_layer else 0])
        self.segments = self._segments()
        self.is_cuda = self.device.type == "cuda"
        # numpy views of the segments (CPU only): `Tensor.numpy()` costs microseconds a
        # call, and a copy would otherwise pay it per segment per job.
        self.arrays: list[npt.NDArray[np.uint8]] = (
            [] if self.is_cuda else [seg.numpy() for seg in self.segments]
        )

    def _segments(self) -> list[torch.Tensor]:
        segments: list[torch.Tensor] = []
        for tensor in self.caches:
            self._check(tensor)
            raw = tensor.view(torch.uint8)
            planes = [raw[0], raw[1]] if self.layout.per_layer else [raw]
            segments.extend(p.view(self.num_blocks, self.layout.segment_bytes) for p in planes)
        return segments

    def _check(self, tensor: torch.Tensor) -> None:
        lay = self.layout
        shape = cache_shape(lay, self.num_blocks)
        if tuple(tensor.shape) != shape or str(tensor.dtype) != f"torch.{lay.dtype}":
            raise ValueError(
                f"cache tensor {tuple(tensor.shape)} {tensor.dtype} does not match layout "
                f"shape {shape} dtype {lay.dtype}"
            )
        if not tensor.is_contiguous() or tensor.device != self.device:
            raise ValueError("cache tensors must be contiguous and on one device")

    def block_ids(self, ids: Sequence[int] | npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """`ids` as an int64 array, checked against the number of device blocks."""
        array = np.asarray(ids, dtype=np.int64)
        if array.ndim != 1:
            raise ValueError(f"device block ids must be a flat sequence, got shape {array.shape}")
        if array.size and (int(array.min()) < 0 or int(array.max()) >= self.num_blocks):
            raise ValueError(f"device block ids {array.tolist()} outside [0, {self.num_blocks})")
        return array

    def record_compute(self) -> Any:
        """An event on the current (compute) stream; copies of this job wait on it."""
        if not self.is_cuda:
            return None
        event = cuda_event()
        event.record(current_stream(self.device))
        return event


def limit_torch_threads(n: int) -> None:
    """Let torch ops started from the calling thread use `n` threads; others keep theirs.

    Why: inside a vLLM engine on the CPU, vLLM binds its OpenMP threads one per core,
    and a big torch copy from a kvtier thread starts a second OpenMP team bound to the
    same cores (measured in an engine: a 2-thread load copy ran at 0.65-0.8 of a
    1-thread one, half its time waiting). torch keeps the per-thread count (OpenMP's)
    and also a default for threads started later; vLLM's own stay as they are, and a
    short-lived thread puts that default back.
    """
    torch.get_num_threads()  # torch sets a thread's count on its first call: let it, first
    with _TORCH_THREADS_LOCK:
        default = _in_new_thread(torch.get_num_threads)
        torch._C.set_num_threads(n)  # the builtin: vLLM's CPU worker patches torch.set_num_threads
        _in_new_thread(torch._C.set_num_threads, default)


# Held while the default is lowered: two threads limiting at once (a handler's copy
# helpers start together) each read the other's lowered default and put it back, and
# every thread started after got one torch thread. The default is read from a new
# thread, since a thread takes the default of the moment of its first torch call.
_TORCH_THREADS_LOCK = threading.Lock()


def _in_new_thread(fn: Any, *args: Any) -> Any:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    thread.join()
    return out[0]


def float_copy_thread() -> None:
    """Start of a copy helper thread: torch on this thread only, any core the process may
    use (a thread started by one that vLLM bound to a core would stay on that core)."""
    name_native_thread("kv-copy")
    limit_torch_threads(1)
    if hasattr(os, "sched_setaffinity"):  # Linux; the kernel keeps only allowed cores
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, range(os.cpu_count() or 1))


def leave_compute_cores() -> bool:
    """Move the calling thread off the cores vLLM's CPU workers compute on, onto the
    rest of the process's cores, where there are any; whether it moved.

    vLLM's CPU build binds each worker's OpenMP threads to cores of their own and keeps
    the others (at least one per worker) for its scheduler process and, with a
    `kv_transfer_config`, for the connector's threads. A kvtier thread started by a
    bound worker thread inherits its core: every store's copy then ran on the core the
    model computes on, and an engine that stored everything served 5-6% fewer requests a
    second than vLLM alone on a no-reuse workload at saturation (bench_serving, the
    8-layer model). The cores of every worker's binding (`VLLM_CPU_OMP_THREADS_BIND`,
    where it names them) are left too: another worker's core would only move the cost.
    Nothing moves where the thread may run anywhere (a GPU worker, an unbound one)."""
    if not hasattr(os, "sched_getaffinity"):
        return False
    try:
        bound = os.sched_getaffinity(0)
        computing = set(bound) | _bound_cores(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""))
        rest = set(range(os.cpu_count() or 1)) - computing
        if not rest or len(bound) == (os.cpu_count() or 1):
            return False
        os.sched_setaffinity(0, rest)
    except (OSError, ValueError):  # a cpuset without those cores: stay where it is
        return False
    return True


def _bound_cores(binding: str) -> set[int]:
    """The cores named by vLLM's `VLLM_CPU_OMP_THREADS_BIND` ("0-3|4-7", "0,2|1,3");
    none for "auto", "nobind" or text it would refuse."""
    cores: set[int] = set()
    for rank in binding.split("|"):
        for part in rank.split(","):
            first, _, last = part.strip().partition("-")
            if not first.isdigit() or (last and not last.isdigit()):
                return set()
            cores.update(range(int(first), int(last or first) + 1))
    return cores


def cuda_event() -> Any:
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


def cuda_stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


def current_stream(device: torch.device) -> Any:
    """The stream the engine computes on (the calling thread's current one)."""
    return torch.cuda.current_stream(device)


def on_stream(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Make `stream` current for the copies issued inside (CUDA only)."""
    return torch.cuda.stream(stream)


def _continues(
    src_ids: npt.NDArray[np.int64], dst_ids: npt.NDArray[np.int64]
) -> npt.NDArray[np.bool_]:
    """For each pair after the first: whether it continues the run before it, both sides."""
    continues: npt.NDArray[np.bool_] = (np.diff(src_ids) == 1) & (np.diff(dst_ids) == 1)
    return continues


def count_runs(src_ids: npt.NDArray[np.int64], dst_ids: npt.NDArray[np.int64]) -> int:
    """How many runs `coalesce_runs` would cut, without building them."""
    if src_ids.size == 0:
        return 0
    return int(src_ids.size - np.count_nonzero(_continues(src_ids, dst_ids)))


def coalesce_runs(
    src_ids: npt.NDArray[np.int64], dst_ids: npt.NDArray[np.int64]
) -> list[tuple[int, int, int]]:
    """Split paired ids into maximal runs consecutive on both sides: (src, dst, length)."""
    if src_ids.size == 0:
        return []
    starts = np.flatnonzero(~_continues(src_ids, dst_ids)) + 1
    bounds = [0, *starts.tolist(), int(src_ids.size)]
    return [(int(src_ids[a]), int(dst_ids[a]), b - a) for a, b in itertools.pairwise(bounds)]


def copy_blocks(
    src: Sequence[torch.Tensor],
    src_ids: npt.NDArray[np.int64],
    dst: Sequence[torch.Tensor],
    dst_ids: npt.NDArray[np.int64],
    *,
    src_arrays: Sequence[npt.NDArray[np.uint8]] | None = None,
    dst_arrays: Sequence[npt.NDArray[np.uint8]] | None = None,
    stacks: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> int:
    """Copy blocks segment by segment (asynchronously when a side is on CUDA); bytes moved.

    On CUDA: one strided copy per run of ids consecutive on both sides. On CPU the
    pairs are cut at whichever side has fewer runs: a run of consecutive destination
    ids is one gather into it (torch `index_select`, which reads only the rows it
    takes; numpy for small pieces), a run of consecutive source ids one numpy scatter
    from it; both loop over blocks in C, not in Python (torch's scatter kernels copy
    element by element at a fifth of memcpy speed). Which library copies what: see
    `TORCH_COPY_BYTES`.
    `src_arrays`/`dst_arrays`: the segments' numpy views, when the caller keeps them;
    `stacks`: `stack_planes(src, dst)`, likewise (runs then copy a stack per call).
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destinations")
    moved = len(src_ids) * sum(int(seg.shape[1]) for seg in src)
    if len(src_ids) == 0:
        return moved
    if src[0].is_cuda or dst[0].is_cuda:
        for s, d, n in coalesce_runs(src_ids, dst_ids):
            for src_seg, dst_seg in zip(src, dst, strict=True):
                dst_seg[d : d + n].copy_(src_seg[s : s + n], non_blocking=True)
        return moved
    src_np = [seg.numpy() for seg in src] if src_arrays is None else src_arrays
    dst_np = [seg.numpy() for seg in dst] if dst_arrays is None else dst_arrays
    sides = _Sides(src, src_np, dst, dst_np, stacks)
    if _is_range(src_ids) and _is_range(dst_ids):  # the common case: a few calls only
        sides.run(int(src_ids[0]), int(dst_ids[0]), len(src_ids))
        return moved
    by_dst, dst_runs = _sorted_runs(dst_ids)
    by_src, src_runs = _sorted_runs(src_ids)
    # as many runs either way (a reversed run): into strided planes (vLLM's pages cut in
    # halves) numpy's scatter writes faster than a gather (8.7 against 7.4 GB/s, one thread)
    if len(dst_runs) < len(src_runs) or (len(dst_runs) == len(src_runs) and sides.dst_contiguous):
        _gather(sides, src_ids[by_dst], dst_ids[by_dst], dst_runs)
    else:
        _scatter(sides, src_ids[by_src], dst_ids[by_src], src_runs)
    return moved


# From this many bytes per copy call on, torch beats numpy: its vectorised copy loop is
# 5-10% faster than numpy's memmove on contiguous runs, which outweighs its higher cost
# per call (3-7 us against 1-2 us); and its `index_select` reads only the rows it
# gathers, where numpy's `take` first copies a strided source plane whole (vLLM's CPU
# pages cut into K and V halves: 85 of 300 rows of 16 KiB, one thread, 9.7 GB/s
# against 3.2; into strided halves 7.4 against 5.7; 1.2-1.5x numpy's fancy indexing).
# That is what bench_vllm's CPU load rate measures. A scatter has no fast torch kernel
# (`index_copy_` copies element by element), so only rows of 1 MiB and more go one
# torch copy each.
TORCH_COPY_BYTES = 256 << 10
TORCH_ROW_BYTES = 1 << 20


def stack_planes(
    src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Runs of consecutive segments that lie at one constant stride inside one allocation
    on both sides (a layer's K and V planes; all planes of a `MemoryStore`), each as a
    pair of `[planes, rows, bytes]` views: one torch copy then moves a run of blocks in
    all of them (a torch call costs 3-7 us, and per-layer layouts have 16-64 segments)."""
    stacks, start = [], 0
    for end in range(1, len(src) + 1):
        if end < len(src) and _joins(src, start, end) and _joins(dst, start, end):
            continue
        stacks.append((_stack(src[start:end]), _stack(dst[start:end])))
        start = end
    return stacks


def _joins(planes: Sequence[torch.Tensor], start: int, end: int) -> bool:
    """May `planes[end]` extend the stack `planes[start:end]`?"""
    first, last, new = planes[start], planes[end - 1], planes[end]
    step = new.data_ptr() - last.data_ptr()
    extent = new.shape[0] * new.stride(0)
    return (
        new.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and new.shape == first.shape
        and new.stride() == first.stride()
        and step >= extent
        and (end == start + 1 or step == planes[start + 1].data_ptr() - first.data_ptr())
    )


def _stack(planes: Sequence[torch.Tensor]) -> torch.Tensor:
    first = planes[0]
    step = planes[1].data_ptr() - first.data_ptr() if len(planes) > 1 else 0
    return first.as_strided((len(planes), *first.shape), (step, *first.stride()))


class _Sides:
    """Both sides of a CPU copy, as tensors and as numpy views of the same segments."""

    def __init__(
        self,
        src: Sequence[torch.Tensor],
        src_np: Sequence[npt.NDArray[np.uint8]],
        dst: Sequence[torch.Tensor],
        dst_np: Sequence[npt.NDArray[np.uint8]],
        stacks: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> None:
        self.src, self.src_np, self.dst, self.dst_np = src, src_np, dst, dst_np
        self.stacks = stacks
        self.limit = len(src_np[0])
        row = int(src_np[0].shape[1])
        self.row = row
        self.src_contiguous = all(a.flags.c_contiguous for a in src_np)
        self.dst_contiguous = all(a.flags.c_contiguous for a in dst_np)
        self.big_rows = row >= TORCH_ROW_BYTES

    def run(self, s: int, d: int, n: int) -> None:
        """Blocks s..s+n-1 to d..d+n-1: one copy per segment (or per stack of them)."""
        if n * int(self.src_np[0].shape[1]) < TORCH_COPY_BYTES:
            for src_array, dst_array in zip(self.src_np, self.dst_np, strict=True):
                np.copyto(dst_array[d : d + n], src_array[s : s + n])
        elif self.stacks is None:
            for src_seg, dst_seg in zip(self.src, self.dst, strict=True):
                dst_seg[d : d + n].copy_(src_seg[s : s + n])
        else:
            for src_stack, dst_stack in self.stacks:
                dst_stack[:, d : d + n].copy_(src_stack[:, s : s + n])

    def rows(self, src_ids: list[int], dst_ids: list[int]) -> None:
        """Big rows one by one (torch copies; see `TORCH_ROW_BYTES`), for scatters."""
        for s, d in zip(src_ids, dst_ids, strict=True):
            for src_seg, dst_seg in zip(self.src, self.dst, strict=True):
                dst_seg[d].copy_(src_seg[s])


def _is_range(ids: npt.NDArray[np.int64]) -> bool:
    """Are `ids` consecutive and increasing? (Python lists: cheaper than numpy at job sizes.)"""
    first = int(ids[0])
    return bool(ids.tolist() == list(range(first, first + len(ids))))


def _sorted_runs(ids: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], list[tuple[int, int]]]:
    """The order sorting `ids`, and the [start, end) runs of consecutive sorted ids."""
    order = np.argsort(ids, kind="stable")
    breaks = np.flatnonzero(np.diff(ids[order]) != 1) + 1
    bounds = [0, *breaks.tolist(), len(ids)]
    return order, list(itertools.pairwise(bounds))


def _gather(
    sides: _Sides,
    src_ids: npt.NDArray[np.int64],
    dst_ids: npt.NDArray[np.int64],
    runs: list[tuple[int, int]],
) -> None:
    """Each run of consecutive `dst_ids` is filled by one gather per segment."""
    for a, b in runs:
        d, chunk = int(dst_ids[a]), src_ids[a:b]
        s = int(chunk[0])
        if int(chunk[-1]) - s == b - a - 1 and bool((np.diff(chunk) == 1).all()):
            sides.run(s, d, b - a)
            continue
        if int(chunk.min()) < 0 or int(chunk.max()) >= sides.limit:  # `take` would clip
            raise IndexError(f"source block ids {chunk.tolist()} outside [0, {sides.limit})")
        if (b - a) * sides.row >= TORCH_COPY_BYTES:
            index = torch.from_numpy(np.ascontiguousarray(chunk))
            for src_seg, dst_seg in zip(sides.src, sides.dst, strict=True):
                torch.index_select(src_seg, 0, index, out=dst_seg[d : d + b - a])
            continue
        for src_array, dst_array in zip(sides.src_np, sides.dst_np, strict=True):
            if sides.src_contiguous:
                # mode="clip": no bounds pass and, unlike the default, no buffered copy of out
                np.take(src_array, chunk, axis=0, out=dst_array[d : d + b - a], mode="clip")
            else:  # `take` would first copy the whole strided plane
                dst_array[d : d + b - a] = src_array[chunk]


def _scatter(
    sides: _Sides,
    src_ids: npt.NDArray[np.int64],
    dst_ids: npt.NDArray[np.int64],
    runs: list[tuple[int, int]],
) -> None:
    """Each run of consecutive `src_ids` is spread by one numpy scatter per segment."""
    for a, b in runs:
        s, targets = int(src_ids[a]), dst_ids[a:b]
        if sides.big_rows:
            sides.rows(list(range(s, s + b - a)), targets.tolist())
            continue
        for src_array, dst_array in zip(sides.src_np, sides.dst_np, strict=True):
            dst_array[targets] = src_array[s : s + b - a]
