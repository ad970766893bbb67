"""TensorParallelAdamW: every rank steps what it holds (one flat buffer: its
slices of the planned Linears, the other parameters whole) with the grads
averaged over the replicas. The ranks that hold the same parameter make the
same update, so nothing is sent after the step."""
from ..optimizer import StrategyAdamW
from .wrapper import TensorParallel


class TensorParallelAdamW(StrategyAdamW):
    wrapper = TensorParallel
