"""Batching policies: the memory-budget sliding window (ARCHITECTURE §1, §3)."""
