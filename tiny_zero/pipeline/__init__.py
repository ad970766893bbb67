"""Pipeline parallelism: the stages of an nn.Sequential on consecutive ranks, fed micro-batches by GPipe or 1F1B;
pipeline_stages cuts a Hugging Face decoder model into such stages."""
from .wrapper import Pipeline
from .optim import PipelineAdamW
from .stages import pipeline_stages

__all__ = ["Pipeline", "PipelineAdamW", "pipeline_stages"]
