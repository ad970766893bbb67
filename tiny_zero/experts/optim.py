"""The optimizer of an expert-parallel model: the data-parallel strategy's
AdamW for the rest, and an AdamW over this rank's experts, whole (their grads
are averaged over the ranks holding them at the end of backward, so the
replicas make the same update). Nothing is sent after the step. The
optimizer's state_dict is this rank's, as the strategy's is: the rest's
state, and under "experts" this rank's experts' AdamW state."""
from ..optim import AdamW

HPARAMS = ("lr", "betas", "eps", "weight_decay")


class ExpertSteps:
    """Mixed in before a data-parallel strategy's AdamW (wrapper.data_parallel).
    The experts are one group that follows the first param group's lr,
    betas, eps and weight decay at every step (lr schedulers too)."""

    def __init__(self, model, params=None, **hparams):
        super().__init__(model, params, **hparams)
        self.expert_adamw = AdamW(model.expert_params(), **{k: self.param_groups[0][k] for k in HPARAMS})

    def step(self, closure=None):
        loss = super().step(closure)
        first = self.param_groups[0]
        for group in self.expert_adamw.param_groups:
            group.update({k: first[k] for k in HPARAMS})
        self.expert_adamw.step()  # STRATEGY: this rank's experts, whole
        return loss

    def state_dict(self):
        return {**super().state_dict(), "experts": self.expert_adamw.state_dict()}

    def load_state_dict(self, state_dict):
        rest = dict(state_dict)
        if "experts" not in rest:
            raise ValueError("this optimizer state has no 'experts' entry: it was not saved by an expert-parallel "
                             "optimizer, or it was saved without its experts' AdamW state")
        self.expert_adamw.load_state_dict(rest.pop("experts"))
        super().load_state_dict(rest)
