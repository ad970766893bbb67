"""Pipeline parallelism: the stages of an nn.Sequential on consecutive ranks, fed micro-batches by GPipe or 1F1B."""
from .wrapper import Pipeline
from .optim import PipelineAdamW

__all__ = ["Pipeline", "PipelineAdamW"]
