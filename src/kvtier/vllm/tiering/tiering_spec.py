"""vLLM's own `TieringOffloadingSpec`, with a worker that also runs on vLLM's CPU build.

vLLM's tiering layer (its CPU primary tier and secondary tiers such as kvtier's
`KvtierRedisTier` and `KvtierDiskTier`) runs on the CPU platform except for one
thing: `get_worker` refuses it, because vLLM's copy kernels need CUDA or XPU. This
spec is vLLM's, unchanged, except that on a platform vLLM refuses the worker is
kvtier's: the same shared memory region vLLM's scheduler side and secondary tiers
use, filled and read by kvtier's transfer worker (a thread per direction, copies
batched over runs of consecutive blocks, a failed copy reported as a failed job).

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KvtierTieringOffloadingSpec",
        "spec_module_path": "kvtier.vllm", "cpu_bytes_to_use": 8000000000,
        "secondary_tiers": [{"type": "KvtierRedisTier", "module_path": "kvtier.vllm",
                             "url": "redis://10.0.0.5:6379/0"}]}}'

Scope: one KV cache group, one engine block per offloaded chunk (no `block_size`
larger than the engine's), vLLM's direct layout (no `canonical_layout`).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtier.offload.abstract import LoadStoreSpec as KvtierSpec
from kvtier.transfer.device import DeviceKV, copy_blocks
from kvtier.transfer.handlers import Streams
from kvtier.transfer.pages import PagedDeviceKV
from kvtier.transfer.transfer_worker import TransferWorker
from kvtier.vllm.offloading.offloading_spec import layout_for


class ChunkSpec(KvtierSpec):
    """Chunks of vLLM's shared region, by index."""

    def __init__(self, chunk_ids: npt.NDArray[np.int64]) -> None:
        self.chunk_ids = chunk_ids

    @staticmethod
    def medium() -> str:
        return "CPU"


class RegionHandler:
    """Engine blocks <-> rows of vLLM's shared region, segment by segment (a K and a V
    half of each layer's page, as `PagedDeviceKV` cuts the engine's pages)."""

    def __init__(self, kv: DeviceKV, rows: list[torch.Tensor]) -> None:
        self.kv = kv
        self.rows = rows
        self._streams = Streams(kv)  # on CUDA: the copy streams and their ordering events

    def ready_event(self) -> Any:
        return self.kv.record_compute()

    def store(self, device_ids: npt.NDArray[np.int64], spec: KvtierSpec, ready: Any) -> int:
        assert isinstance(spec, ChunkSpec)
        copy = functools.partial(
            copy_blocks, self.kv.segments, device_ids, self.rows, spec.chunk_ids
        )
        return self._streams.run(self._streams.store, ready, copy)

    def load(self, spec: KvtierSpec, device_ids: npt.NDArray[np.int64], ready: Any = None) -> int:
        assert isinstance(spec, ChunkSpec)
        copy = functools.partial(
            copy_blocks, self.rows, spec.chunk_ids, self.kv.segments, device_ids
        )
        return self._streams.run(self._streams.load, ready, copy)


class KvtierRegionWorker(OffloadingWorker):
    """vLLM's `OffloadingWorker` over the shared region, on kvtier's transfer worker."""

    def __init__(self, kv: PagedDeviceKV, region: SharedOffloadRegion) -> None:
        self._region = region
        rows: list[torch.Tensor] = []
        for cache in kv.caches:
            page = int(cache.shape[1])
            view = region.create_next_worker_view(page).view(torch.uint8)
            halves = view.view(region.num_chunks, 2, page // 2)
            rows += [halves[:, 0], halves[:, 1]]
        self._worker = TransferWorker(RegionHandler(kv, rows), torch_threads=kv.torch_threads)

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._worker.submit_store(job_id, _ids(src_spec), ChunkSpec(_ids(dst_spec)))

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._worker.submit_load(job_id, ChunkSpec(_ids(src_spec)), _ids(dst_spec))

    def get_finished(self) -> list[TransferResult]:
        return [
            TransferResult(r.job_id, r.ok, transfer_size=r.bytes, transfer_time=r.seconds)
            for r in self._worker.get_finished()
        ]

    def wait(self, job_ids: set[int]) -> None:
        self._worker.wait(job_ids)

    def shutdown(self) -> None:
        self._worker.close()
        del self._worker  # its views of the region go before the region is unmapped
        self._region.cleanup()


def _ids(spec: LoadStoreSpec) -> npt.NDArray[np.int64]:
    if not isinstance(spec, GPULoadStoreSpec | CPULoadStoreSpec):
        raise TypeError(f"expected a GPU or CPU block spec, got {type(spec).__name__}")
    return np.asarray(spec.block_ids, dtype=np.int64)


class KvtierTieringOffloadingSpec(TieringOffloadingSpec):
    """`TieringOffloadingSpec` whose worker is kvtier's where vLLM has none (CPU build)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if current_platform.is_cuda_alike() or current_platform.is_xpu():
            return super().get_worker(kv_caches)  # vLLM's own copy kernels
        if self._kvtier_worker is None:
            self._kvtier_worker = self._make_worker(kv_caches)
        return self._kvtier_worker

    _kvtier_worker: KvtierRegionWorker | None = None

    def _make_worker(self, kv_caches: CanonicalKVCaches) -> KvtierRegionWorker:
        if self.blocks_per_chunk != 1 or self.config.canonical_layout:
            raise ValueError(
                "KvtierTieringOffloadingSpec's CPU worker moves one engine block per "
                f"chunk in vLLM's direct layout; got blocks_per_chunk={self.blocks_per_chunk}"
                f", canonical_layout={self.config.canonical_layout}"
            )
        kv = PagedDeviceKV(layout_for(self.config), [t.tensor for t in kv_caches.tensors])
        region = SharedOffloadRegion(
            engine_id=self.config.engine_id,
            num_chunks=self.num_chunks,
            rank=self.config.parallel.rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return KvtierRegionWorker(kv, region)
        except BaseException:
            region.cleanup()
            raise
