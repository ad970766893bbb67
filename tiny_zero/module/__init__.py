"""Custom autograd layers: the extension point of every strategy."""
from .layers import CallbackLayer, Embedding, LayerFunction, LayerNorm, Linear, expects_backward, in_backward_pass
from .swap import SUPPORTED, check_supported, layer_classes, swap_layers, torch_type

__all__ = ["CallbackLayer", "Embedding", "LayerFunction", "LayerNorm", "Linear", "expects_backward",
           "in_backward_pass",
           "SUPPORTED", "check_supported", "layer_classes", "swap_layers", "torch_type"]
