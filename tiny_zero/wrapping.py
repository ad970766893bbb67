"""What happens once, when a model is wrapped, and lays out the state the
step reads: the layers swapped for the strategy's, every parameter's name,
shape and index (index_params), the objects the wrapper holds
(model.torch_grads, model.clipping, model.state_dicts, model.joining), and
the empty model.grads and model.shards that the strategy's own __init__
fills in. Wrapping is the base of step.py's Wrapper."""
from functools import partial

import torch

from . import agreements
from .distributed import init_distributed, local_device
from .grads import TorchGrads
from .guards import check_not_wrapped, check_same_model_on_all_ranks
from .hooked import HookedLayer
from .join import Joining
from .module import CallbackLayer, hooked_modules, swap_layers
from .optimizer import Clipping
from .precision import LossScaler, cast_floating_inputs, check_param_dtypes, param_dtype, scale_output
from .state_dicts import StateDicts



class Wrapping:
    """The wrapper's state, set up when wrapping."""

    def __init__(self, module, mixed_precision=None, reduce_dtype=None, loss_scaler=None, device=None):
        super().__init__()
        check_not_wrapped(module)
        check_param_dtypes(module, mixed_precision)
        self.param_dtype = param_dtype(mixed_precision)
        self.reduce_dtype = reduce_dtype or self.param_dtype
        if loss_scaler is not None and mixed_precision != "fp16":
            raise ValueError("loss_scaler is for mixed_precision='fp16' only")
        self.loss_scaler = loss_scaler or (LossScaler() if mixed_precision == "fp16" else None)
        self.rank, self.world_size = init_distributed()
        # data parallelism: this rank's index among the ranks that hold the same
        # parameters (all of them here; a pipeline stage's or a tensor slice's replicas)
        self.replica, self.replicas = self.rank, self.world_size
        self.replica_group = None  # the process group of those ranks (None: the world)
        self.device = torch.device(device) if device is not None else local_device()
        check_same_model_on_all_ranks(module)
        agreements.open_side_channel()
        agreements.agree("the wrapper's settings", wait=False,  # checked before its first collective
                   strategy=agreements.value_hash(type(self).__name__), param_dtype=agreements.value_hash(self.param_dtype),
                   reduce_dtype=agreements.value_hash(self.reduce_dtype), loss_scaler=int(self.loss_scaler is not None))
        swap_layers(module, self.layer_classes)
        module.to(self.param_dtype)
        self.buffers_to_sync = buffers_by_dtype(module) if self.world_size > 1 else []  # (step.py's forward)
        self.sync_buffers = True  # the next forward broadcasts them, as torch DDP's require_forward_param_sync
        if self.param_dtype != torch.float32:
            module.register_forward_pre_hook(cast_floating_inputs(self.param_dtype), with_kwargs=True)
        layers = self.find_layers(module)
        for index, (path, layer) in enumerate(layers):
            layer.__dict__["wrapper"] = self  # a plain attribute, not a submodule
            layer.path, layer.index = path, index
            layer.where_forward, layer.where_backward = f"{path} forward", f"{path} backward"  # comm.where's
            layer.trained = [p for p in layer.parameters(recurse=False) if p.requires_grad]  # read once, as below
            layer.param_indices = []  # their indices in self.buckets: index_params
        self.strategy_layers = [layer for _, layer in layers]  # both ways to the moments, in module order
        self.running = []  # hooked modules running now, whose units stay gathered (hooked.py)
        self.module = module
        self.scale_entered = False  # fp16: the loss scale entered the backward running now (ScaleGrad)
        if self.loss_scaler is not None:
            module.register_forward_hook(partial(scale_output, self))
        self.named_params = list(module.named_parameters())  # tied parameters appear once
        self.name_of = {p: name for name, p in self.named_params}  # looked up when wrapping and in errors, not per step
        self.position = {p: i for i, (_, p) in enumerate(self.named_params)}  # the same
        self.shapes = {name: p.shape for name, p in self.named_params}  # full shapes, before any sharding
        self.trainable = [p for _, p in self.named_params if p.requires_grad]  # read once, here
        self.frozen = [p for _, p in self.named_params if not p.requires_grad]
        self.shards, self.working, self.grads = [], {}, {}  # the strategy fills these in
        self.host = []  # what a rank keeps in host memory, off its device (offload: what the step reads and writes)
        self.buckets = None
        self.require_grad_sync = True
        self.clipping = Clipping(self)  # the clip, and the step's scale of the grads (optimizer.py)
        self.joining = Joining(self)  # what a rank keeps inside torch's Join (join.py)
        self.steps = 0  # optimizer steps taken
        self.backwards = 0  # backward passes since the last step
        self.in_backward = False
        self.used = []  # the layers used in forward since the last backward (their indices)
        self.grads_written = set()  # data_ptr()s of the parts of model.grads that hold an average this step
        self.released_zero = None  # the shared zero of released(), made at its first use
        self.released_views = {}  # parameter -> its released() view of that zero, made once
        self.state_dicts = StateDicts(self)  # state dicts, loads, writes in place (state_dicts.py)
        self.state_dicts.guard_module_state_dicts()  # model.module.state_dict() and load_state_dict()

    def find_layers(self, module):
        """[(path, layer)] in module order: tiny_zero's layers, and for each
        module that trains through hooks, its HookedLayer (hooked.py)."""
        hooked = {id(m): owned for _, m, owned in hooked_modules(module)}
        layers = []
        for path, m in module.named_modules():
            if isinstance(m, CallbackLayer):
                layers.append((path, m))
            elif id(m) in hooked:
                m.__dict__["wrapper"] = self  # wrapped: check_not_wrapped sees it
                layers.append((path or "<root module>", self.layer_classes[HookedLayer](self, m, hooked[id(m)],
                                                                                     whole_pass=m is module)))
        return layers

    def index_params(self, buckets):
        """Called by the strategy once it has cut self.buckets: every
        trainable parameter's index is its place in them (Buckets.index), what
        each layer keeps of its own (layer.param_indices), and where the step's
        per-parameter state lives. From here on a step looks no parameter up
        by its hash."""
        for layer in self.strategy_layers:
            layer.param_indices = buckets.indices(layer.trained)
        self.torch_grads = TorchGrads(self, buckets)  # p.grad's conventions, by these indices (grads.py)
        self.trainable_indices = buckets.indices(self.trainable)  # in self.trainable's order
        # what p.requires_grad must read at each step: True for the parameters the buckets hold
        self.checked = self.trainable + self.frozen
        self.requires = [id(p) in buckets.index for p in self.checked]


def buffers_by_dtype(module):
    """The module's buffers (not on meta), in lists of one dtype each."""
    groups = {}
    for b in module.buffers():
        if not b.is_meta:
            groups.setdefault((b.dtype, b.device), []).append(b)
    return list(groups.values())
