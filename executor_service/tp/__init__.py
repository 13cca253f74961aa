"""Tensor-parallel executors: launch, the control channel, rank 0's leader and the worker ranks."""
