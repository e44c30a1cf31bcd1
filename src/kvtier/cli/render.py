"""Rich tables and the progress bar (only on a terminal: logs stay clean)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtier.sim.replay_config import Progress as ProgressCallback
from kvtier.sim.session import ProgressFactory, ReplayReport, SweepReport


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


@contextmanager
def progress_bars(console: Console, enabled: bool) -> Iterator[ProgressFactory | None]:
    """A factory of per-replay bars, or None when output is not an interactive terminal."""
    if not (enabled and console.is_terminal):
        yield None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bars:

        def factory(label: str, total: int) -> ProgressCallback:
            task = bars.add_task(label, total=total)
            return lambda done: bars.update(task, completed=done)

        yield factory


def _count(n: float) -> str:
    """Short counts (12.3k, 4.56M): the table must fit 80 columns when piped."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= limit:
            return f"{n / limit:.3g}{suffix}"
    return f"{n:.0f}"


def _stacks(report: ReplayReport) -> str:
    """The tiers each replay built, once if all built the same."""
    stacks = dict.fromkeys(r.stack for r in report.results if r.stack)
    if not stacks:
        return ""
    gpu = f"gpu {report.config.gpu_blocks:,} blocks -> " if report.config.gpu_blocks else ""
    return "tiers: " + "; ".join(gpu + s for s in stacks) + "\n"


def replay_table(report: ReplayReport) -> Table:
    b = report.bounds
    table = Table(
        box=box.SIMPLE_HEAD,
        title=f"{report.trace}: {report.requests:,} requests, {report.block_refs:,} block refs, "
        f"{report.unique_blocks:,} unique blocks; capacity {b.capacity:,} blocks",
        caption=_stacks(report)
        + "hit rates: block (any position), prefix (usable), token (weighted); "
        "saved: prefill tokens; stores/evicted/filtered: offload tiers; "
        "bounds at the same total capacity; replay speed: "
        + ", ".join(f"{r.policy} {_count(r.refs_per_s)} refs/s" for r in report.results),
    )
    table.add_column("policy", min_width=8)
    for name in ("block", "prefix", "token", "saved", "stores", "evicted", "filtered"):
        table.add_column(name, justify="right", min_width=len(name))
    for r in report.results:
        table.add_row(
            r.policy,
            _pct(r.hit_rate),
            _pct(r.prefix_hit_rate),
            _pct(r.token_hit_rate),
            _count(r.prefill_tokens_saved),
            _count(sum(t.stores for t in r.offload_tiers)),
            _count(sum(t.evictions for t in r.offload_tiers)),
            _count(sum(t.filtered_stores for t in r.offload_tiers)),
        )
    table.add_section()
    # Belady's block hits bound the prefix hits too; prefix MIN reaches the lower end
    table.add_row("belady", _pct(b.belady), _pct(b.belady), style="dim")
    table.add_row("prefix MIN", "", _pct(b.prefix_min), style="dim")
    table.add_row("infinite", _pct(b.infinite), _pct(b.infinite_prefix), style="dim")
    return table


def fault_lines(report: ReplayReport) -> list[str]:
    """Lines printed under the tables, always (whatever the width, piped or not): what
    failed or was lost, what the bounds assume, what a reopened disk held."""
    lines = []
    for r in report.results:
        errors = sum(t.errors for t in r.tiers)
        rejected = sum(t.store_rejections for t in r.tiers)
        dropped = sum(t.dropped_blocks for t in r.tiers)
        bad = sum(t.checksum_failures for t in r.tiers)
        line = (
            f"{r.policy}: {_count(errors)} errors, {_count(bad)} checksum failures, "
            f"{_count(rejected)} stores refused, {_count(dropped)} blocks dropped by faults"
        )
        lost = r.extra.get("evicted_blocks_dropped", 0)
        unschedulable = r.extra.get("unschedulable_requests", 0)
        if lost:
            line += f", {_count(lost)} evicted blocks the tier refused (lost)"
        if unschedulable:
            line += f", {_count(unschedulable)} requests too large for the pool"
        shed = sum(t.shed_blocks for t in r.tiers)
        if shed:
            line += f", {_count(shed)} stored blocks shed (a tier behind: not kept)"
        lines.append(line)
        recovery = r.extra.get("disk_recovery")
        if isinstance(recovery, dict):
            lines.append(
                f"{r.policy}: disk tier reopened at {recovery['directory']}: "
                f"{recovery['recovered_blocks']:,} blocks recovered, "
                f"{recovery['dropped_files']:,} files deleted (torn, foreign or over capacity)"
            )
    lines += [f"bounds assume: {note}" for note in report.bounds.assumptions]
    return lines


def tier_table(report: ReplayReport) -> Table | None:
    """Per-tier breakdown, shown only when more than one tier served."""
    if all(len(r.tiers) <= 1 for r in report.results):
        return None
    rows = [(r.policy, t) for r in report.results for t in r.tiers]
    moved = any(t.bytes_loaded or t.bytes_stored for _, t in rows)
    filtered = any(t.filtered_stores for _, t in rows)
    table = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
        title="per tier (served: share of all block refs)",
        caption="in/out: bytes stored/loaded; bad: checksum failures; err: failed "
        "transfers; lost: blocks dropped by faults",
    )
    # Short names: every column must fit 80 columns, the fault counts above all.
    names = ["policy", "tier", "size", "served", "stores", "evict"]
    names += ["filt"] * filtered + ["in/out", "bad"] * moved + ["err", "lost"]
    for name in names:
        left = name in ("policy", "tier")
        width = 6 if name == "tier" else len(name)
        table.add_column(name, justify="left" if left else "right", min_width=width)
    for policy, t in rows:
        size = "server" if t.policy == "server" else _count(t.capacity)
        cells = [policy, t.name, size, _pct(t.hit_rate)]
        cells += [_count(t.stores), _count(t.evictions)]
        if filtered:
            cells.append(_count(t.filtered_stores))
        if moved:
            io = f"{_count(t.bytes_stored)}/{_count(t.bytes_loaded)}"
            cells += [io, str(t.checksum_failures)]
        cells += [_count(t.errors), _count(t.dropped_blocks)]
        table.add_row(*cells)
    return table


def sweep_table(report: SweepReport) -> Table:
    table = Table(
        title=f"{report.trace}: block hit rate by capacity "
        f"({report.block_refs:,} refs, {report.unique_blocks:,} unique blocks)"
    )
    policies = list(dict.fromkeys(p.policy for p in report.points))
    table.add_column("capacity", justify="right")
    table.add_column("of unique", justify="right")
    for policy in policies:
        table.add_column(policy, justify="right")
    table.add_column("belady", justify="right", style="dim")
    table.add_column("infinite", justify="right", style="dim")
    for capacity, belady in report.belady.items():
        row = {p.policy: p for p in report.points if p.capacity == capacity}
        fraction = next(iter(row.values())).fraction if row else 0.0
        table.add_row(
            f"{capacity:,}",
            _pct(fraction),
            *(_pct(row[p].hit_rate) for p in policies),
            _pct(belady),
            _pct(report.infinite),
        )
    return table
