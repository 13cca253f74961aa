"""The executor's KV memory: cache table, prefix cache, pool sizing, block bytes and fingerprints."""
