"""torch's Join, for uneven inputs (a first reader may skip this file).

    with torch.distributed.algorithms.Join([model]):
        for x, y in batches:        # some ranks have fewer
            loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

A rank that has run out of batches shadows the iterations of the ranks still
training, until every rank has run out, as under torch DDP. Each time they
start a forward (Join.notify_join_context, in Wrapper.forward: one
all-reduce, inside Join only), it runs one iteration of its own on its last
batch, whose grads are zeros: its collectives meet theirs (zero3 and fsdp's
gathers, the ranks' agreements, each bucket's collective, the clip's
all-reduce where its own last step clipped, zero1, zero2 and offload's
all-gather after the step), and its zeros add nothing to their sums. It steps
as they do, with the same averaged grads, so every rank holds the same
parameters and optimizer state afterwards. (torch DDP's joined rank steps
nothing, and its post_hook gives it the last joiner's parameters at the end:
the same parameters.)

Each rank's grads are divided by the initial world size, as torch DDP's
under Join's default, divide_by_initial_world_size=True; with False, by the
number of ranks still training (read from the notifying all-reduce). The
loop must run one forward, backward and optimizer step per batch (a clip
too, or not): a shadowing rank runs that, once per forward of the others.
"""
import torch
from torch.distributed.algorithms.join import Join, JoinHook
from torch.utils._pytree import tree_leaves


class Joining(JoinHook):
    """Held by Wrapper as model.joining: what a rank keeps inside torch's Join,
    and the JoinHook (model.join_hook) that shadows the others' iterations
    once it ran out. Outside a Join the wrapper only reads whether one is on
    (model._join_config.enable, which torch's Joinable sets)."""

    def __init__(self, model):
        self.model = model
        self.inputs = None  # inside Join: the last forward's (args, kwargs), for a shadowed iteration
        self.clip = None  # inside Join: max_norm of the last iteration's clip, None if it did not clip
        self.optimizer = None  # inside Join: the optimizer of the last step
        self.divide_by_initial_world_size = True

    def hook(self, divide_by_initial_world_size):
        self.divide_by_initial_world_size = divide_by_initial_world_size
        return self

    def notify(self, args, kwargs):
        """A forward inside Join, on a rank still training: tell the ranks
        that ran out (their shadowed iteration starts), and keep the batch and
        reset the clip seen, for this rank's own shadowing later."""
        work = Join.notify_join_context(self.model)
        self.inputs, self.clip = (args, kwargs), None
        if work is not None and not self.divide_by_initial_world_size:
            work.wait()
            self.model.buckets.average_over = int(work.result()[0].item())  # the ranks still training

    def main_hook(self):
        """One iteration on a rank that ran out: the last batch's forward, a
        backward with zero grads, the last step's clip, the step."""
        if self.inputs is None or self.optimizer is None:
            raise RuntimeError("torch's Join: this rank ran out of batches before its first optimizer step, so "
                               "it has no iteration to shadow the others' with; give every rank at least one batch")
        args, kwargs = self.inputs
        with torch.enable_grad():
            out = self.model.module(*args, **kwargs)  # not model(...): this rank does not notify
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.backward(outputs, [torch.zeros_like(t) for t in outputs])  # adds nothing to the sums
        if self.clip is not None:
            self.model.clip_grad_norm_(self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def post_hook(self, is_last_joiner):
        self.model.buckets.average_over = self.model.replicas
        self.inputs = self.clip = self.optimizer = None
