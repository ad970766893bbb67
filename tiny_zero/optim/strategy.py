"""The optimizer that every strategy's optim.py builds on.

AdamW over the tensors that the strategy's wrapper says this rank steps
(model.optimizer_params()): all parameters (ddp), this rank's chunks (zero1,
zero2, fsdp) or the tensors it owns (zero3). step() first completes the
step's gradient collectives, and afterwards lets the wrapper do what its
strategy needs (zero1/zero2: all-gather the updated parameters).
"""
from .adamw import AdamW


class StrategyAdamW(AdamW):
    def __init__(self, model, **hyper):
        self.model = model
        super().__init__([{"params": model.optimizer_params()}], **hyper)

    def step(self):
        self.model.finish_grad_sync()
        super().step()
        self.model.after_step()

    def zero_grad(self):
        self.model.zero_grads()
