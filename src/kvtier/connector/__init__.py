"""The scheduler-side connector an engine embeds between its accelerator pool and
the offload tiers (see `kvtier.connector.scheduler`)."""

from kvtier.connector.chain import ChainSpec, TierChain, settle_load
from kvtier.connector.scheduler import (
    Admission,
    ConnectorCounters,
    OffloadConnector,
    StoreOn,
    TransferJob,
)

__all__ = [
    "Admission",
    "ChainSpec",
    "ConnectorCounters",
    "OffloadConnector",
    "StoreOn",
    "TierChain",
    "TransferJob",
    "settle_load",
]
