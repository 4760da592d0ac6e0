"""KV cache tiers (ARCHITECTURE §4): snapshots of a sequence's KV state and the tier policy that places them."""
