"""Device blocks <-> pinned host memory on a GPU: one kernel per job, over the link.

A block of a per-layer engine is `2 x layers` segments in separate device tensors, so
copying segment by segment issues one DMA per segment and run of ids consecutive on
both sides, `run x segment` bytes long: 1 MiB for 32 blocks of an 8B model, and a
single segment (32 KiB) for blocks the engine scattered over its pool. On an H200 such
DMAs ran at 0.82-0.86 of the link for runs of 32 blocks (`benchmarks/bench_copy.py`).
Gathering into a device buffer first and sending it in one DMA costs a kernel and a
copy in series (0.75-0.83, measured). Here one Triton kernel reads every segment of
every block of the job from the engine's tensors and writes it straight into the host
memory, which is pinned and so mapped into the GPU's address space (a load: the
reverse), as LMCache's zero-copy kernels do: 0.91-0.95 of a raw pinned `copy_` of the
same bytes from 32 scattered blocks on (H200, both directions). The kernel takes each
device segment's base address and row stride from a small table, and the host side's
address and strides from the job's parameters, so layers in separate allocations,
vLLM's pages (K and V halves, strided), the cross-layer layout, the CPU tier's
segment-major planes and slot-major staging rows are one code path.

Per job, what is not moving bytes is time the link idles: the handler copies one job at
a time and waits for it. Triton's launch from Python cost 50-160 us of the host's time
on the H200 machine here, and copying the job's ids to the device a small DMA before
the kernel. So a job's parameters (its ids, the host address) go into pinned memory the
kernel reads over the link, and each thread's first job of a direction and size bucket
(a power of two; padding pairs move nothing) is captured as a CUDA graph that later
jobs replay. Measured side by side (same machine, same run, 32 blocks of an 8B model,
kvtier's handler over a raw pinned `copy_`, device -> host | host -> device): per-layer
scattered 0.81 | 0.80 before, 0.85 | 0.84 with the parameters in pinned memory alone,
0.90 | 0.87 with graphs too; vLLM's pages 0.80 | 0.80 -> 0.88 | 0.87.

What it costs: the kernel runs on the GPU's cores (a few per copy, memory-bound) where
a DMA uses the copy engines only; so the handler keeps per-segment DMAs where the runs
are long enough for them to reach the link's rate (`prefer_kernel`). Triton comes with
torch's CUDA builds; without it, or for segments not 8-byte aligned or host memory not
pinned, the handlers copy with torch as before. Everything runs on the caller's
current stream (a handler's copy stream), so the events that order copies after the
engine's kernels (`handlers.Streams`) hold.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvtier.transfer.device import DeviceKV, count_runs

log = logging.getLogger(__name__)

_WORD = 8  # the kernel moves int64 words
# A job's parameters in pinned memory, which the kernel reads over the link: the host
# side's base address, block stride and segment stride (words), one spare, then the
# (device id, host id) pairs, padded with -1 up to the job's bucket.
_HEADER = 4
_MAX_BLOCK_WORDS = 4096  # words per kernel program: 32 KiB, a segment of 16 tokens x 1 KiB

# The choice between the kernel and per-segment DMAs (`prefer_kernel`), from
# bench_copy on an H200 (PCIe 5): a DMA costs about 4.7 us beyond its bytes; the kernel
# moves bytes at about 0.93 of the link's rate, plus about 40 us a job launched from a
# CUDA graph (70 with Triton's plain launch; 17-75 us, 32-block jobs of four layouts).
DMA_COST_US = 4.7
KERNEL_RATE = 0.93
KERNEL_COST_US = 40.0
LINK_BYTES_PER_US = 50_000.0


class HostSide(NamedTuple):
    """Pinned host memory as blocks: block `i`'s segment `k` starts at byte
    `i * block_stride + k * segment_stride` of `tensor`."""

    tensor: torch.Tensor
    block_stride: int
    segment_stride: int


class KernelCopier:
    """Moves `kv`'s blocks to and from pinned host memory with one kernel per job."""

    def __init__(self, kv: DeviceKV) -> None:
        if kv.device.type != "cuda":
            raise ValueError(f"the kernel copier needs CUDA tensors, got {kv.device}")
        self.kv = kv
        self.num_segments = len(kv.segments)
        self.segment_bytes = kv.layout.segment_bytes
        self._kernels = _triton_kernels() if self._aligned() else None
        if self._kernels is not None:
            table = [(seg.data_ptr(), seg.stride(0) // _WORD) for seg in kv.segments]
            self._bases = torch.tensor([b for b, _ in table], dtype=torch.int64, device=kv.device)
            self._strides = torch.tensor([s for _, s in table], dtype=torch.int64, device=kv.device)
        words = self.segment_bytes // _WORD
        self._block_words = min(_MAX_BLOCK_WORDS, 1 << max(0, (words - 1).bit_length()))
        self._words = words
        # Each copying thread's job parameters and CUDA graphs (a job ends only once its
        # kernel has, so the next job of the same thread may rewrite the parameters).
        self._local = threading.local()
        self.graphs = True  # False once a capture failed (`_capture`)

    @classmethod
    def for_device(cls, kv: DeviceKV) -> KernelCopier | None:
        """A copier for `kv`, or None where the kernel cannot run (CPU, no Triton,
        segments not 8-byte aligned)."""
        if kv.device.type != "cuda":
            return None
        copier = cls(kv)
        return copier if copier._kernels is not None else None

    def _aligned(self) -> bool:
        return self.segment_bytes % _WORD == 0 and all(
            s.data_ptr() % _WORD == 0 and s.stride(0) % _WORD == 0 and s.stride(1) == 1
            for s in self.kv.segments
        )

    def host_side(self, tensor: torch.Tensor, block_stride: int, segment_stride: int) -> HostSide:
        """`tensor` (pinned, 8-byte aligned strides) seen as blocks; see `HostSide`."""
        if not tensor.is_pinned():
            raise ValueError("the kernel copier writes host memory only when it is pinned")
        if block_stride % _WORD or segment_stride % _WORD or tensor.data_ptr() % _WORD:
            raise ValueError(f"host strides {block_stride}, {segment_stride} not 8-byte aligned")
        return HostSide(tensor, block_stride, segment_stride)

    def to_host(
        self, device_ids: npt.NDArray[np.int64], host: HostSide, host_ids: npt.NDArray[np.int64]
    ) -> int:
        """Copy device blocks `device_ids` into host blocks `host_ids`; bytes moved."""
        return self._launch(0, device_ids, host, host_ids)

    def from_host(
        self, host: HostSide, host_ids: npt.NDArray[np.int64], device_ids: npt.NDArray[np.int64]
    ) -> int:
        """Copy host blocks `host_ids` into device blocks `device_ids`; bytes moved."""
        return self._launch(1, device_ids, host, host_ids)

    def _launch(
        self,
        which: int,
        device_ids: npt.NDArray[np.int64],
        host: HostSide,
        host_ids: npt.NDArray[np.int64],
    ) -> int:
        if self._kernels is None:
            raise RuntimeError("no Triton kernel for these caches: use `for_device`")
        n = len(device_ids)
        if n != len(host_ids):
            raise ValueError(f"{n} device blocks for {len(host_ids)} host blocks")
        if n == 0:
            return 0
        bucket = 1 << max(0, (n - 1).bit_length())  # one graph per direction and bucket
        params, view = self._params(bucket)
        fill_params(view, host, device_ids, host_ids, bucket)
        graphs: dict[tuple[int, int], Any] = self._local.graphs
        graph = graphs.get((which, bucket))
        if graph is not None:
            graph.replay()
        else:
            self._run(which, bucket, params)
            if self.graphs:
                self._capture(which, bucket, params)
        return n * self.segment_bytes * self.num_segments

    def _run(self, which: int, bucket: int, params: torch.Tensor) -> None:
        assert self._kernels is not None
        grid = (bucket, self.num_segments, -(-self._words // self._block_words))
        self._kernels[which][grid](
            self._bases,
            self._strides,
            params,
            self._words,
            BLOCK=self._block_words,
            HEADER=_HEADER,
        )

    def _capture(self, which: int, bucket: int, params: torch.Tensor) -> None:
        """Record this job's launch as a CUDA graph, replayed by the next jobs of its
        direction and bucket on this thread: a job's call took the host 35-90 us with a
        replay against 50-160 us with Triton's launch from Python (the H200 machine
        here), time in which the link idles. Captured on a private stream (nothing
        runs); where capture fails, plain launches from then on."""
        local = self._local
        if getattr(local, "capture_stream", None) is None:
            local.capture_stream = torch.cuda.Stream(self.kv.device)  # type: ignore[no-untyped-call]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(local.capture_stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._run(which, bucket, params)
                finally:
                    graph.capture_end()
        except Exception as exc:  # the job's copy is done: only the graph is lost
            log.warning(
                "kvtier: CUDA graph capture of the copy kernel failed (%s); "
                "launching it plainly from now on",
                exc,
            )
            self.graphs = False
            return
        local.graphs[(which, bucket)] = graph

    def _params(self, bucket: int) -> tuple[torch.Tensor, npt.NDArray[np.int64]]:
        """This thread's pinned parameters, grown to hold `bucket` pairs (its graphs,
        which read the old buffer, go with it)."""
        local = self._local
        held: torch.Tensor | None = getattr(local, "params", None)
        size = _HEADER + 2 * bucket
        if held is None or held.numel() < size:
            capacity = max(size, _HEADER + 2 * 64, 2 * held.numel() if held is not None else 0)
            local.params = torch.zeros(capacity, dtype=torch.int64, pin_memory=True)
            local.view = local.params.numpy()
            local.graphs = {}
        return local.params, local.view


def fill_params(
    view: npt.NDArray[np.int64],
    host: HostSide,
    device_ids: npt.NDArray[np.int64],
    host_ids: npt.NDArray[np.int64],
    bucket: int,
) -> None:
    """Write a job's parameters (see `_HEADER`) for a grid of `bucket` blocks."""
    n = len(device_ids)
    view[0] = host.tensor.data_ptr()
    view[1] = host.block_stride // _WORD
    view[2] = host.segment_stride // _WORD
    pairs = view[_HEADER : _HEADER + 2 * bucket].reshape(bucket, 2)
    pairs[:n, 0] = device_ids
    pairs[:n, 1] = host_ids
    pairs[n:] = -1


def prefer_kernel(
    src_ids: npt.NDArray[np.int64],
    dst_ids: npt.NDArray[np.int64],
    num_segments: int,
    block_bytes: int,
) -> bool:
    """Is one kernel faster than one DMA per segment and run of ids consecutive on both
    sides? (A cost model from measurements; see the module constants.)"""
    num_dmas = count_runs(src_ids, dst_ids) * num_segments
    transfer_us = len(src_ids) * block_bytes / LINK_BYTES_PER_US
    return DMA_COST_US * num_dmas > transfer_us * (1 / KERNEL_RATE - 1) + KERNEL_COST_US


@functools.cache
def _triton_kernels() -> tuple[Any, Any] | None:
    """(to host, from host) Triton kernels, or None where Triton cannot be imported.
    Offsets are int64 (the id pairs are, and the segment index is cast), so a host
    buffer or a device pool of any size is addressed right."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # (the job's argument is not named `params`: Triton binds arguments into a local of
    # that name)
    @triton.jit  # type: ignore[untyped-decorator]
    def to_host(bases, strides, job, words, BLOCK: tl.constexpr, HEADER: tl.constexpr):  # type: ignore[no-untyped-def]
        b = tl.program_id(0)
        s = tl.program_id(1).to(tl.int64)
        offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        block, slot = tl.load(job + HEADER + 2 * b), tl.load(job + HEADER + 2 * b + 1)
        mask = offs < tl.where(block >= 0, words, 0)  # padding pairs (-1) move nothing
        host = tl.load(job).to(tl.pointer_type(tl.int64))
        host_off = slot * tl.load(job + 1) + s * tl.load(job + 2)
        src = tl.load(bases + s).to(tl.pointer_type(tl.int64))
        data = tl.load(src + block * tl.load(strides + s) + offs, mask=mask)
        tl.store(host + host_off + offs, data, mask=mask)

    @triton.jit  # type: ignore[untyped-decorator]
    def from_host(bases, strides, job, words, BLOCK: tl.constexpr, HEADER: tl.constexpr):  # type: ignore[no-untyped-def]
        b = tl.program_id(0)
        s = tl.program_id(1).to(tl.int64)
        offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
        block, slot = tl.load(job + HEADER + 2 * b), tl.load(job + HEADER + 2 * b + 1)
        mask = offs < tl.where(block >= 0, words, 0)
        host = tl.load(job).to(tl.pointer_type(tl.int64))
        host_off = slot * tl.load(job + 1) + s * tl.load(job + 2)
        data = tl.load(host + host_off + offs, mask=mask)
        dst = tl.load(bases + s).to(tl.pointer_type(tl.int64))
        tl.store(dst + block * tl.load(strides + s) + offs, data, mask=mask)

    return to_host, from_host
