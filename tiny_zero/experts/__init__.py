"""Expert parallelism: each MoE block's experts spread over an expert group; tokens sent to them by all-to-all."""
from .layers import ExpertParallelMoE
from .router import load_balancing_loss, route, router_z_loss
from .wrapper import ExpertSplit, data_parallel

ExpertParallel, ExpertParallelAdamW = data_parallel("ddp")

__all__ = ["ExpertParallel", "ExpertParallelAdamW", "ExpertParallelMoE", "ExpertSplit", "data_parallel",
           "load_balancing_loss", "route", "router_z_loss"]
