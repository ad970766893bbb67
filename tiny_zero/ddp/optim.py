"""DDPAdamW: every rank steps every parameter with the same averaged grads,
so the replicas stay identical with no further communication."""
from ..optim import AdamW


class DDPAdamW(AdamW):
    def __init__(self, model, **hyper):
        self.model = model
        super().__init__([p for _, p in model.named_params], **hyper)

    def step(self, closure=None):
        self.model.finish_grad_sync()
        return super().step(closure)

    def zero_grad(self):
        self.model.zero_grads()  # grads stay views into the bucket buffer
