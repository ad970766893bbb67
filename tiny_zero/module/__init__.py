"""Custom autograd layers: the extension point of every strategy."""
from .layers import (CallbackLayer, Conv1D, Embedding, LayerFunction, LayerNorm, Linear, RMSNorm, check_no_grad_hooks,
                     expects_backward, has_grad_hook, in_backward_pass, recorded)
from .swap import DEFAULT_CLASSES, FOREIGN, check_supported, layer_classes, layer_kind, swap_layers

__all__ = ["CallbackLayer", "Conv1D", "Embedding", "LayerFunction", "LayerNorm", "Linear", "RMSNorm",
           "check_no_grad_hooks", "expects_backward", "has_grad_hook", "in_backward_pass", "recorded",
           "DEFAULT_CLASSES", "FOREIGN", "check_supported", "layer_classes", "layer_kind", "swap_layers"]
