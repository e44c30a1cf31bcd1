"""KV-aware routing over many vLLM engines, seeing every tier kvtier offloads to.

The router reads each engine's KV events (vLLM's ZMQ publisher; kvtier reports its
CPU, disk and shared Redis tiers there too) into one index of which engine holds
which block where, hashes each request's prompt as the engines do, and sends it to
the engine that can serve the longest prefix, weighed by tier and load:

```python
from kvtier.router import EngineSpec, Router, RouterConfig, router_thread

config = RouterConfig(
    engines=(EngineSpec("http://127.0.0.1:8001", events="tcp://127.0.0.1:5557"),
             EngineSpec("http://127.0.0.1:8002", events="tcp://127.0.0.1:5558")),
    block_size=16, model_dir="/models/qwen")
with router_thread(Router(config)) as port:
    ...  # OpenAI clients talk to http://127.0.0.1:{port}/v1
```

`kvtier route` runs the same from the command line; `kvtier replay --engines N`
drives N replay stacks behind the same routing code (`kvtier.router.scoring`).
The HTTP side needs the `router` extra (aiohttp, pyzmq, msgspec, prometheus-client);
the index and the scoring need nothing beyond kvtier.
"""

from kvtier.router.config import EngineSpec, RouterConfig
from kvtier.router.index import BlockIndex
from kvtier.router.prompts import PromptHasher
from kvtier.router.scoring import POLICIES, Chooser, Decision, Weights
from kvtier.router.tiers import Tier, TierEvent

__all__ = [
    "POLICIES",
    "BlockIndex",
    "Chooser",
    "Decision",
    "EngineSpec",
    "PromptHasher",
    "Router",
    "RouterConfig",
    "Tier",
    "TierEvent",
    "Weights",
    "router_thread",
]


def __getattr__(name: str) -> object:
    # The HTTP side imports aiohttp and pyzmq: only when asked for.
    if name in ("Router", "router_thread"):
        from kvtier.router import proxy

        return getattr(proxy, name)
    raise AttributeError(f"module 'kvtier.router' has no attribute {name!r}")
