"""Plots (matplotlib, headless) and self-contained HTML reports (PNG inlined)."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from matplotlib.figure import Figure

from kvtier.sim.session import ReplayReport, SweepReport


def _figure() -> Figure:
    # A bare Figure renders with Agg on savefig: no pyplot, no display, no global state.
    return Figure(figsize=(7, 4.5), dpi=110)


def sweep_png(report: SweepReport) -> bytes:
    """Hit rate against capacity, one line per policy, Belady and infinite as bounds."""
    fig = _figure()
    ax = fig.subplots()
    capacities = list(report.belady)
    for policy in dict.fromkeys(p.policy for p in report.points):
        rates = {p.capacity: p.hit_rate for p in report.points if p.policy == policy}
        ax.plot(capacities, [rates[c] for c in capacities], marker="o", label=policy)
    ax.plot(capacities, list(report.belady.values()), "k--", marker="x", label="Belady MIN")
    ax.axhline(report.infinite, color="grey", linestyle=":", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("block hit rate")
    ax.set_ylim(0, max(0.05, report.infinite * 1.1))
    ax.set_title(report.trace)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _png(fig)


def replay_png(report: ReplayReport) -> bytes:
    """Block, prefix and token hit rates per policy against the two bounds."""
    fig = _figure()
    ax = fig.subplots()
    names = [r.policy for r in report.results]
    width = 0.25
    for k, (label, values) in enumerate(
        (
            ("block hit", [r.hit_rate for r in report.results]),
            ("prefix hit", [r.prefix_hit_rate for r in report.results]),
            ("token hit", [r.token_hit_rate for r in report.results]),
        )
    ):
        ax.bar([i + (k - 1) * width for i in range(len(names))], values, width, label=label)
    ax.axhline(report.bounds.belady, color="k", linestyle="--", label="Belady MIN")
    ax.axhline(report.bounds.infinite, color="grey", linestyle=":", label="infinite cache")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("hit rate")
    ax.set_title(f"{report.trace} at {report.bounds.capacity:,} blocks")
    ax.legend()
    return _png(fig)


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def write_output(path: str | Path, data: bytes) -> None:
    """Write a report or plot file; an error names the file (a bare ENOSPC does not)."""
    try:
        Path(path).write_bytes(data)
    except OSError as e:
        raise OSError(f"{path}: cannot write ({e.strerror or e})") from None


def _table(rows: list[list[str]]) -> str:
    head, *body = rows
    cells = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    lines = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body
    )
    return f"<table><tr>{cells}</tr>{lines}</table>"


def write_html(
    path: str | Path, title: str, table_rows: list[list[str]], png: bytes, *more: list[list[str]]
) -> None:
    """One self-contained file: the tables and the plot inlined as base64 PNG."""
    image = base64.b64encode(png).decode("ascii")
    tables = "<p></p>".join(_table(rows) for rows in (table_rows, *more))
    page = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>{tables}"
        f"<p><img alt='hit rate plot' src='data:image/png;base64,{image}'></p></body></html>"
    )
    write_output(path, page.encode())


def tier_rows(report: ReplayReport) -> list[list[str]]:
    rows = [["policy", "tier", "size", "served", "stores", "evicted", "filtered"]]
    rows[0] += ["bytes stored", "bytes loaded", "checksum failures", "errors"]
    rows[0] += ["stores refused", "dropped blocks"]
    for r in report.results:
        for t in r.tiers:
            counts = (t.stores, t.evictions, t.filtered_stores, t.bytes_stored, t.bytes_loaded)
            faults = (t.checksum_failures, t.errors, t.store_rejections, t.dropped_blocks)
            rows.append(
                [
                    r.policy,
                    t.name,
                    f"{t.capacity:,}",
                    f"{t.hit_rate:.4f}",
                    *(f"{n:,}" for n in counts),
                    *(f"{n:,}" for n in faults),
                ]
            )
    return rows


def replay_rows(report: ReplayReport) -> list[list[str]]:
    rows = [["policy", "block hit", "prefix hit", "token hit", "prefill saved", "stores"]]
    for r in report.results:
        rows.append(
            [
                r.policy,
                f"{r.hit_rate:.4f}",
                f"{r.prefix_hit_rate:.4f}",
                f"{r.token_hit_rate:.4f}",
                f"{r.prefill_tokens_saved:,}",
                f"{sum(t.stores for t in r.offload_tiers):,}",
            ]
        )
    b = report.bounds
    rows.append(["belady", f"{b.belady:.4f}", f"{b.belady:.4f}", "", "", ""])
    rows.append(["prefix MIN", "", f"{b.prefix_min:.4f}", "", "", ""])
    rows.append(["infinite", f"{report.bounds.infinite:.4f}", "", "", "", ""])
    return rows


def sweep_rows(report: SweepReport) -> list[list[str]]:
    policies = list(dict.fromkeys(p.policy for p in report.points))
    rows = [["capacity", *policies, "belady", "infinite"]]
    for capacity, belady in report.belady.items():
        rates = {p.policy: p.hit_rate for p in report.points if p.capacity == capacity}
        rows.append(
            [
                f"{capacity:,}",
                *(f"{rates[p]:.4f}" for p in policies),
                f"{belady:.4f}",
                f"{report.infinite:.4f}",
            ]
        )
    return rows
