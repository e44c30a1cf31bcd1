"""Trace readers, workload generators, the replay loop, bounds and metrics."""
