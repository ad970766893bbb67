"""Tensor parallelism: planned Linears split across a tensor group (Megatron's column and row), replicas averaging grads."""
from .wrapper import TensorParallel
from .optim import TensorParallelAdamW

__all__ = ["TensorParallel", "TensorParallelAdamW"]
