"""Tensor parallelism: the process group the model's sharded layers reduce over."""
