"""The router's `/metrics` as Prometheus reads it: parsed back with prometheus_client's
own parser, label values that need escaping included."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvtier.router.config import EngineSpec
from kvtier.router.index import BlockIndex
from kvtier.router.metrics import metrics_text
from kvtier.router.state import EngineState, RouterCounters
from kvtier.router.tiers import Tier


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_counters_per_router_and_engine_round_trip() -> None:
    counters = RouterCounters(requests=5, retries=1, by_reason={"kv": 3, 'odd "reason"\\\n': 2})
    engine = EngineState(EngineSpec("http://127.0.0.1:8001"), in_flight=2, requests=4)
    down = EngineState(EngineSpec("http://127.0.0.1:8002"), up=False, failures=1, taken_out=1)
    engines = {engine.name: engine, down.name: down}
    index = BlockIndex()
    index.stored(engine.name, Tier.GPU, [b"a" * 32, b"b" * 32])
    index.stored(down.name, Tier.SHARED, [b"c" * 32])
    got = samples(metrics_text(counters, engines, index))
    assert got[("kvtier_router_requests_total", ())] == 5
    assert got[("kvtier_router_retries_total", ())] == 1
    assert got[("kvtier_router_unanswered_total", ())] == 0
    assert got[("kvtier_router_decisions_total", (("reason", "kv"),))] == 3
    # a label value with a quote, a backslash and a newline reads back as it was
    assert got[("kvtier_router_decisions_total", (("reason", 'odd "reason"\\\n'),))] == 2
    e0, e1 = (("engine", engine.name),), (("engine", down.name),)
    assert got[("kvtier_router_engine_up", e0)] == 1
    assert got[("kvtier_router_engine_up", e1)] == 0
    assert got[("kvtier_router_engine_in_flight", e0)] == 2
    assert got[("kvtier_router_engine_requests_total", e0)] == 4
    assert got[("kvtier_router_engine_failures_total", e1)] == 1
    assert got[("kvtier_router_engine_taken_out_total", e1)] == 1
    assert got[("kvtier_router_engine_blocks", e0)] == 2
    assert got[("kvtier_router_shared_blocks", ())] == 1
    # no subscriber (no event endpoint): no event counters for the engine
    assert not any(name.startswith("kvtier_router_events") for name, _ in got)


def test_the_metrics_module_does_not_import_the_proxy() -> None:
    """The router's one import circle (metrics <-> proxy) is gone."""
    import ast
    from pathlib import Path

    import kvtier.router.metrics as metrics

    tree = ast.parse(Path(metrics.__file__).read_text())
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert "kvtier.router.proxy" not in imported
