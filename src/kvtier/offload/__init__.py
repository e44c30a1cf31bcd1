"""Scheduler-side bookkeeping for offload tiers (no bytes move here)."""
