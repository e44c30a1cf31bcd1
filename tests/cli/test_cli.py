"""The `kvtier` command line: JSON schema, errors, reports, progress only on terminals."""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path

import pytest
from rich.console import Console

from kvtier.cli import main
from kvtier.cli.render import progress_bars


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_replay_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "replay", "--json", "--limit", "150", "--policy", "lru,arc")
    assert {"trace", "block_refs", "unique_blocks", "bounds", "results"} <= set(doc)
    bounds = doc["bounds"]
    assert isinstance(bounds, dict) and {"infinite", "belady"} <= set(bounds)
    results = doc["results"]
    assert isinstance(results, list) and [r["policy"] for r in results] == ["lru", "arc"]
    for r in results:
        assert {"hit_rate", "prefix_hit_rate", "token_hit_rate", "tiers"} <= set(r)
        assert 0 <= r["prefix_hit_rate"] <= r["hit_rate"] <= bounds["belady"] <= bounds["infinite"]
        assert r["prefix_hit_rate"] <= bounds["prefix_min"]  # exact on the chained generator
        assert set(r["tiers"]) == {"cpu"}
    assert bounds["prefix_exact"] is True and bounds["prefix_min"] == bounds["belady"]


def test_replay_is_reproducible_by_seed(capsys: pytest.CaptureFixture[str]) -> None:
    a = _json(capsys, "replay", "--json", "--limit", "100", "--seed", "5")
    b = _json(capsys, "replay", "--json", "--limit", "100", "--seed", "5")
    c = _json(capsys, "replay", "--json", "--limit", "100", "--seed", "6")
    strip = lambda d: [{k: v for k, v in r.items() if k != "seconds"} for r in d["results"]]  # noqa: E731
    assert strip(a) == strip(b) != strip(c)


def test_replay_table_without_terminal_has_no_progress_bar(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["replay", "--limit", "100", "--cpu-blocks", "50"]) == 0
    out = capsys.readouterr().out
    assert "belady" in out and "infinite" in out and "lru" in out and "prefix MIN" in out
    assert "━" not in out.split("policy")[0]  # no bar drawn before the table


def test_progress_bar_only_on_a_terminal() -> None:
    with progress_bars(Console(file=io.StringIO()), enabled=True) as bars:
        assert bars is None
    terminal = Console(file=io.StringIO(), force_terminal=True)
    with progress_bars(terminal, enabled=True) as bars:
        assert bars is not None
        bars("lru", 10)(5)


def test_malformed_trace_error_names_file_line_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 1, "input_length": 5, "output_length": 1}\n'
    )
    assert main(["replay", "--trace", str(trace)]) == 2
    assert "bad.jsonl:2: missing field 'hash_ids'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["replay", "--policy", "nope", "--limit", "10"], "unknown cache policy 'nope'"),
        (
            ["replay", "--store-threshold", "-1", "--limit", "10"],
            "store_threshold must be an integer >= 0, got -1",
        ),
        (
            ["replay", "--disk-writes", "always", "--disk-blocks", "9", "--limit", "10"],
            "disk_writes must be 'demote' or 'write_through', got 'always'",
        ),
        (["replay", "--cpu-frac", "2", "--limit", "10"], "cpu_frac"),
        (["compare", "--fracs", "0.1,x", "--limit", "10"], "--fracs"),
    ],
)
def test_bad_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_replay_html_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.html"
    assert main(["replay", "--limit", "100", "--report", str(report)]) == 0
    text = report.read_text()
    assert "<table>" in text and "data:image/png;base64," in text and "belady" in text
    assert "checksum failures" in text and "<td>cpu</td>" in text  # the per-tier table


def test_report_stores_count_offload_tiers_only(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli.report import replay_rows
    from kvtier.sim import ReplayConfig, generate_workload, run_replays
    from kvtier.sim.generator import GeneratorConfig

    workload = generate_workload(GeneratorConfig(num_requests=100))
    report = run_replays(workload, ["lru"], ReplayConfig(gpu_blocks=200, cpu_blocks=100))
    (result,) = report.results
    gpu, cpu = result.tiers
    assert gpu.name == "gpu" and gpu.stores > 0 and result.offload_tiers == (cpu,)
    assert replay_rows(report)[1][-1] == f"{cpu.stores:,}"  # as in the terminal table


def test_compare_table_png_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, html = tmp_path / "c.png", tmp_path / "c.html"
    argv = ["compare", "--limit", "120", "--fracs", "0.02,0.1", "--png", str(png)]
    assert main([*argv, "--report", str(html)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "data:image/png;base64," in html.read_text()
    assert "belady" in capsys.readouterr().out
    doc = _json(capsys, *argv, "--json")
    assert len(doc["results"]) == 4  # type: ignore[arg-type]
    belady = doc["bounds"]["belady"]  # type: ignore[index]
    assert list(belady.values()) == sorted(belady.values())
    assert doc["bounds"]["prefix_min"] == belady  # type: ignore[index]


def test_compare_on_real_trace_reproduces_published_lru(
    conversation_trace_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["compare", "--trace", str(conversation_trace_path), "--policy", "lru"]
    doc = _json(capsys, *argv, "--fracs", "0.05", "--json")
    (point,) = doc["results"]  # type: ignore[misc]
    assert point["capacity"] == 9139 and round(point["prefix_hit_rate"], 4) == 0.1957
    assert round(doc["bounds"]["belady"]["9139"], 4) == 0.3664  # type: ignore[index]


@pytest.mark.parametrize("extra", [[], ["--concurrent"], ["--store-on", "evict"]])
def test_replay_with_gpu_tier_reports_both_tiers(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", "--json", "--limit", "150", "--gpu-blocks", "300", "--policy", "lru"]
    doc = _json(capsys, *argv, *extra)
    (result,) = doc["results"]  # type: ignore[misc]
    assert set(result["tiers"]) == {"gpu", "cpu"}
    served = sum(t["hit_blocks"] for t in result["tiers"].values())
    assert served == result["prefix_hit_blocks"]
    assert doc["capacity"]["gpu_blocks"] == 300  # type: ignore[index]


def test_replay_table_shows_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--limit", "100", "--gpu-blocks", "200", "--policy", "lru"]) == 0
    out = capsys.readouterr().out
    assert "per tier" in out and "gpu" in out and "cpu" in out


def test_data_replay_reports_bytes_and_no_checksum_failures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["replay", "--json", "--limit", "150", "--cpu-blocks", "300", "--policy", "lru"]
    doc = _json(capsys, *argv, "--data")
    (cpu,) = doc["results"][0]["tiers"].values()  # type: ignore[index]
    assert cpu["bytes_stored"] > 0 and cpu["bytes_loaded"] > 0 and cpu["checksum_failures"] == 0


def _without_bytes(doc: dict[str, object]) -> list[object]:
    """Each result without its timing and byte counts (which only --data moves)."""
    bytes_fields = {"bytes_loaded", "bytes_stored"}
    results = doc["results"]
    assert isinstance(results, list)
    return [
        {
            **{k: v for k, v in r.items() if k not in ("seconds", "tiers", "metrics")},
            "tiers": {
                name: {k: v for k, v in t.items() if k not in bytes_fields}
                for name, t in r["tiers"].items()
            },
            "metrics": {k: v for k, v in r["metrics"].items() if "_bytes" not in k},
        }
        for r in results
    ]


def test_data_runs_every_mode_and_refuses_only_storing_on_eviction(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("torch")
    argv = ["replay", "--limit", "40", "--json", "--gpu-blocks", "300", "--disk-blocks", "200"]
    assert main([*argv, "--data", "--store-on", "evict"]) == 2
    assert "store_on" in capsys.readouterr().err
    plain = _json(capsys, *argv, "--concurrent")
    moved = _json(capsys, *argv, "--concurrent", "--data")
    assert _without_bytes(plain) == _without_bytes(moved)


def test_generated_workload_shape_flags(capsys: pytest.CaptureFixture[str]) -> None:
    docs = _json(capsys, "replay", "--json", "--requests", "40", "--mix", "0,0,1")
    assert docs["requests"] == 40
    assert docs["bounds"]["infinite"] == 0.0  # type: ignore[index]  # documents only: no reuse
    with pytest.raises(SystemExit) as refused:  # argparse's own usage error
        main(["replay", "--mix", "1,2"])
    assert refused.value.code == 2
    assert "--mix: expected 3 comma-separated shares" in capsys.readouterr().err


def test_bailian_and_token_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bailian = tmp_path / "b.jsonl"
    rows = [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 48,
         "output_length": 3, "type": "text", "turn": 1, "hash_ids": [10, 11, 12]},
        {"chat_id": 2, "parent_chat_id": 1, "timestamp": 1.5, "input_length": 48,
         "output_length": 3, "type": "text", "turn": 2, "hash_ids": [13, 11, 12]},
    ]  # fmt: skip
    bailian.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["replay", "--json", "--trace", str(bailian), "--cpu-blocks", "10"]
    doc = _json(capsys, *argv, "--format", "bailian")
    (lru, _) = doc["results"]  # type: ignore[misc]
    # Unchained ids: 11 and 12 are present, but behind a miss: any-position hits only.
    assert (lru["hit_blocks"], lru["prefix_hit_blocks"]) == (2, 0)
    assert doc["bounds"]["infinite_prefix"] == 0.0  # type: ignore[index]
    tokens = tmp_path / "t.jsonl"
    prompt = list(range(40))
    tokens.write_text(
        "".join(json.dumps({"token_ids": prompt, "output_length": 2}) + "\n" for _ in range(3))
    )
    argv = ["replay", "--json", "--trace", str(tokens), "--cpu-blocks", "4"]
    doc = _json(capsys, *argv, "--format", "tokens")
    assert doc["block_refs"] == 6 and doc["unique_blocks"] == 2  # two full 16-token blocks
    assert doc["results"][0]["prefix_hit_blocks"] == 4  # type: ignore[index]


def test_replay_table_counts_calls_to_an_unreachable_redis(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["replay", "--limit", "60", "--cpu-blocks", "200", "--policy", "lru"]
    assert main([*argv, "--redis", f"redis://127.0.0.1:{port}/0"]) == 0  # degraded, not fatal
    out = capsys.readouterr().out
    remote_row = next(line for line in out.splitlines() if " remote " in line).split()
    header = next(line for line in out.splitlines() if " err " in line).split()
    assert "server" in remote_row and int(remote_row[header.index("err")]) > 0
    (faults,) = [line for line in out.splitlines() if line.startswith("lru: ")]
    assert " 0 errors" not in faults  # also on the line under the tables, in full
    assert "bounds assume: the Redis tier is counted as unbounded" in out


def test_fault_counts_show_at_80_columns_when_piped(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    argv = ["replay", "--limit", "40", "--gpu-blocks", "200", "--disk-blocks", "300"]
    assert main([*argv, "--data", "--store-threshold", "2", "--policy", "lru"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["policy", "tier"])
    assert header.split()[-2:] == ["err", "lost"] and len(header.rstrip()) <= 80
    assert any(line.startswith("lru: 0 errors, 0 checksum failures") for line in lines)


def test_replay_table_says_when_evicted_blocks_were_lost(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["replay", "--limit", "100", "--gpu-blocks", "300", "--cpu-blocks", "10"]
    assert main([*argv, "--policy", "lru", "--store-on", "evict"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the caption wraps
    assert "evicted blocks the tier refused (lost)" in out
    assert main([*argv, "--policy", "lru"]) == 0  # stores at compute time lose nothing
    assert "refused (lost)" not in " ".join(capsys.readouterr().out.split())


def test_disk_dir_reports_recovery(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    argv = ["replay", "--limit", "30", "--cpu-blocks", "20", "--disk-blocks", "300", "--data"]
    argv += ["--disk-dir", str(tmp_path)]
    assert main([*argv, "--policy", "lru"]) == 0
    assert " 0 blocks recovered" in capsys.readouterr().out
    assert main([*argv, "--policy", "lru"]) == 0
    out = capsys.readouterr().out
    assert "disk tier reopened at" in out and " 0 blocks recovered" not in out
    assert "blocks recovered from earlier runs can beat both bounds" in out


def test_replay_json_has_the_engine_metric_names(capsys: pytest.CaptureFixture[str]) -> None:
    """`/metrics` of an engine with kvtier and the replay's JSON use the same names."""
    doc = _json(
        capsys,
        "replay",
        "--json",
        "--limit",
        "150",
        "--policy",
        "lru",
        "--cpu-blocks",
        "40",
        "--disk-blocks",
        "80",
    )
    (result,) = doc["results"]  # type: ignore[index]
    metrics, tiers = result["metrics"], result["tiers"]
    assert metrics["vllm:kvtier_load_blocks_total"] == {
        "cpu": tiers["cpu"]["hit_blocks"],
        "disk": tiers["disk"]["hit_blocks"],
    }
    assert metrics["vllm:kvtier_store_blocks_total"]["disk"] == tiers["disk"]["stores"]
    assert metrics["vllm:kvtier_capacity_blocks"] == {"cpu": 40, "disk": 80}
    assert metrics["vllm:kvtier_evicted_blocks_total"]["cpu"] == tiers["cpu"]["evictions"]
