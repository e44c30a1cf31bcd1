"""Trace readers, workload generators, the replay loop, bounds and metrics.

```python
from kvtier.sim import ReplayConfig, generate_workload, load_workload, replay

workload = load_workload("../shared/traces/conversation_trace.jsonl")   # or generate_workload()
result = replay(workload, ReplayConfig("lru", cpu_frac=0.05))
print(result.hit_rate, result.prefix_hit_rate, [t.name for t in result.tiers])
```
"""

from kvtier.sim.bounds import Bounds, belady_hits, brute_force_hits, compute_bounds, infinite_hits
from kvtier.sim.generator import GeneratorConfig, generate_workload
from kvtier.sim.metrics import ReplayResult, TierStats
from kvtier.sim.prefix_bound import brute_force_prefix_hits, prefix_min_hits
from kvtier.sim.replay_config import ReplayConfig, TimeModel
from kvtier.sim.run import replay
from kvtier.sim.session import ReplayReport, SweepReport, run_replays, sweep
from kvtier.sim.traces import (
    TraceFormatError,
    TraceRequest,
    read_bailian,
    read_mooncake,
    read_tokens,
)
from kvtier.sim.workload import FORMATS, Workload, load_workload

__all__ = [
    "FORMATS",
    "Bounds",
    "GeneratorConfig",
    "ReplayConfig",
    "ReplayReport",
    "ReplayResult",
    "SweepReport",
    "TierStats",
    "TimeModel",
    "TraceFormatError",
    "TraceRequest",
    "Workload",
    "belady_hits",
    "brute_force_hits",
    "brute_force_prefix_hits",
    "compute_bounds",
    "generate_workload",
    "infinite_hits",
    "load_workload",
    "prefix_min_hits",
    "read_bailian",
    "read_mooncake",
    "read_tokens",
    "replay",
    "run_replays",
    "sweep",
]
