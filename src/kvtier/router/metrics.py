"""The router's `/metrics`: counters in Prometheus' text exposition format."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.router.proxy import Router


def metrics_text(router: Router) -> str:
    """Prometheus' text format: the router's counters, per engine where they are."""
    c = router.counters
    lines = [
        "# TYPE kvtier_router_requests_total counter",
        f"kvtier_router_requests_total {c.requests}",
        "# TYPE kvtier_router_retries_total counter",
        f"kvtier_router_retries_total {c.retries}",
        "# TYPE kvtier_router_unanswered_total counter",
        f"kvtier_router_unanswered_total {c.unanswered}",
        "# TYPE kvtier_router_prompt_errors_total counter",
        f"kvtier_router_prompt_errors_total {c.prompt_errors}",
        "# TYPE kvtier_router_decisions_total counter",
    ]
    lines += [
        f'kvtier_router_decisions_total{{reason="{r}"}} {n}' for r, n in sorted(c.by_reason.items())
    ]
    per_engine: dict[str, tuple[str, list[str]]] = {}

    def add(metric: str, kind: str, engine: str, value: int) -> None:
        per_engine.setdefault(metric, (kind, []))[1].append(
            f'{metric}{{engine="{engine}"}} {value}'
        )

    for name, s in router.engines.items():
        add("kvtier_router_engine_up", "gauge", name, int(s.up))
        add("kvtier_router_engine_in_flight", "gauge", name, s.in_flight)
        add("kvtier_router_engine_requests_total", "counter", name, s.requests)
        add("kvtier_router_engine_failures_total", "counter", name, s.failures)
        add("kvtier_router_engine_taken_out_total", "counter", name, s.taken_out)
        add("kvtier_router_engine_blocks", "gauge", name, router.index.held_blocks(name))
        if s.subscriber is not None:
            e = s.subscriber.counters
            add("kvtier_router_events_batches_total", "counter", name, e.batches)
            add("kvtier_router_events_total", "counter", name, e.events)
            add("kvtier_router_events_malformed_total", "counter", name, e.malformed)
            add("kvtier_router_events_missed_batches_total", "counter", name, e.missed)
            add("kvtier_router_events_replayed_batches_total", "counter", name, e.replayed)
            add("kvtier_router_events_restarts_total", "counter", name, e.restarts)
    for metric, (kind, samples) in per_engine.items():
        lines.append(f"# TYPE {metric} {kind}")
        lines += samples
    lines += [
        "# TYPE kvtier_router_shared_blocks gauge",
        f"kvtier_router_shared_blocks {router.index.shared_blocks()}",
    ]
    return "\n".join(lines) + "\n"
