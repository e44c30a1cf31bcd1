"""The curated public surface of `kvtier.sim` and `kvtier.connector` resolves, and the
docstring example runs."""

from __future__ import annotations

import kvtier.connector
import kvtier.sim


def test_every_exported_name_exists() -> None:
    for module in (kvtier.sim, kvtier.connector):
        for name in module.__all__:
            assert getattr(module, name) is not None, name


def test_docstring_example_on_the_generated_workload() -> None:
    from kvtier.sim import ReplayConfig, generate_workload, replay

    result = replay(generate_workload().limited(100), ReplayConfig("lru", cpu_frac=0.05))
    assert 0 < result.prefix_hit_rate <= result.hit_rate < 1
    assert [t.name for t in result.tiers] == ["cpu"]
