"""The copy kernel: scattered device blocks to pinned host memory of either arrangement
(the CPU tier's segment-major planes, staging's slot-major rows) and back, every byte
checked; and the choice between it and one DMA per segment and run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.transfer import cuda_copy
from kvtier.transfer.cuda_copy import HostSide, KernelCopier, fill_params, prefer_kernel
from tests.gpu.kit import LAYOUTS, block_bytes, make_kv

DEVICE_IDS = np.array([5, 2, 9, 10, 11, 0, 7, 30, 31], dtype=np.int64)
HOST_IDS = np.array([0, 1, 2, 3, 8, 9, 4, 5, 6], dtype=np.int64)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arrangement", ["segment_major", "slot_major"])
def test_blocks_reach_host_memory_and_come_back(
    cuda: torch.device, layout: str, arrangement: str
) -> None:
    kv = make_kv(layout, 32, cuda, seed=1)
    copier = KernelCopier.for_device(kv)
    assert copier is not None, "torch's CUDA builds bring Triton: the kernel path"
    seg, num_segments, slots = kv.layout.segment_bytes, len(kv.segments), 10
    host = torch.zeros(slots * kv.layout.bytes_per_block, dtype=torch.uint8, pin_memory=True)
    if arrangement == "segment_major":  # the CPU tier's planes
        side = copier.host_side(host, seg, slots * seg)
        planes = host.view(num_segments, slots, seg)

        def stored(slot: int) -> bytes:
            return b"".join(planes[k, slot].numpy().tobytes() for k in range(num_segments))
    else:  # staging rows
        side = copier.host_side(host, kv.layout.bytes_per_block, seg)

        def stored(slot: int) -> bytes:
            return host.view(slots, -1)[slot].numpy().tobytes()

    moved = copier.to_host(DEVICE_IDS, side, HOST_IDS)
    torch.cuda.synchronize()
    assert moved == len(DEVICE_IDS) * kv.layout.bytes_per_block
    for d, h in zip(DEVICE_IDS.tolist(), HOST_IDS.tolist(), strict=True):
        assert stored(h) == block_bytes(kv, d), f"host block {h}"
    assert stored(7) == bytes(kv.layout.bytes_per_block)  # a block no job named: untouched
    before = {b: block_bytes(kv, b) for b in range(32)}
    targets = np.array([12, 13, 14, 1, 20, 21, 3, 27, 15], dtype=np.int64)
    copier.from_host(side, HOST_IDS, targets)
    torch.cuda.synchronize()
    for t, d in zip(targets.tolist(), DEVICE_IDS.tolist(), strict=True):
        assert block_bytes(kv, t) == before[d], f"block {t}"
    assert all(block_bytes(kv, b) == before[b] for b in set(range(32)) - set(targets.tolist()))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_kernels_address_every_layout_in_tritons_interpreter(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU part of the kernel's test: the same kernels, run by Triton's interpreter
    on CPU tensors, with the parameters `_launch` writes (a bucket larger than the job:
    the padding pairs move nothing)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    to_host, from_host = cuda_copy._triton_kernels.__wrapped__()  # interpreted: env read at jit
    kv = make_kv(layout, 32, torch.device("cpu"), seed=4)
    seg, num_segments, slots = kv.layout.segment_bytes, len(kv.segments), 10
    bases = torch.tensor([s.data_ptr() for s in kv.segments], dtype=torch.int64)
    strides = torch.tensor([s.stride(0) // 8 for s in kv.segments], dtype=torch.int64)
    host = torch.zeros(slots * kv.layout.bytes_per_block, dtype=torch.uint8)
    side = HostSide(host, seg, slots * seg)  # the CPU tier's segment-major planes
    planes = host.view(num_segments, slots, seg)
    words, block = seg // 8, 64
    bucket = 16  # 9 pairs, 7 of padding
    params = torch.zeros(cuda_copy._HEADER + 2 * bucket, dtype=torch.int64)
    fill_params(params.numpy(), side, DEVICE_IDS, HOST_IDS, bucket)
    grid = (bucket, num_segments, -(-words // block))
    args = (bases, strides, params, words)
    to_host[grid](*args, BLOCK=block, HEADER=cuda_copy._HEADER)
    for d, h in zip(DEVICE_IDS.tolist(), HOST_IDS.tolist(), strict=True):
        stored = b"".join(planes[k, h].numpy().tobytes() for k in range(num_segments))
        assert stored == block_bytes(kv, d), f"host block {h}"
    assert not planes[:, 7].any()  # a slot no pair named: untouched
    before = {b: block_bytes(kv, b) for b in range(32)}
    targets = np.array([12, 13, 14, 1, 20, 21, 3, 27, 15], dtype=np.int64)
    fill_params(params.numpy(), side, targets, HOST_IDS, bucket)
    from_host[grid](*args, BLOCK=block, HEADER=cuda_copy._HEADER)
    for t, d in zip(targets.tolist(), DEVICE_IDS.tolist(), strict=True):
        assert block_bytes(kv, t) == before[d], f"block {t}"
    assert all(block_bytes(kv, b) == before[b] for b in set(range(32)) - set(targets.tolist()))


def test_later_jobs_replay_a_graph_with_their_own_ids_and_host_memory(cuda: torch.device) -> None:
    """After a bucket's first job (a plain launch, captured), its jobs replay the graph:
    each with its own ids, and its own host memory (staging rows move between jobs)."""
    kv = make_kv("per_layer", 64, cuda, seed=5)
    copier = KernelCopier.for_device(kv)
    assert copier is not None
    seg, per = kv.layout.segment_bytes, kv.layout.bytes_per_block
    rng = np.random.default_rng(0)
    buffers = []  # all kept: every job's host memory at an address of its own
    for job in range(6):
        n = int(rng.integers(5, 9))  # one bucket (8) every time
        ids = rng.permutation(64)[:n]
        rows = torch.zeros(n * per, dtype=torch.uint8, pin_memory=True)
        buffers.append(rows)
        side = copier.host_side(rows, per, seg)
        copier.to_host(ids, side, np.arange(n))
        torch.cuda.synchronize()
        for i, d in enumerate(ids.tolist()):
            assert rows[i * per : (i + 1) * per].numpy().tobytes() == block_bytes(kv, d), job
        before = {b: block_bytes(kv, b) for b in range(64)}
        targets = rng.permutation(64)[:n]
        copier.from_host(side, np.arange(n), targets)
        torch.cuda.synchronize()
        for t, d in zip(targets.tolist(), ids.tolist(), strict=True):
            assert block_bytes(kv, t) == before[d], (job, t)
        untouched = set(range(64)) - set(targets.tolist())
        assert all(block_bytes(kv, b) == before[b] for b in untouched), job
    assert copier.graphs, "graph capture failed: plain launches only"
    assert set(copier._local.graphs) == {(0, 8), (1, 8)}


def test_a_graph_that_cannot_be_captured_leaves_plain_launches(
    cuda: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Capture is an optimisation: where it fails, the job it followed is done, and the
    jobs after it launch the kernel plainly, every byte right."""
    kv = make_kv("per_layer", 16, cuda, seed=6)
    copier = KernelCopier.for_device(kv)
    assert copier is not None

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("capture refused (a test)")

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", refuse)
    seg, per = kv.layout.segment_bytes, kv.layout.bytes_per_block
    rows = torch.zeros(4 * per, dtype=torch.uint8, pin_memory=True)
    side = copier.host_side(rows, per, seg)
    for job in range(3):
        ids = np.array([3, 7, 1, 12], dtype=np.int64) + job
        copier.to_host(ids, side, np.arange(4))
        torch.cuda.synchronize()
        for i, d in enumerate(ids.tolist()):
            assert rows[i * per : (i + 1) * per].numpy().tobytes() == block_bytes(kv, d), job
    assert not copier.graphs and not copier._local.graphs


def test_bad_arguments_name_what_is_wrong(cuda: torch.device) -> None:
    kv = make_kv("per_layer", 8, cuda, seed=2)
    copier = KernelCopier.for_device(kv)
    assert copier is not None
    pageable = torch.zeros(4 * kv.layout.bytes_per_block, dtype=torch.uint8)
    with pytest.raises(ValueError, match="pinned"):
        copier.host_side(pageable, kv.layout.bytes_per_block, kv.layout.segment_bytes)
    side = copier.host_side(
        pageable.pin_memory(), kv.layout.bytes_per_block, kv.layout.segment_bytes
    )
    with pytest.raises(ValueError, match="3 device blocks for 2 host blocks"):
        copier.to_host(np.arange(3), side, np.arange(2))


def test_cpu_tensors_get_no_kernel() -> None:
    kv = make_kv("per_layer", 8, torch.device("cpu"), seed=3)
    assert KernelCopier.for_device(kv) is None
    with pytest.raises(ValueError, match="needs CUDA"):
        KernelCopier(kv)


def test_the_kernel_is_chosen_where_dmas_would_be_short() -> None:
    per_block, segments = 2 << 20, 64  # an 8B model's 16-token block: 64 segments of 32 KiB
    scattered = np.random.default_rng(0).permutation(512)[:32]
    consecutive = np.arange(512, dtype=np.int64)
    # scattered blocks: one 32 KiB DMA per block and segment
    assert prefer_kernel(scattered, np.arange(32), segments, per_block)
    # a run of 512 blocks: 64 DMAs of 16 MiB, each at the link's rate
    assert not prefer_kernel(consecutive, consecutive, segments, per_block)
    # the cross-layer layout (one segment): a run of 32 blocks is one 64 MiB DMA
    assert not prefer_kernel(consecutive[:32], consecutive[:32], 1, per_block)
