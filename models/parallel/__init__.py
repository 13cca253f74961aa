"""Tensor parallelism in the model: how weights are cut per rank and the sharded layers."""
