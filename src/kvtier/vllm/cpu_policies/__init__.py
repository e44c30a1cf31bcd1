"""kvtier's eviction policies inside vLLM's own CPU offloading tier
(`"eviction_policy": "kvtier_<policy>"`, `"cache_policy_module_path": "kvtier.vllm"`)."""
