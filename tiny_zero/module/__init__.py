"""Custom autograd layers: the extension point of every strategy."""
from .hooks import has_grad_hook, run_grad_hooks
from .layers import (CallbackLayer, Embedding, LayerFunction, LayerNorm, Linear, expects_backward, in_backward_pass,
                     recorded)
from .more_layers import Conv1D, RMSNorm
from .swap import DEFAULT_CLASSES, FOREIGN, hooked_modules, layer_kind, swap_layers

__all__ = ["CallbackLayer", "Conv1D", "Embedding", "LayerFunction", "LayerNorm", "Linear", "RMSNorm",
           "expects_backward", "has_grad_hook", "in_backward_pass", "recorded", "run_grad_hooks",
           "DEFAULT_CLASSES", "FOREIGN", "hooked_modules", "layer_kind", "swap_layers"]
