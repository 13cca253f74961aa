"""KV tiers under the prefix cache: host and disk stores, the link to the pool, the flush at stop."""
