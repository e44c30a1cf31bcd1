"""Reference ports the tests hold kvtier to (benchmarks import them from here too)."""
