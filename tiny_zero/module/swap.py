"""Put tiny_zero layers into any nn.Module, keeping its parameters.

A layer is converted by changing its class in place: the object keeps its
parameters, so tied parameters stay tied and state_dict keys do not change.

Each converted layer has a kind, a key of DEFAULT_CLASSES (the torch layer it
stands for; Conv1D, which torch lacks, is its own kind), and becomes the
tiny_zero layer of that kind. Converted are:
  - nn.Linear, nn.LayerNorm, nn.RMSNorm and nn.Embedding, and their plain
    subclasses: those that keep torch's forward (torch's own
    NonDynamicallyQuantizableLinear, a `class MyLinear(nn.Linear): pass`);
  - classes of other libraries that compute what a tiny_zero layer computes,
    matched by qualified name (FOREIGN), so tiny_zero never imports them.
    The list is a speed path, not a limit: nothing is refused for its class.
A layer of any class but its kind's own gets a class made for it that
subclasses both the tiny_zero layer and its own class: the tiny_zero forward
runs, and isinstance(layer, LlamaRMSNorm) still holds. A FOREIGN class in
FORWARD_AROUND keeps its own forward, which runs around the tiny_zero
layer's: it calls super().forward() (Gemma's embedding scales its result).

Every other module that holds a parameter (Conv2d, BatchNorm, a bare
nn.Parameter, a subclass of Linear with a forward of its own, a LoRA
Linear) keeps its class and its forward: a strategy reaches it through
module hooks (hooked_modules here; tiny_zero/hooked.py), and nothing inside
it is converted.
"""
import functools

import torch.nn as nn

from .layers import Embedding, LayerNorm, Linear
from .more_layers import Conv1D, RMSNorm

TORCH_LAYERS = {nn.Linear: Linear, nn.LayerNorm: LayerNorm, nn.RMSNorm: RMSNorm, nn.Embedding: Embedding}
DEFAULT_CLASSES = {**TORCH_LAYERS, Conv1D: Conv1D}  # Conv1D, which torch lacks, is its own kind


def _rms_norm(layer, eps):
    """What nn.RMSNorm has and Hugging Face's RMSNorm classes lack (they always have a weight)."""
    layer.normalized_shape, layer.eps, layer.elementwise_affine = tuple(layer.weight.shape), eps, True


def _llama_rms_norm(layer):
    """Llama, Qwen2, Qwen3, Mistral: eps in variance_epsilon; y = w · cast(x̂)."""
    _rms_norm(layer, layer.variance_epsilon)
    layer.cast_before_scale = True


def _gemma_rms_norm(layer):
    """Gemma 1 to 3: y = cast(x̂ (1 + w)), the scale in fp32."""
    _rms_norm(layer, layer.eps)
    layer.weight_offset = 1.0


def _t5_layer_norm(layer):
    """T5 (an RMSNorm, as its name does not say): y = w · x̂, x̂ cast to w's dtype
    only where w is fp16 or bf16."""
    _llama_rms_norm(layer)
    layer.cast_to_weight_dtype = True


def _transformers(model, cls):
    return f"transformers.models.{model}.modeling_{model}.{cls}"


# Classes whose own forward runs, around the tiny_zero layer's: each calls
# super().forward() and computes only on its input and on that result (Gemma
# scales it; OPT turns an attention mask into positions). None reads a
# parameter itself, which a strategy holds released outside the layer's forward.
FORWARD_AROUND = [_transformers(model, cls) for model, cls in [
    ("gemma", "GemmaTextScaledWordEmbedding"), ("gemma2", "Gemma2TextScaledWordEmbedding"),
    ("gemma3", "Gemma3TextScaledWordEmbedding"), ("opt", "OPTLearnedPositionalEmbedding")]]

# qualified class name -> (kind, what sets the attributes the tiny_zero layer reads, or None)
FOREIGN = {
    "transformers.pytorch_utils.Conv1D": (Conv1D, None),  # the same nf, nx, weight and bias
    **{_transformers(model, cls): (nn.RMSNorm, _llama_rms_norm) for model, cls in [
        ("llama", "LlamaRMSNorm"), ("qwen2", "Qwen2RMSNorm"), ("qwen3", "Qwen3RMSNorm"),
        ("mistral", "MistralRMSNorm"), ("mixtral", "MixtralRMSNorm"), ("phi3", "Phi3RMSNorm")]},
    **{_transformers(model, cls): (nn.RMSNorm, _gemma_rms_norm) for model, cls in [
        ("gemma", "GemmaRMSNorm"), ("gemma2", "Gemma2RMSNorm"), ("gemma3", "Gemma3RMSNorm")]},
    _transformers("t5", "T5LayerNorm"): (nn.RMSNorm, _t5_layer_norm),
    **{name: (nn.Embedding, None) for name in FORWARD_AROUND},
}


def qualified_name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def layer_kind(layer):
    """The kind (a key of DEFAULT_CLASSES) that swap_layers converts `layer`
    to, or None if it does not convert it."""
    return class_kind(type(layer))


def class_kind(cls):
    """layer_kind of a layer of class `cls`."""
    for kind, ours in DEFAULT_CLASSES.items():
        if cls is kind or issubclass(cls, ours):  # a torch layer, or one converted before
            return kind
    if qualified_name(cls) in FOREIGN:
        return FOREIGN[qualified_name(cls)][0]
    for kind in TORCH_LAYERS:
        if issubclass(cls, kind) and cls.forward is kind.forward:  # a plain subclass
            return kind
    return None


def hooked_modules(module):
    """[(path, m, [(holder, name, parameter)])]: the modules that train through
    module hooks (tiny_zero/hooked.py), in module order. Each holds a parameter
    of its own and is not converted (Conv2d, BatchNorm, a bare nn.Parameter, a
    subclass of Linear with a forward of its own). It owns every parameter of
    its subtree, which its own forward may read (MultiheadAttention reads its
    out_proj's weight): nothing below it is converted. The wrapped module
    itself owns only its own parameters: its forward runs the whole model."""
    converted = {id(p) for m in module.modules() if layer_kind(m) is not None for p in m.parameters(recurse=False)}
    found = []

    def visit(path, m, top):
        if layer_kind(m) is not None:
            return
        if holds_its_own(m, converted):
            holders = [(m, "")] if top else [(inner, name) for name, inner in m.named_modules()]
            owned = [(holder, name, p) for holder, _ in holders
                     for name, p in holder._parameters.items() if p is not None]
            found.append((path, m, owned))
            if not top:
                return
        for name, child in m.named_children():
            visit(f"{path}.{name}" if path else name, child, False)

    visit("", module, True)
    return found


def holds_its_own(module, converted):
    """`module` holds a parameter that no converted layer holds (`converted`:
    their ids; BERT's head keeps an alias of its decoder Linear's bias, which
    it never reads), or is a subclass of a torch layer with a forward of its
    own, which reads its parameters itself (Gemma's embedding, tied to a head)."""
    params = [p for p in module._parameters.values() if p is not None]
    own_forward = any(isinstance(module, kind) for kind in TORCH_LAYERS)  # and not converted: layer_kind is None
    return any(id(p) not in converted for p in params) or (bool(params) and own_forward)


@functools.cache
def adapted_class(ours, original):
    """The class of a layer of class `original` converted to `ours`: both,
    ours first (its forward runs), or, for a class in FORWARD_AROUND, the
    original first (its forward runs, and its super().forward() is ours).
    Made once per pair."""
    bases = (original, ours) if qualified_name(original) in FORWARD_AROUND else (ours, original)
    return type(f"{ours.__name__}_{original.__name__}", bases,
                {"__module__": ours.__module__, "adapted_class": original})


def original_class(layer, kind):
    """The class `layer` had before tiny_zero converted it (its own, if it never was)."""
    if isinstance(layer, DEFAULT_CLASSES[kind]):  # converted before: single device, then a strategy
        return getattr(type(layer), "adapted_class", kind)
    return type(layer)


def swap_layers(module, classes=None):
    """Convert every layer of `module` that tiny_zero supports to classes[its
    kind], in place, but inside the modules that train through hooks
    (hooked_modules), which keep their own forward."""
    classes = classes or DEFAULT_CLASSES
    inside_hooked = {id(inner) for _, m, owned in hooked_modules(module) if m is not module
                     for inner in m.modules()}
    for layer in module.modules():
        kind = layer_kind(layer)
        if kind is None or id(layer) in inside_hooked:
            continue
        original = original_class(layer, kind)
        if original is kind:
            layer.__class__ = classes[kind]
            continue
        layer.__class__ = adapted_class(classes[kind], original)
        adapt = FOREIGN.get(qualified_name(original), (None, None))[1]
        if adapt is not None:
            adapt(layer)
    return module
