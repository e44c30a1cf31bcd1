"""The router's `/metrics`, through `prometheus_client` (vLLM's own, and the router
extra's): a collector reads the router's counters at each scrape, and the library
writes the text format (label values escaped, HELP and TYPE lines, counters' `_total`).
Nothing is counted twice: the router keeps its tallies where it counts them
(`kvtier.router.state`), and each scrape reads them in a registry of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvtier.router.index import BlockIndex
from kvtier.router.state import EngineState, RouterCounters

CONTENT_TYPE = CONTENT_TYPE_LATEST

# per-engine event counters: (metric name without `_total`, help, EventCounters field)
_EVENT_COUNTERS = (
    ("kvtier_router_events_batches", "KV event batches applied", "batches"),
    ("kvtier_router_events", "KV events applied", "events"),
    ("kvtier_router_events_malformed", "KV events skipped as malformed", "malformed"),
    ("kvtier_router_events_missed_batches", "KV event batches never received", "missed"),
    ("kvtier_router_events_replayed_batches", "KV event batches replayed", "replayed"),
    ("kvtier_router_events_restarts", "engine restarts seen in its events", "restarts"),
)


class RouterCollector(Collector):
    """The router's counters as Prometheus metric families, read at each scrape."""

    def __init__(
        self, counters: RouterCounters, engines: Mapping[str, EngineState], index: BlockIndex
    ) -> None:
        self.counters = counters
        self.engines = engines
        self.index = index

    def collect(self) -> Iterator[Metric]:
        yield from self._router()
        yield from self._engines()
        yield GaugeMetricFamily(
            "kvtier_router_shared_blocks",
            "blocks in the shared tier (any engine can load them)",
            value=self.index.shared_blocks(),
        )

    def _router(self) -> Iterator[Metric]:
        c = self.counters
        for name, help_text, value in (
            ("kvtier_router_requests", "requests routed", c.requests),
            ("kvtier_router_retries", "requests sent to another engine", c.retries),
            ("kvtier_router_unanswered", "requests no engine answered", c.unanswered),
            ("kvtier_router_prompt_errors", "prompts routed cold, untokenizable", c.prompt_errors),
        ):
            yield CounterMetricFamily(name, help_text, value=value)
        decisions = CounterMetricFamily(
            "kvtier_router_decisions", "routing decisions by reason", labels=["reason"]
        )
        for reason, n in sorted(c.by_reason.items()):
            decisions.add_metric([reason], n)
        yield decisions

    def _engines(self) -> Iterator[Metric]:
        def gauge(name: str, help_text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, help_text, labels=["engine"])

        def counter(name: str, help_text: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, help_text, labels=["engine"])

        up = gauge("kvtier_router_engine_up", "1 while the engine is in the rotation")
        in_flight = gauge("kvtier_router_engine_in_flight", "requests in flight to the engine")
        requests = counter("kvtier_router_engine_requests", "requests the engine answered")
        failures = counter("kvtier_router_engine_failures", "requests the engine failed")
        taken_out = counter("kvtier_router_engine_taken_out", "times taken out of the rotation")
        blocks = gauge("kvtier_router_engine_blocks", "blocks the index holds for the engine")
        events = [counter(name, text) for name, text, _ in _EVENT_COUNTERS]
        for name, state in self.engines.items():
            up.add_metric([name], int(state.up))
            in_flight.add_metric([name], state.in_flight)
            requests.add_metric([name], state.requests)
            failures.add_metric([name], state.failures)
            taken_out.add_metric([name], state.taken_out)
            blocks.add_metric([name], self.index.held_blocks(name))
            if state.subscriber is not None:
                tallies = state.subscriber.counters
                for family, (_, _, field) in zip(events, _EVENT_COUNTERS, strict=True):
                    family.add_metric([name], getattr(tallies, field))
        yield from (up, in_flight, requests, failures, taken_out, blocks, *events)


def metrics_text(
    counters: RouterCounters, engines: Mapping[str, EngineState], index: BlockIndex
) -> bytes:
    """Prometheus' text exposition of the router's counters, per engine where they are."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(counters, engines, index))
    return generate_latest(registry)
