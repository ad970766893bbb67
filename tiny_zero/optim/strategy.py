"""The optimizer that every strategy's optim.py builds on.

AdamW over the tensors that the strategy's wrapper says this rank steps
(model.optimizer_params()): all parameters (ddp), this rank's chunks (zero1,
zero2, fsdp) or the tensors it owns (zero3), with the averaged grads the
wrapper keeps for them (model.grads_of). step() first completes the step's
gradient collectives; under fp16 it skips the step on every rank if any
rank's grads overflowed; it unscales and clips inside the AdamW update; and
afterwards it lets the wrapper do what its strategy needs (zero1/zero2:
all-gather the updated parameters).
"""
import logging

from .adamw import AdamW

log = logging.getLogger("tiny_zero")


class StrategyAdamW(AdamW):
    wrapper = None  # the wrapper class this optimizer belongs to, set by each strategy

    def __init__(self, model, **hyper):
        if not isinstance(model, self.wrapper):
            raise TypeError(f"{type(self).__name__} steps a {self.wrapper.__name__}-wrapped model, "
                            f"got {type(model).__name__}: use the optimizer of the model's strategy "
                            "(tiny_zero.STRATEGIES[name])")
        self.model = model
        super().__init__([{"params": model.optimizer_params()}], **hyper)
        model.optimizer = self  # the wrapper reads the fp32 masters from here
        self.skipped_steps = 0

    @property
    def loss_scale(self):
        return self.model.loss_scale()

    def grad_of(self, param):
        return self.model.grads_of.get(param)

    def step(self):
        model = self.model
        model.finish_grad_sync()
        overflow = model.found_overflow()
        if model.loss_scaler is not None:
            model.loss_scaler.update(overflow)
        if overflow:
            self.skipped_steps += 1  # every rank skips: the params stay as they are
            if model.rank == 0:
                log.warning("fp16 gradient overflow: step skipped (%d so far), loss scale now %g",
                            self.skipped_steps, model.loss_scale())
        else:
            self.grad_scale = model.grad_scale()  # 1/loss scale x clip coefficient
            super().step()
            model.after_step()
        model.clip_coef = 1.0

    def zero_grad(self):
        self.model.zero_grads()
