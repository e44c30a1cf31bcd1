"""`kvtier replay --vllm-config`: an engine's extra config replayed as the engine builds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.store.diskformat import block_file_bytes

BYTES_PER_BLOCK = 1_000
# 150 CPU blocks and 300 disk block files of 1,000-byte blocks, as the engine counts them
EXTRA = {
    "spec_name": "KvtierOffloadingSpec",
    "spec_module_path": "kvtier.vllm",
    "cpu_bytes_to_use": 150 * BYTES_PER_BLOCK + 999,
    "disk_path": "/nonexistent/kvtier-never-opened",
    "disk_bytes_to_use": 300 * block_file_bytes(BYTES_PER_BLOCK) + 5,
    "disk_writes": "write_through",
    "store_threshold": 2,
    "eviction_policy": "arc",
}
COMMON = ["replay", "--json", "--limit", "300", "--gpu-blocks", "400"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main([*COMMON, *argv]) == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out)["results"]
    assert isinstance(result, list) and len(result) == 1
    return {k: v for k, v in result[0].items() if k != "seconds"}


def test_the_config_replays_as_the_same_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from_config = _run(
        capsys,
        "--vllm-config",
        json.dumps(EXTRA),
        "--kv-bytes-per-block",
        str(BYTES_PER_BLOCK),
    )
    from_flags = _run(
        capsys,
        *("--policy", "arc", "--cpu-blocks", "150", "--disk-blocks", "300"),
        *("--disk-writes", "write_through", "--store-threshold", "2"),
    )
    assert from_config == from_flags
    assert from_config["stack"] == (
        "cpu 150 blocks (arc) -> disk 300 blocks (arc, write_through); "
        "disk admits blocks offered 2+ times"
    )
    tiers = from_config["tiers"]
    assert isinstance(tiers, dict) and tiers["disk"]["stores"] > 0  # the disk tier was built
    assert not Path(EXTRA["disk_path"]).exists()  # and the engine's directory never opened


def test_a_model_config_gives_the_kv_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 2 layers x 2 KV heads x head dim 16 x K and V x 2 bytes (bf16): 256 bytes per token
    model = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    model |= {"num_key_value_heads": 2, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(model))
    config = tmp_path / "extra.json"
    config.write_text(json.dumps({"cpu_bytes_to_use": 256 * 16 * 40}))
    derived = _run(
        capsys, "--vllm-config", f"@{config}", "--model-config", str(tmp_path / "config.json")
    )
    assert derived["stack"] == "cpu 40 blocks (lru)"  # the generated workload's 16-token blocks
    given = _run(capsys, "--vllm-config", f"@{config}", "--kv-bytes-per-block", str(256 * 16))
    assert derived == given


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--vllm-config", '{"cpu_bytes_to_use": 8000, "disk_pth": "/x"}'],
            "unknown kv_connector_extra_config key 'disk_pth' for KvtierOffloadingSpec",
        ),
        (
            ["--vllm-config", '{"cpu_bytes_to_use": 8000, "store_threshold": -1}'],
            "kv_connector_extra_config['store_threshold'] must be an integer >= 0, got -1",
        ),
        (["--vllm-config", "[1]"], "--vllm-config (inline): expected a JSON object, got list"),
        (["--vllm-config", "@/nonexistent.json"], "--vllm-config /nonexistent.json: cannot"),
        (["--vllm-config", '{"cpu_bytes_to_use": 8000}'], "--kv-bytes-per-block N"),
        (
            ["--vllm-config", '{"cpu_bytes_to_use": 10}', "--kv-bytes-per-block", "100"],
            "cpu_bytes_to_use 10 is below one block of this model (100 bytes)",
        ),
        (
            ["--vllm-config", "{}", "--kv-bytes-per-block", "10", "--cpu-blocks", "5"],
            "--cpu-blocks: --vllm-config sets the tiers",
        ),
        (["--kv-bytes-per-block", "10"], "--kv-bytes-per-block applies only with --vllm-config"),
    ],
)
def test_bad_input_is_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*COMMON, *argv]) == 2
    assert message in capsys.readouterr().err


def test_an_engine_needs_its_pool(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--limit", "10", "--vllm-config", "{}", "--kv-bytes-per-block", "10"]
    assert main(argv) == 2
    assert "give its pool with --gpu-blocks N" in capsys.readouterr().err


def test_a_model_config_without_its_sizes_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    argv = ["--vllm-config", '{"cpu_bytes_to_use": 8000}']
    argv += ["--model-config", str(tmp_path / "config.json")]
    assert main([*COMMON, *argv]) == 2
    assert "model config has no 'num_hidden_layers'" in capsys.readouterr().err


def test_the_configs_store_queue_bound_is_the_replays(capsys: pytest.CaptureFixture[str]) -> None:
    """An engine's `disk_store_queue_bytes` (its local tier is the cascade) bounds the
    replay's local store queue, in blocks, unless `--store-queue-blocks` names one."""
    extra = EXTRA | {"disk_store_queue_bytes": 16 * BYTES_PER_BLOCK}
    argv = ["--vllm-config", json.dumps(extra), "--kv-bytes-per-block", str(BYTES_PER_BLOCK)]
    argv += ["--concurrent", "--store-ms-per-block", "local=50"]
    from_config = _run(capsys, *argv)
    from_flag = _run(capsys, *argv, "--store-queue-blocks", "local=16")
    tiers = from_config["tiers"]
    assert isinstance(tiers, dict) and tiers["disk"]["shed_blocks"] > 0
    assert from_config == from_flag
    wider = _run(capsys, *argv, "--store-queue-blocks", "local=100000")
    assert wider["tiers"]["disk"]["shed_blocks"] == 0  # type: ignore[index]
