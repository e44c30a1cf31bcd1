"""The shared remote tier: KV blocks in Redis, reused across engine instances."""
