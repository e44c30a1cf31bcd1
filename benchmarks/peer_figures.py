"""The logic of bench_peers that needs no server: reading each side's own counters out of
its /metrics, the order the sides take turns in, the spread between repeats, the checks
that keep a configuration mistake from passing for a result, and the issue's verdicts.

Kept apart from the driver so that `make test` checks it without vLLM, LMCache or an
engine (tests/benchmarks/test_peer_figures.py).

A gap between two sides is claimed only where it is larger than the spread between
repeats: the spread of a figure is (max - min) / median over a side's repeats, and a
comparison is `decisive` when |ratio - 1| exceeds the larger of the two sides' spreads.
One repeat has no spread (None), so nothing it shows is decisive.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# the engine's own prefix-cache counters (tokens), the same names for every side
VLLM_COUNTERS = {
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:prefix_cache_queries": "pool_queries",
    "vllm:prefix_cache_hits": "pool_hits",
    "vllm:external_prefix_cache_queries": "external_queries",
    "vllm:external_prefix_cache_hits": "external_hits",
}
# LMCache's multiprocess server's counters (its HTTP port's /metrics)
LMCACHE_COUNTERS = {
    "lmcache_mp_lookup_requested_tokens": "lookup_tokens",
    "lmcache_mp_lookup_hit_tokens": "hit_tokens",
    "lmcache_mp_lookup_hit_l1_tokens": "hit_l1_tokens",
    "lmcache_mp_lookup_hit_l2_tokens": "hit_l2_tokens",
    "lmcache_mp_l1_write_chunks": "stored_chunks",
    "lmcache_mp_l1_read_chunks": "read_chunks",
    "lmcache_mp_l1_evicted_chunks": "evicted_chunks",
}
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*?)(?:_total)?(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


def counters(scrape: str, names: Mapping[str, str]) -> dict[str, float]:
    """The counters `names` (Prometheus name without `_total` -> our name) in a scrape,
    summed over their labels; a counter the scrape lacks is 0 (a side without it)."""
    out = dict.fromkeys(names.values(), 0.0)
    for name, value in _SAMPLE.findall(scrape):
        if name in names:
            out[names[name]] += float(value)
    return out


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}


def side_orders(sides: Sequence[str], runs: int) -> list[tuple[str, ...]]:
    """The order the sides take turns in for each of `runs` runs: run i starts with side
    i mod n (a rotation), so every side goes first, second, ... equally often."""
    n = len(sides)
    return [tuple(sides[(i + k) % n] for k in range(n)) for i in range(runs)]


@dataclass(frozen=True)
class ClientFigures:
    """What vLLM's serving benchmark client (`vllm.benchmarks.serve`) measured in one run."""

    completed: int
    failed: int
    input_tokens: int
    output_tokens: int
    requests_per_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float

    @classmethod
    def of(cls, result: Mapping[str, Any]) -> ClientFigures:
        """From the client's result dict (run with `--metric-percentiles 50,90,99`)."""
        missing = [k for k in ("p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms") if k not in result]
        if missing:
            raise KeyError(
                f"client result lacks {missing}: run it with --metric-percentiles 50,90,99"
            )
        return cls(
            completed=int(result["completed"]),
            failed=int(result.get("failed") or 0),
            input_tokens=int(result["total_input_tokens"]),
            output_tokens=int(result["total_output_tokens"]),
            requests_per_s=float(result["request_throughput"]),
            ttft_mean_s=float(result["mean_ttft_ms"]) / 1000,
            ttft_p50_s=float(result["p50_ttft_ms"]) / 1000,
            ttft_p90_s=float(result["p90_ttft_ms"]) / 1000,
            ttft_p99_s=float(result["p99_ttft_ms"]) / 1000,
        )


def spread(values: Sequence[float]) -> float | None:
    """(max - min) / median over repeats; None for fewer than two (no spread known)."""
    if len(values) < 2:
        return None
    middle = statistics.median(values)
    if middle == 0:
        return 0.0 if max(values) == min(values) else None
    return (max(values) - min(values)) / abs(middle)


@dataclass(frozen=True)
class Comparison:
    """One figure of side `a` against side `b` over the repeats."""

    ratio: float  # median of a's repeats over median of b's
    spread: float | None  # the larger of the two sides' spreads
    decisive: bool  # |ratio - 1| > spread: a gap the repeats' noise cannot make

    @classmethod
    def of(cls, a: Sequence[float], b: Sequence[float]) -> Comparison:
        if not a or not b:
            raise ValueError(f"a comparison needs repeats on both sides, got {len(a)} and {len(b)}")
        middle_b = statistics.median(b)
        ratio = statistics.median(a) / middle_b if middle_b else float("nan")
        spreads = [spread(a), spread(b)]
        worst = None if None in spreads else max(s for s in spreads if s is not None)
        return cls(ratio, worst, worst is not None and abs(ratio - 1) > worst)


def fairness_problems(
    side: str,
    reuse: bool,
    client: ClientFigures,
    engine: Mapping[str, float],
    own: Mapping[str, float],
    reference: ClientFigures,
    expected_requests: int,
) -> list[str]:
    """What makes a side's run no result, or not the same run as the others'.

    `engine`: the run's vLLM counters (`VLLM_COUNTERS` names); `own`: its offloading
    system's counters (kvtier's tokens loaded, LMCache's hit tokens); `reference`: the
    same run on the first side (every side gets the same prompts and answer lengths)."""
    problems = []
    if client.failed or client.completed != expected_requests:
        problems.append(f"{client.completed}/{expected_requests} completed, {client.failed} failed")
    if client.input_tokens != reference.input_tokens:
        problems.append(f"prompt tokens {client.input_tokens} != {reference.input_tokens}")
    if client.output_tokens != reference.output_tokens:
        problems.append(f"output tokens {client.output_tokens} != {reference.output_tokens}")
    external = engine.get("external_hits", 0.0)
    if side == "vllm" and (external or engine.get("external_queries", 0.0)):
        problems.append(f"vLLM alone asked an offloading connector ({external:.0f} hit tokens)")
    if side != "vllm" and reuse and external <= 0:
        problems.append("no tokens from its offload tier on a reuse workload: misconfigured?")
    if side == "lmcache" and external > own.get("hit_tokens", 0.0):
        served = own.get("hit_tokens", 0.0)
        problems.append(f"vLLM counted {external:.0f} external hit tokens, LMCache {served:.0f}")
    return problems


# the targets: kvtier against LMCache on reuse, against vLLM alone without reuse
REUSE_SATURATION = 2.0  # kvtier's requests/s at least this x LMCache's
REUSE_TTFT = 0.75  # kvtier's TTFT mean and p90 at most this x LMCache's at every rate
NO_REUSE_THROUGHPUT = 0.03  # kvtier's requests/s within 3% of vLLM alone's
NO_REUSE_TTFT = 0.05  # its TTFT mean and p90 within 5%
TTFT_FIGURES = ("ttft_mean_s", "ttft_p90_s")


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Each repeat's own ratio of `a` over `b`, their median and spread: the sides of a
    repeat ran back to back, so a drift of the machine between repeats moves both and
    leaves these alone (reported beside the verdict, which judges the medians)."""
    if len(a) != len(b):
        raise ValueError(f"paired repeats need as many on both sides, got {len(a)} and {len(b)}")
    ratios = [x / y if y else float("nan") for x, y in zip(a, b, strict=True)]
    return {
        "per_repeat": ratios,
        "paired_ratio": statistics.median(ratios) if ratios else None,
        "paired_spread": spread(ratios),
    }


def compare_figures(
    repeats: Mapping[str, Sequence[ClientFigures]], a: str, b: str
) -> dict[str, Comparison]:
    """Every figure of side `a` against side `b` over their repeats at one rate."""
    names = ("requests_per_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s")
    return {
        name: Comparison.of(
            [getattr(f, name) for f in repeats[a]], [getattr(f, name) for f in repeats[b]]
        )
        for name in names
    }


def verdicts(
    by_rate: Mapping[float, Mapping[str, Sequence[ClientFigures]]], reuse: bool
) -> list[dict[str, Any]]:
    """The issue's targets, one line each: what was compared, the ratio, the spread, and
    whether the target is met by more than the spread (`met`). `by_rate`: per offered
    rate (inf: all at once), per side, its repeats."""
    lines: list[dict[str, Any]] = []

    def line(target: str, rate: float, c: Comparison, ok: bool, pair: dict[str, Any]) -> None:
        lines.append(
            {
                "target": target,
                "rate": None if rate == float("inf") else rate,
                "ratio": c.ratio,
                "spread": c.spread,
                "decisive": c.decisive,
                "met": ok and c.decisive,
            }
            | pair
        )

    def pair_of(
        repeats: Mapping[str, Sequence[ClientFigures]], a: str, b: str, name: str
    ) -> dict[str, Any]:
        return paired(
            [getattr(f, name) for f in repeats[a]], [getattr(f, name) for f in repeats[b]]
        )

    for rate, repeats in by_rate.items():
        if reuse:
            vs_lmcache = compare_figures(repeats, "kvtier", "lmcache")
            if rate == float("inf"):
                c = vs_lmcache["requests_per_s"]
                line(
                    f"requests/s >= {REUSE_SATURATION}x LMCache's",
                    rate,
                    c,
                    c.ratio >= REUSE_SATURATION,
                    pair_of(repeats, "kvtier", "lmcache", "requests_per_s"),
                )
            for name in TTFT_FIGURES:
                c = vs_lmcache[name]
                ok = c.ratio <= REUSE_TTFT
                line(
                    f"{name} <= {REUSE_TTFT}x LMCache's",
                    rate,
                    c,
                    ok,
                    pair_of(repeats, "kvtier", "lmcache", name),
                )
            continue
        kvtier = compare_figures(repeats, "kvtier", "vllm")
        lmcache = compare_figures(repeats, "lmcache", "vllm") if "lmcache" in repeats else {}
        bounds = {"requests_per_s": NO_REUSE_THROUGHPUT} | dict.fromkeys(
            TTFT_FIGURES, NO_REUSE_TTFT
        )
        for name, bound in bounds.items():
            c = kvtier[name]
            # within the bound is a claim of no gap: the repeats must resolve the bound
            resolved = c.spread is not None and c.spread < bound
            closer = name not in lmcache or abs(c.ratio - 1) <= abs(lmcache[name].ratio - 1)
            lines.append(
                {
                    "target": f"{name} within {bound:.0%} of vLLM alone's, closer than LMCache's",
                    "rate": None if rate == float("inf") else rate,
                    "ratio": c.ratio,
                    "lmcache_ratio": lmcache[name].ratio if name in lmcache else None,
                    "spread": c.spread,
                    "decisive": resolved,
                    "met": abs(c.ratio - 1) <= bound and closer and resolved,
                }
                | pair_of(repeats, "kvtier", "vllm", name)
            )
    return lines


def computed_tokens(engine: Mapping[str, float]) -> float:
    """Prompt tokens the engine computed: neither from its pool nor from the connector."""
    return engine["prompt_tokens"] - engine["pool_hits"] - engine["external_hits"]


def saturation_ceilings(
    runs: Sequence[Mapping[str, Any]], rows: Sequence[str]
) -> list[dict[str, Any]]:
    """How far ahead of LMCache kvtier could be at saturation on each of `rows`, from the
    tokens each side had to compute itself.

    A side's run takes at least the time to compute its non-cached prompt tokens. Timed at
    vLLM alone's own rate in the same run (its computed prompt tokens over its run's
    seconds, its answers' decoding counted as if it were prefill: so the rate is low, the
    best time estimated for kvtier short, and the ceiling high), kvtier's best is
    `computed / rate`, and its ceiling over LMCache is LMCache's seconds over that best:
    where both sides found the same tokens, no load however fast takes kvtier further.

    Tighter (`fit`): a run's seconds as `fixed + per_token * computed`, fitted through
    vLLM alone's run and LMCache's (the same requests and answers: `fixed` is what does
    not shrink with cached tokens, the answers' decoding and the steps' overhead); kvtier's
    floor is that line at its own computed tokens. Only where the two computed counts
    differ by at least `MIN_FIT_SPREAD` of vLLM alone's (else the line is noise: None).
    Medians over the repeats; a run's seconds are its requests over its requests/s."""
    out = []
    for row in rows:
        got = [r for r in runs if r["row"] == row and r["rate"] is None]
        if not got or not all(side in got[0] for side in ("vllm", "kvtier", "lmcache")):
            continue
        tokens, seconds = {}, {}
        for side in ("vllm", "kvtier", "lmcache"):
            tokens[side] = statistics.median(computed_tokens(r[side]["engine"]) for r in got)
            seconds[side] = statistics.median(
                r[side]["client"]["completed"] / r[side]["client"]["requests_per_s"] for r in got
            )
        rate = tokens["vllm"] / seconds["vllm"]
        best = tokens["kvtier"] / rate
        out.append(
            {
                "row": row,
                "computed_tokens": tokens,
                "seconds": seconds,
                "alone_tokens_per_s": rate,
                "kvtier_best_s": best,
                "ceiling": seconds["lmcache"] / best,
                "fit": _fitted_floor(tokens, seconds),
                "achieved": seconds["lmcache"] / seconds["kvtier"],
            }
        )
    return out


MIN_FIT_SPREAD = 0.1


def _fitted_floor(
    tokens: Mapping[str, float], seconds: Mapping[str, float]
) -> dict[str, float] | None:
    """`saturation_ceilings`' line through vLLM alone's and LMCache's runs, and kvtier's
    floor and ceiling on it."""
    gap = tokens["vllm"] - tokens["lmcache"]
    if abs(gap) < MIN_FIT_SPREAD * tokens["vllm"]:
        return None
    per_token = (seconds["vllm"] - seconds["lmcache"]) / gap
    fixed = seconds["vllm"] - per_token * tokens["vllm"]
    floor = fixed + per_token * tokens["kvtier"]
    return {
        "fixed_s": fixed,
        "per_token_ms": per_token * 1000,
        "kvtier_floor_s": floor,
        "ceiling": seconds["lmcache"] / floor,
    }


RESTART_RETURNS = {"pool forgot": "from CPU memory", "restarted": "from disk after a restart"}


def restart_verdicts(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The restart row's targets: kvtier's return no slower than LMCache's, from CPU memory
    and from disk after a restart. `row[side][step]`: that step's returns (`s`: seconds,
    `connector_tokens`). Medians over the returns, each side's spread, the fewest tokens
    a return took from the connector (a return that recomputed shows there); met only
    where kvtier is ahead by more than the spread."""
    lines = []
    for step, what in RESTART_RETURNS.items():
        returns = {side: row[side].get(step, []) for side in ("kvtier", "lmcache")}
        if not all(returns.values()):
            continue
        seconds = {side: [r["s"] for r in got] for side, got in returns.items()}
        c = Comparison.of(seconds["kvtier"], seconds["lmcache"])
        line: dict[str, Any] = {"target": f"{what}: no slower than LMCache's"}
        for side, values in seconds.items():
            line[f"{side}_s"] = statistics.median(values)
            line[f"{side}_spread"] = spread(values)
            line[f"{side}_min_connector_tokens"] = min(r["connector_tokens"] for r in returns[side])
        line |= {"ratio": c.ratio, "spread": c.spread, "decisive": c.decisive}
        lines.append(line | {"met": c.ratio < 1 and c.decisive})
    return lines


def markdown_table(result: dict[str, Any]) -> str:
    """The README's table: per row, rate and side, the median over the repeats (and the
    spread of requests/s), and the tokens the engine took from its pool and its
    connector (median prompt tokens served from each)."""
    head = (
        "| row | rate (req/s) | side | req/s (spread) | TTFT mean / p50 / p90 / p99 (s) "
        "| prompt tokens: from the pool / from the connector / all | problems |"
    )
    lines = [head, "|" + "---|" * 7]
    groups: dict[tuple[str, float | None], list[dict[str, Any]]] = {}
    for run in result["runs"]:
        groups.setdefault((run["row"], run["rate"]), []).append(run)
    for (row, rate), runs in groups.items():
        for side in sorted(runs[0]["order"], key=_side_rank):
            got = [r[side] for r in runs]

            def med(name: str, got: list[dict[str, Any]] = got) -> float:
                return statistics.median(g["client"][name] for g in got)

            def eng(name: str, got: list[dict[str, Any]] = got) -> float:
                return statistics.median(g["engine"].get(name, 0.0) for g in got)

            rps = [g["client"]["requests_per_s"] for g in got]
            s = spread(rps)
            problems = sum(len(g["problems"]) for g in got)
            lines.append(
                f"| {row} | {'all at once' if rate is None else f'{rate:g}'} | {side} "
                f"| {med('requests_per_s'):.2f} ({'-' if s is None else f'{s:.0%}'}) "
                f"| {med('ttft_mean_s'):.2f} / {med('ttft_p50_s'):.2f} / "
                f"{med('ttft_p90_s'):.2f} / {med('ttft_p99_s'):.2f} "
                f"| {eng('pool_hits'):,.0f} / {eng('external_hits'):,.0f} / "
                f"{eng('prompt_tokens'):,.0f} | {problems or ''} |"
            )
    return "\n".join(lines)


def _side_rank(side: str) -> int:
    order = ("vllm", "kvtier", "lmcache", "offloading")
    return order.index(side) if side in order else len(order)
