"""What crosses the wire between two stages. A stage's output is a tensor or
any nesting of tuples, lists and dicts of tensors (hidden states with an
attention mask and position ids, say); None may stand in it too.

    flatten(out)   the tensors, in order, and the structure around them
    Layout         the structure, and each tensor's dtype, shape and whether
                   its grad goes back: a floating tensor that requires grad
                   carries its grad backward; an integer or bool tensor, or
                   one that needs no grad, goes forward only

The next stage must know the layout before it can make room for the tensors.
The stage sends it (pickled, as bytes) before the first micro-batch of each
new shape of the pipeline's input (the micro-batch of x, which every rank of
a replica is given): then only the tensors, with no header, until the input's
shape changes. A stage whose output layout changes while its input's shape
does not raises (layout_for).
"""
import pickle
from collections import namedtuple

import torch

# structure: a tensor's index in the flat list, None, or (kind, children) with
# kind "tuple", "list" or "dict" (children of a dict: (key, child) pairs).
# tensors: (dtype, shape, carries a grad back) for each tensor, in order.
Layout = namedtuple("Layout", "structure tensors")


def flatten(value, tensors, where="output"):
    """The structure of `value`; its tensors appended to `tensors` in order."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return len(tensors) - 1
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return (type(value).__name__ if type(value) is list else "tuple",
                [flatten(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)])
    if isinstance(value, dict):
        return ("dict", [(k, flatten(v, tensors, f"{where}[{k!r}]")) for k, v in value.items()])
    raise TypeError(f"{where} is a {type(value).__name__}: a stage passes tensors (or None), in any nesting of "
                    "tuples, lists and dicts, to the next")


def unflatten(structure, tensors):
    """flatten's inverse: the value, with tensors[i] where the structure says i."""
    if structure is None:
        return None
    if isinstance(structure, int):
        return tensors[structure]
    kind, children = structure
    if kind == "dict":
        return {k: unflatten(child, tensors) for k, child in children}
    values = [unflatten(child, tensors) for child in children]
    return values if kind == "list" else tuple(values)


def layout_of(value, where):
    """(the tensors of `value`, its Layout)."""
    tensors = []
    structure = flatten(value, tensors, where)
    return tensors, Layout(structure, tuple((t.dtype, tuple(t.shape), carries_grad(t)) for t in tensors))


def carries_grad(tensor):
    return tensor.is_floating_point() and tensor.requires_grad


def encode(layout, device):
    """The layout as two messages: its length, then its bytes."""
    data = torch.frombuffer(bytearray(pickle.dumps(layout)), dtype=torch.uint8).to(device)
    return torch.tensor([data.numel()], dtype=torch.int64, device=device), data


def decode(data):
    return pickle.loads(data.cpu().numpy().tobytes())


def empty_like_layout(layout, device):
    """Room for the tensors of a message of this layout."""
    return [torch.empty(shape, dtype=dtype, device=device) for dtype, shape, _ in layout.tensors]


def on_the_wire(tensors):
    """What is sent of these tensors: each non-empty one, contiguous (a view,
    a transpose's output, is copied: point-to-point sends whole storage runs)."""
    return [t.detach().contiguous() for t in tensors if t.numel()]


def grad_of(tensor):
    """The grad sent back for a received tensor: zeros where the stage did not use it."""
    return tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
