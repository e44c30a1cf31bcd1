"""A disk directory shared by engines of different tensor-parallel sizes
(`disk_shared`), in process: each worker writes its heads of a block as one file, an
engine of another size finds them by a lookup and reads exactly its heads; a corrupt
head is a miss for every worker; an engine evicts only its own files. (`test_engine_parallel`
plays the same in real vLLM engines.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.needs_vllm import quiet
from tests.vllm.parallel_engine import HEAD_PAGE, LAYERS, ParallelEngine, config, keys_of

with quiet():
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.remote.head_codec import HeadGroup
    from kvtier.store.shared_dir import file_name
    from kvtier.vllm.offloading.offloading_spec import (
        TOTAL_KV_HEADS,
        UNDER_KVTIER_CONNECTOR,
        KvtierOffloadingSpec,
    )

HEADS = 2


def engine(engines: list[Any], root: Path, tp: int, cpu_blocks: int = 1) -> ParallelEngine:
    extra = {
        "cpu_bytes_to_use": cpu_blocks * LAYERS * HEAD_PAGE * HEADS,
        "disk_path": str(root),
        "disk_bytes_to_use": 1 << 20,
        "disk_shared": True,
        "disk_fsync": False,
    }
    made = ParallelEngine(extra, tp=tp, kv_heads=HEADS)
    engines.append(made)
    return made


def whole(engine: ParallelEngine, device_id: int) -> bytes:
    """A block as one worker holding every head would hold it."""
    return b"".join(
        engine.pages[rank][layer][device_id].numpy().tobytes()
        for layer in range(LAYERS)
        for rank in range(len(engine.pages))
    )


def directory(engine: ParallelEngine) -> Path:
    disk = engine.workers[0].disk
    assert disk is not None
    return Path(disk.directory)  # type: ignore[union-attr]


@pytest.mark.parametrize(("writers", "readers"), [(2, 1), (1, 2)])
def test_an_engine_reads_the_disk_blocks_of_another_parallel_layout(
    engines: list[Any], tmp_path: Path, writers: int, readers: int
) -> None:
    writer = engine(engines, tmp_path, writers)
    keys = keys_of(3)
    writer.compute([0, 1, 2], seed=writers)
    assert not writer.store(keys, [0, 1, 2])
    names = sorted(p.name for p in directory(writer).glob("*.kv"))
    size = HEADS // writers
    groups = [HeadGroup(f, size) for f in range(0, HEADS, size)]
    assert names == sorted(file_name(k[:-4], g) for k in keys for g in groups)  # by head

    reader = engine(engines, tmp_path, readers)  # started after the writes: found by lookup
    assert reader.hits(keys) == [True] * 3
    errors, report = reader.load(keys, [8, 9, 10])
    assert not errors and not report
    assert [whole(reader, i) for i in (8, 9, 10)] == [whole(writer, i) for i in (0, 1, 2)]


def test_an_engine_started_later_adopts_the_whole_blocks_there(
    engines: list[Any], tmp_path: Path
) -> None:
    writer = engine(engines, tmp_path, 2)
    keys = keys_of(2)
    writer.compute([0, 1], seed=3)
    writer.store(keys, [0, 1])
    reader = engine(engines, tmp_path, 1)
    disk = reader.manager.local.disk  # type: ignore[attr-defined]
    assert sorted(k[:-4] for k in keys) == sorted(disk.policy.stored_keys())


def test_a_corrupt_head_on_one_worker_is_recomputed_on_all(
    engines: list[Any], tmp_path: Path
) -> None:
    writer = engine(engines, tmp_path, 1)
    keys = keys_of(3)
    writer.compute([0, 1, 2], seed=7)
    writer.store(keys, [0, 1, 2])
    path = directory(writer) / file_name(keys[1][:-4], HeadGroup(0, HEADS))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last byte is head 1's: what worker 1 of two reads
    path.write_bytes(data)

    reader = engine(engines, tmp_path, 2)
    assert reader.hits(keys) == [True] * 3  # a lookup stats files, reads no payload
    errors, report = reader.load(keys, [8, 9, 10])
    assert errors == {8, 9, 10}  # worker 1's part failed: vLLM recomputes it on both
    assert keys[1][:-4] in report.corrupt_blocks
    assert not path.exists()  # deleted: never offered again
    reader.ctx = ReqContext(req_id="another request")
    assert reader.hits(keys) == [True, False, True]  # block by block, as vLLM asks


def test_an_engine_evicts_only_its_own_files(engines: list[Any], tmp_path: Path) -> None:
    first = engine(engines, tmp_path, 1)
    keys = keys_of(4)
    first.compute([0, 1], seed=1)
    first.store(keys[:2], [0, 1])
    second = engine(engines, tmp_path, 2)
    assert second.hits(keys[:2]) == [True, True]  # adopted by its disk tier
    second.compute([2, 3], seed=2)
    second.store(keys[2:3], [2])  # its own
    second.manager.reset_cache()  # forgets all three
    second.store(keys[3:], [3])  # this job carries the reset's discards to the workers
    folder = directory(first)
    assert [(folder / file_name(k[:-4], HeadGroup(0, HEADS))).exists() for k in keys[:2]] == [
        True,
        True,
    ]
    assert not list(folder.glob(keys[2][:-4].hex() + ".*"))
    assert second.hits(keys[:2]) == [False, False]  # not adopted after a reset


def test_disk_shared_needs_a_layout_kept_by_head(tmp_path: Path) -> None:
    extra = {
        "cpu_bytes_to_use": 1 << 20,
        "disk_path": str(tmp_path),
        "disk_bytes_to_use": 1 << 20,
        "disk_shared": True,
    }
    token = UNDER_KVTIER_CONNECTOR.set(True)
    heads = TOTAL_KV_HEADS.set(3)
    try:
        for layout, why in (
            ("NHD", "layout .this engine's: 'NHD'"),
            ("LBHNC", "KvtierConnector: 3"),
        ):
            with pytest.raises(ValueError, match=r"\['disk_shared'\] is true, but .*" + why):
                KvtierOffloadingSpec(config(extra, tp=2, kv_cache_layout=layout))
        with pytest.raises(ValueError, match="must be true or false, got 'yes'"):
            KvtierOffloadingSpec(config(extra | {"disk_shared": "yes"}))
        no_disk = {"cpu_bytes_to_use": 1 << 20, "disk_shared": True}
        with pytest.raises(ValueError, match="'disk_shared' but no 'disk_path'"):
            KvtierOffloadingSpec(config(no_disk))
    finally:
        TOTAL_KV_HEADS.reset(heads)
        UNDER_KVTIER_CONNECTOR.reset(token)
