"""kvtier's disk and Redis tiers under vLLM's own `TieringOffloadingSpec`
(`secondary_tiers` entries `KvtierDiskTier`, `KvtierRedisTier`), and that spec with
kvtier's transfer worker where vLLM has none (`KvtierTieringOffloadingSpec`)."""
