"""Benchmarks: each writes JSON to benchmarks/results/, its baseline measured in the same run."""
