"""Expert parallelism: the experts of each sparse MoE block spread over the P
ranks of an expert group; everything else data-parallel over the world.

    ExpertParallel(module, ep_size=P)               # ddp's wrapper for the rest
    ExpertZero2, ExpertZero2AdamW = data_parallel("zero2")   # or "zero1"

The world is P x R ranks. Ranks r*P .. r*P + P-1 are expert group r: the
all-to-alls run there. Every rank has its own batch (as under ddp). The
wrapper converts, in place, every sparse MoE block of the module (Mixtral's
MixtralSparseMoeBlock, example/model.py's MoE: a router "gate" or "router",
3-D expert tensors "gate_up_proj"/"down_proj" or "c_fc"/"c_proj", top_k)
to an ExpertParallelMoE (layers.py), then wraps the module with the
data-parallel wrapper, which sees no expert parameter.

A rank holds: of each MoE block, E/P experts, whole (rank i of an expert
group, experts i*E/P ..); their grads, whole; their AdamW state (optim.py).
The rest as the data-parallel strategy holds it (ddp: all of it).
Collectives: in an expert group, the three all-to-alls of each MoE layer in
forward and two in backward (layers.py); over the world, one all_reduce of
the router's statistics in forward for the auxiliary losses (router.py),
and the data-parallel strategy's collectives for the rest (ddp: an
all_reduce of each bucket of grads during backward); at the end of the
backward pass, one all_reduce of the expert grads over the R ranks that hold
the same experts (ranks i, i+P, ...). Every grad is averaged over the N =
P x R ranks: an expert's grad on its rank already sums the grads of the P
ranks' tokens that reached it, so the R replicas' sum, / N, is the whole
batch's mean.
"""
import sys
from contextlib import ExitStack, contextmanager
from functools import cache

import torch
import torch.nn as nn

from .. import agreements, comm
from ..ddp.optim import DDPAdamW
from ..ddp.wrapper import DDP
from ..distributed import init_distributed
from ..zero1.optim import Zero1AdamW
from ..zero1.wrapper import Zero1
from ..zero2.optim import Zero2AdamW
from ..zero2.wrapper import Zero2
from . import router
from .layers import ExpertParallelMoE, LocalExperts
from .optim import ExpertSteps

LAYOUTS = {("gate_up_proj", "down_proj"): True, ("c_fc", "c_proj"): False}  # expert tensors (up, down): gated
ROUTERS = ("gate", "router")
# a model's auxiliary losses, by the names its MoE block's module gives them: the whole batch's while it runs
LOSSES = {"load_balancing_loss_func": router.load_balancing_loss, "router_z_loss_func": router.router_z_loss}


class ExpertSplit:
    """Expert parallelism, mixed in before a data-parallel wrapper class."""
    defer_step_agreement = False  # the all-to-alls run in forward

    def __init__(self, module, ep_size=None, **options):
        rank, world_size = init_distributed()
        ep_size = world_size if ep_size is None else ep_size
        if options.get("mixed_precision"):
            raise ValueError("expert parallelism trains in fp32: the experts are kept apart from the data-parallel "
                             "wrapper, which would cast the rest. Leave mixed_precision out")
        if not isinstance(ep_size, int) or ep_size < 1 or world_size % ep_size:
            raise ValueError(f"ep_size={ep_size!r} must divide the world size {world_size} (world = ep_size x "
                             "replicas)")
        blocks = find_moe_blocks(module, ep_size)  # every rank raises alike, before any collective
        expert_groups = [agreements.new_group(range(r * ep_size, (r + 1) * ep_size))
                         for r in range(world_size // ep_size)]
        replica_groups = [agreements.new_group(range(i, world_size, ep_size)) for i in range(ep_size)]
        expert_group = next(g for g in expert_groups if g is not None)
        layers = [convert(module, name, block, router_name, rank % ep_size, ep_size, expert_group)
                  for name, block, router_name in blocks]
        super().__init__(module, **options)  # the data-parallel wrapper, over what is not an expert
        self.ep_size, self.ep_rank, self.expert_replicas = ep_size, rank % ep_size, world_size // ep_size
        self.expert_group = expert_group
        self.expert_replica_group = next(g for g in replica_groups if g is not None)
        self.moe_layers = layers
        self.averaged_experts = set()  # expert parameters whose p.grad is an average (a backward's, since zero_grad)
        self.kept_averages = {}  # while a backward adds local grads: expert parameter -> its average before
        for p in (p for layer in layers for p in layer.experts.params()):
            p.data = p.data.to(self.device)
            comm.broadcast(p.data, src=self.ep_rank, group=self.expert_replica_group)  # STRATEGY: replicas start equal
        self.loss_modules = {sys.modules[type(block).__module__] for _, block, _ in blocks}

    def expert_params(self):
        """This rank's expert tensors that train (a frozen one is never sent or stepped)."""
        return [p for layer in self.moe_layers for p in layer.experts.params() if p.requires_grad]

    def forward(self, *args, **kwargs):
        with self.losses_over_the_world():
            return super().forward(*args, **kwargs)

    @contextmanager
    def losses_over_the_world(self):
        """For the module's forward, its auxiliary losses are the whole batch's (router.py)."""
        with ExitStack() as undo:
            for loss_module in self.loss_modules:
                for name, whole_batch_loss in LOSSES.items():
                    if hasattr(loss_module, name):
                        undo.callback(setattr, loss_module, name, getattr(loss_module, name))
                        setattr(loss_module, name, whole_batch_loss)  # STRATEGY: statistics of every rank's tokens
            undo.enter_context(router.over_the_world(self.world_size))
            yield

    def before_backward(self):
        """An expert's averaged grad (no zero_grad since) is set aside: this
        backward's local grads go into a p.grad of their own, averaged at its
        end and added to it, as the averages add up in torch DDP. (Autograd
        reaches the experts after the first layer's backward, which calls
        this: the loss comes after the last MoE layer.)"""
        super().before_backward()
        for p in self.averaged_experts:
            if p.grad is not None:
                self.kept_averages[p], p.grad = p.grad, None
        self.averaged_experts.clear()

    @torch.no_grad()
    def after_backward(self):
        super().after_backward()  # the data-parallel strategy's average of the rest
        params = self.expert_params()
        local = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in local]) / self.world_size
        comm.all_reduce(flat, group=self.expert_replica_group)  # STRATEGY: the experts' grads, over their replicas
        for p, average in zip(params, flat.split([p.numel() for p in params])):
            kept = self.kept_averages.pop(p, None)
            p.grad = average.view_as(p) if kept is None else kept.add_(average.view_as(p))
        self.averaged_experts.update(params)

    # ------------------------------------------------------------ zero_grad, clip, state dicts (torch's conventions)

    def zero_grad(self, set_to_none=True, params=None):
        super().zero_grad(set_to_none, params)
        for p in self.expert_params():
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()
        self.averaged_experts.clear()
        self.kept_averages.clear()

    def grad_square_sum(self):
        square_sum = super().grad_square_sum()
        experts = sum((p.grad.float() ** 2).sum() for p in self.expert_params() if p.grad is not None)
        experts = torch.as_tensor(experts, dtype=torch.float32, device=square_sum.device)
        comm.all_reduce(experts, group=self.expert_group)  # each expert counted once: its replicas agree
        return square_sum + experts

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        total_norm = super().clip_grad_norm_(max_norm)
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for p in self.expert_params():
            if p.grad is not None:
                p.grad.mul_(coef)  # a later backward (no zero_grad) adds to them clipped, as torch's
        return total_norm

    @torch.no_grad()
    def full_state_dict(self, prefix=""):
        """As the data-parallel wrapper's, with every expert gathered from the
        expert group: a collective, every rank calls it."""
        full = super().full_state_dict(prefix)
        for layer in self.moe_layers:
            for name, p in zip(layer.experts.names, layer.experts.params()):
                whole = p.new_empty((self.ep_size * p.shape[0], *p.shape[1:]))
                comm.all_gather(whole, p.detach().contiguous(), group=self.expert_group)
                full[prefix + name] = whole.float().cpu()
        return full

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict=True, assign=False):
        """As the data-parallel wrapper's; of each expert tensor, this rank's experts."""
        rest = dict(state_dict)
        for layer in self.moe_layers:
            for name, p in zip(layer.experts.names, layer.experts.params()):
                key = next((k for k in (name, "module." + name) if k in rest), None)
                if key is None:
                    if strict:
                        raise KeyError(f"load_state_dict: {name} is missing (strict=True)")
                    continue
                mine = rest.pop(key)[layer.experts.first:layer.experts.first + p.shape[0]]
                p.copy_(mine)  # STRATEGY: this rank's experts of the whole tensor
        return super().load_state_dict(rest, strict, assign)

    def pieces_to_save(self):
        raise NotImplementedError("tiny_zero.checkpoint does not save expert-parallel models yet: save "
                                  "model.full_state_dict() (every rank calls it) from rank 0")


def find_moe_blocks(module, ep_size):
    """[(name, block, router name)] of every sparse MoE block in module."""
    blocks = []
    for name, block in module.named_modules():
        experts = getattr(block, "experts", None)
        router_name = next((n for n in ROUTERS if isinstance(getattr(block, n, None), nn.Module)), None)
        if router_name is None or not isinstance(experts, nn.Module) or layout(experts) is None:
            continue
        if not name:
            raise ValueError(f"{type(module).__name__} is itself an MoE block: wrap the model that holds it")
        refuse_other_parts(name, block, router_name)
        count = getattr(experts, layout(experts)[0]).shape[0]
        if count % ep_size:
            raise ValueError(f"{name}: {count} experts do not split over ep_size={ep_size} ranks: give an "
                             "ep_size that divides the number of experts")
        blocks.append((name, block, router_name))
    if not blocks:
        raise ValueError(f"{type(module).__name__} has no sparse MoE block that tiny_zero.experts knows (a "
                         f"router {' or '.join(ROUTERS)}, experts with 3-D tensors {' or '.join(map(str, LAYOUTS))})")
    return blocks


def refuse_other_parts(name, block, router_name):
    """A block converted must be a router, experts and top_k: anything else it
    holds (Qwen-MoE's and DeepSeek's shared experts) the layer would drop."""
    others = [n for n, child in block.named_children()
              if n not in (router_name, "experts") and any(True for _ in child.parameters())]
    others += [n for n, _ in block.named_parameters(recurse=False)]
    if others or not isinstance(getattr(block, "top_k", None), int):
        has = f"also holds {others}" if others else "has no top_k"
        raise ValueError(f"{name} ({type(block).__name__}) {has}: tiny_zero.experts converts a block of a router, "
                         "experts and top_k (Mixtral's), and would drop the rest; train this model under zero3 "
                         "or fsdp, which take any module")


def layout(experts):
    """The names of the expert tensors (up, down), or None."""
    for names in LAYOUTS:
        if all(isinstance(getattr(experts, n, None), nn.Parameter) and getattr(experts, n).dim() == 3
               for n in names):
            return names
    return None


def convert(module, name, block, router_name, ep_rank, ep_size, group):
    """Put an ExpertParallelMoE with this rank's experts in block's place."""
    up_name, down_name = layout(block.experts)
    up, down = getattr(block.experts, up_name), getattr(block.experts, down_name)
    count = up.shape[0]
    mine = slice(ep_rank * count // ep_size, (ep_rank + 1) * count // ep_size)  # STRATEGY: this rank's experts
    prefix = f"{name}.experts." if name else "experts."
    experts = LocalExperts((prefix + up_name, prefix + down_name), up, down, block.experts.act_fn,
                           LAYOUTS[(up_name, down_name)], mine.start, mine.stop - mine.start)
    layer = ExpertParallelMoE(getattr(block, router_name), router_name, experts, count, block.top_k, group,
                              ep_size, getattr(block, "jitter_noise", 0.0))
    layer.train(block.training)
    layer.path = name
    parent_name, _, child = name.rpartition(".")
    setattr(module.get_submodule(parent_name), child, layer)
    return layer


@cache  # one class per strategy: its optimizer takes the wrapper it made
def data_parallel(strategy):
    """(wrapper, optimizer) classes: expert parallelism over a data-parallel
    strategy of tiny_zero.STRATEGIES ("ddp", "zero1", "zero2")."""
    if strategy not in SUPPORTED:
        raise ValueError(f"expert parallelism runs over {', '.join(SUPPORTED)}, not {strategy!r}")
    wrapper_class, adamw_class = SUPPORTED[strategy]
    wrapper = type(f"Expert{wrapper_class.__name__}", (ExpertSplit, wrapper_class), {"__module__": __name__})
    adamw = type(f"Expert{adamw_class.__name__}", (ExpertSteps, adamw_class),
                 {"wrapper": wrapper, "__module__": __name__})
    return wrapper, adamw


SUPPORTED = {"ddp": (DDP, DDPAdamW), "zero1": (Zero1, Zero1AdamW), "zero2": (Zero2, Zero2AdamW)}
