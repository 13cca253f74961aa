"""The scheduler process (torch-free): tokenizes, batches continuously over executors, streams to clients."""
