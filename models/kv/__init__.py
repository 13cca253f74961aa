"""The paged KV cache: its pools, the block allocator, and KV dtypes."""
