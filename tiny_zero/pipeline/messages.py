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

PointToPoint, mixed into Pipeline: a stage's sends and receives of these
tensors, posted together with its neighbours' (exchange).
"""
import pickle
from collections import namedtuple

import torch

from .. import comm

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


class PointToPoint:
    """Pipeline's sends and receives of activations between neighbour stages, mixed into Pipeline."""

    def send_activation(self, out):
        """Queued, to go with the next action's receive: the tensors of the
        output, after its layout where the next stage has not had it for
        inputs of this shape (messages.py). Returns the tensors whose grads
        come back."""
        tensors, layout = layout_of(out, f"stage {self.stage}'s output")
        known, next_stage = self.sent_layouts.get(self.input_key), self.rank_of(self.stage + 1)
        if known is None:
            self.sent_layouts[self.input_key] = layout
            self.outbox += [(t, next_stage) for t in encode(layout, self.device)]
        elif known != layout:
            raise ValueError(f"stage {self.stage}'s output changed from {known.tensors} to {layout.tensors} "
                             "for inputs of the same shapes: the next stage learns an output's shapes once per "
                             "shape of the input micro-batch, so they must follow from it")
        self.outbox += [(t, next_stage) for t in on_the_wire(tensors)]  # STRATEGY: the activations, forward
        return [t for t in tensors if carries_grad(t)]

    def receive_activation(self):
        """The previous stage's output, and the received tensors whose grads go back."""
        previous = self.rank_of(self.stage - 1)
        layout = self.received_layouts.get(self.input_key)
        if layout is None:  # a new shape: its layout comes first
            size = self.receive(torch.empty(1, dtype=torch.int64, device=self.device), previous)
            layout = decode(self.receive(torch.empty(int(size), dtype=torch.uint8, device=self.device), previous))
            self.received_layouts[self.input_key] = layout
        tensors = empty_like_layout(layout, self.device)
        self.exchange([(t, previous) for t in tensors if t.numel()])  # STRATEGY: the previous stage's output
        for t, (_, _, carries) in zip(tensors, layout.tensors):
            t.requires_grad_(carries)
        return unflatten(layout.structure, tensors), [t for t in tensors if t.requires_grad]

    def receive_grads(self, outs, grads):
        """The grads of the output tensors that carry one, from the next stage;
        returns (outs, grads) of those a later stage read. Which it read comes
        after the grads, once per shape of the input (send_grads)."""
        next_stage = self.rank_of(self.stage + 1)
        read = self.received_reads.get(self.input_key)
        flags = torch.empty(len(outs) if read is None else 0, dtype=torch.uint8, device=self.device)
        self.exchange([(g, next_stage) for g in grads + [flags] if g.numel()])  # STRATEGY: d loss / d out
        if read is None:
            read = self.received_reads[self.input_key] = [bool(f) for f in flags.tolist()]
        kept = [(t, g) for t, g, r in zip(outs, grads, read) if r]
        return [t for t, _ in kept], [g for _, g in kept]

    def send_grads(self, inputs):
        """The grads of the received tensors that carry one, back (zeros where
        none came), and which of them got one (this stage or a later one read
        it), once per shape of the input: the stage before runs its backward
        from those only, so a parameter that feeds nothing read gets no grad
        (None: AdamW skips it, as in torch), not zeros."""
        read = [x.grad is not None for x in inputs]
        known = self.sent_reads.setdefault(self.input_key, read)
        if known != read:
            raise ValueError(f"stage {self.stage} read {read} of its inputs, where it read {known} for inputs of "
                             "the same shapes: the stage before learns which once per shape of the input micro-batch")
        back = [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs]
        if known is read and inputs:  # the first backward of this shape: setdefault kept this list
            back.append(torch.tensor(read, dtype=torch.uint8, device=self.device))
        self.outbox += [(g, self.rank_of(self.stage - 1)) for g in on_the_wire(back)]  # STRATEGY: d loss / d inputs

    def receive(self, tensor, src):
        """Receive `tensor` from rank src, posted with what the last action made."""
        self.exchange([(tensor, src)])
        return tensor

    def exchange(self, recvs=()):
        """Post the sends queued by the last action with this action's
        receives (one NCCL group: see comm.exchange), and wait for the
        receives. The sends of the action before are waited for first: their
        receivers have posted the receives by now, so at most one action's
        sent tensors are held."""
        for pending in self.sending:
            pending.wait()
        self.sending, received = comm.exchange(self.outbox, recvs)  # STRATEGY: to and from the neighbours
        self.outbox = []
        for pending in received:
            pending.wait()
