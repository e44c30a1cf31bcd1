"""The built-in workload: reproducible, chained, and shaped as documented."""

from __future__ import annotations

import pytest

from kvtier.sim.bounds import infinite_hits
from kvtier.sim.generator import GeneratorConfig, generate_workload


def test_same_seed_same_workload_other_seed_differs() -> None:
    config = GeneratorConfig(num_requests=200)
    a, b = generate_workload(config, seed=3), generate_workload(config, seed=3)
    assert a.requests == b.requests
    assert generate_workload(config, seed=4).requests != a.requests


def test_requests_sorted_and_counted() -> None:
    workload = generate_workload(GeneratorConfig(num_requests=300), seed=1)
    times = [r.timestamp for r in workload.requests]
    assert len(times) == 300 and times == sorted(times)
    for r, ids in zip(workload.requests, workload.block_ids, strict=True):
        assert r.input_length == len(ids) * workload.block_size


def test_ids_are_chained_prefixes() -> None:
    """Equal ids at a position imply equal ids at every earlier position."""
    workload = generate_workload(GeneratorConfig(num_requests=400), seed=2)
    prefix_of: dict[int, tuple[int, ...]] = {}
    for ids in workload.block_ids:
        for i, b in enumerate(ids):
            assert prefix_of.setdefault(b, ids[:i]) == ids[:i]
    hits, prefix_hits = infinite_hits(workload.block_ids)
    assert hits == prefix_hits > 0


def test_mix_shapes_reuse() -> None:
    """Documents only: nothing is reused. Chats only: system prompts are shared."""
    docs = generate_workload(GeneratorConfig(num_requests=50, mix=(0, 0, 1)), seed=0)
    assert infinite_hits(docs.block_ids) == (0, 0)
    chats = generate_workload(GeneratorConfig(num_requests=200, mix=(1, 0, 0)), seed=0)
    assert infinite_hits(chats.block_ids)[0] > 0.5 * chats.block_refs


@pytest.mark.parametrize(
    "kwargs", [{"num_requests": 0}, {"mix": (0.0, 0.0, 0.0)}, {"mix": (1.0, -1.0, 1.0)}]
)
def test_bad_config_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        GeneratorConfig(**kwargs)  # type: ignore[arg-type]


def test_the_first_n_requests_do_not_depend_on_how_many_are_generated() -> None:
    """The CLI generates only --limit requests (issue 15 item 8): the same ones."""
    from kvtier.sim.generator import GeneratorConfig, generate_workload

    for seed in (0, 3):
        many = generate_workload(GeneratorConfig(num_requests=2000), seed).limited(37)
        few = generate_workload(GeneratorConfig(num_requests=37), seed)
        assert (many.requests, many.block_ids) == (few.requests, few.block_ids)
