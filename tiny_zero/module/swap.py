"""Put tiny_zero layers into any nn.Module, keeping its parameters.

A layer is converted by changing its class in place: the object keeps its
parameters, so tied parameters stay tied and state_dict keys do not change.
"""
import torch.nn as nn

from .layers import Embedding, LayerNorm, Linear

SUPPORTED = (nn.Linear, nn.LayerNorm, nn.Embedding)
DEFAULT_CLASSES = {nn.Linear: Linear, nn.LayerNorm: LayerNorm, nn.Embedding: Embedding}


def torch_type(layer):
    """nn.Linear / nn.LayerNorm / nn.Embedding for a supported layer, else None."""
    for base in SUPPORTED:
        if type(layer) is base or (isinstance(layer, base) and type(layer).__module__.startswith("tiny_zero.")):
            return base
    return None


def check_supported(module):
    """Raise if a parameter lives outside Linear/LayerNorm/Embedding.

    Runs locally, before any collective, so every rank raises the same error."""
    for path, layer in module.named_modules():
        own = [name for name, _ in layer.named_parameters(recurse=False)]
        if own and torch_type(layer) is None:
            where = path or "<root module>"
            raise TypeError(
                f"tiny_zero cannot shard parameters {own} of '{where}' ({type(layer).__name__}): "
                f"parameters must live in {', '.join('nn.' + t.__name__ for t in SUPPORTED)}")


def layer_classes(*mixins):
    """A strategy's layers: for each supported torch layer, the tiny_zero layer
    with the mixins' callbacks in front (DDPLayer -> DDPLinear(..., DDPLayer, Linear)),
    named after the last mixin. Returns {torch layer class: that class}, what
    swap_layers() takes."""
    prefix = mixins[-1].__name__.removesuffix("Layer")
    return {base: type(prefix + layer.__name__, (*mixins, layer), {"__module__": mixins[-1].__module__})
            for base, layer in DEFAULT_CLASSES.items()}


def swap_layers(module, classes=None):
    """Convert every supported layer of `module` to classes[torch type], in place."""
    classes = classes or DEFAULT_CLASSES
    check_supported(module)
    for layer in module.modules():
        base = torch_type(layer)
        if base is not None:
            layer.__class__ = classes[base]
    return module
