"""Transfer workers: move KV blocks between the engine's tensors and a store.

Imports torch; the scheduler side (`kvtier.offload`) never imports this package.
"""

from kvtier.transfer.device import DeviceKV, allocate_kv_caches
from kvtier.transfer.transfer_worker import TransferResult, TransferWorker

__all__ = ["DeviceKV", "TransferResult", "TransferWorker", "allocate_kv_caches"]
