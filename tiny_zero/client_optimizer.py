"""A script's own optimizer, as DeepSpeed takes it: initialize(optimizer=torch.optim.AdamW(groups, lr=...)).

DeepSpeed wraps the client's optimizer in its ZeRO optimizer, which steps each
shard with the client's update. tiny_zero's strategies step their own sharded
AdamW, so the client's param groups and hyper-parameters are taken into it:
torch.optim.AdamW, and torch.optim.Adam without weight decay (Adam's decay is
L2, added to the grads, which tiny_zero's AdamW does not do). Any other class
is refused by name: its update is not AdamW's, and tiny_zero has no sharded
version of it.
"""
import torch

TAKEN = (torch.optim.AdamW, torch.optim.Adam)
# torch.optim's options of how the update is computed, not what it computes; refused where they would change it
HOW = ("foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")


def take_client_optimizer(client, params):
    """(the client's optimizer, defaults, param groups) for the strategy's AdamW: from an instance, or from
    DeepSpeed's callable that builds one from the model's parameters. Every group, in order, as a schedule
    built on the client's optimizer counts them."""
    if callable(client) and not isinstance(client, torch.optim.Optimizer):
        client = client(params)
    name = f"{type(client).__module__}.{type(client).__name__}"
    if type(client) not in TAKEN:  # the exact class: a subclass may step otherwise
        raise ValueError(f"tiny_zero.initialize: the client optimizer {name} is not supported: tiny_zero's "
                         "strategies step their own sharded AdamW. Pass torch.optim.AdamW or torch.optim.Adam, or "
                         "leave optimizer=None and put {\"type\": \"AdamW\"} in the config's \"optimizer\"")
    if client.state:
        raise ValueError(f"tiny_zero.initialize: the client optimizer {name} has taken steps already; its moments "
                         "would not carry over. Pass it before its first step")
    groups = [group_of(group, client, name) for group in client.param_groups]
    return client, {k: client.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}, groups


def group_of(group, client, name):
    """One param group of the client's, as the strategy's AdamW takes it (its own keys kept: "initial_lr"
    from a schedule built on the client's optimizer, a name)."""
    adam = type(client) is torch.optim.Adam and not group.get("decoupled_weight_decay", False)
    if adam and group["weight_decay"] != 0:
        raise ValueError(f"tiny_zero.initialize: the client optimizer {name} has weight_decay "
                         f"{group['weight_decay']}, which torch's Adam adds to the grads (L2); tiny_zero's AdamW "
                         "decays decoupled: use torch.optim.AdamW, or weight_decay 0")
    for option in ("amsgrad", "maximize"):
        if group.get(option):
            raise ValueError(f"tiny_zero.initialize: the client optimizer {name} sets {option}=True, which "
                             "tiny_zero's AdamW does not do")
    return {k: v for k, v in group.items() if k not in HOW + ("amsgrad", "maximize")}


def rebind_scheduler(scheduler, client, optimizer):
    """A schedule built on the client's optimizer (DeepSpeed's lr_scheduler= object) sets the lr of
    the strategy's AdamW instead, which holds the client's groups in the same order."""
    if getattr(scheduler, "optimizer", None) is not client:
        raise ValueError("tiny_zero.initialize: the lr_scheduler object must be built on the optimizer= passed "
                         "with it (or pass a callable that takes the optimizer)")
    scheduler.optimizer = optimizer
    return scheduler
