"""kvtier's own offloading spec and connector: vLLM's offloading connector over kvtier's
tier stack (CPU, disk, Redis), its worker over kvtier's transfer workers, and the
extra config that turns it on (`"spec_name": "KvtierOffloadingSpec"`)."""
