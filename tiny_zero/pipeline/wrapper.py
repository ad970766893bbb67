"""Pipeline parallelism: the children of an nn.Sequential cut into S stages,
one per rank, each running every micro-batch of a step in the order of a
schedule, GPipe's or 1F1B's (schedule.py). With W = S × R ranks, R replicas
of the pipeline train side by side: stage = rank // R, replica = rank % R;
each stage is data parallel over its replicas, as DDP is over the world.

A rank holds: its stage's parameters, in one flat buffer (flat_params; the
other stages' are never materialised here), their grads in a flat buffer of
the same layout cut into buckets, and their optimizer state; during a step,
the input and the saved activations of each micro-batch from its forward to
its backward (how many at once is what the schedule decides). A parameter
that several stages hold (a tied embedding and head) is owned by the first of
them: only there is it stepped and saved; the others keep a copy at the end
of flat_params, outside what the optimizer steps.
Collectives:
- per micro-batch, point to point with the neighbour stages: the tensors of
  its output to the next stage after its forward (a tensor, or tuples and
  dicts of them; their layout first, once per input shape: messages.py), the
  grads of the received tensors that carry one to the previous stage after
  its backward (and, once per input shape, which of them got a grad). A stage posts what its last action made together with what
  its next one needs (comm.exchange), and waits only to receive.
- in the last micro-batch's backward, all_reduce of each bucket of grads
  among the stage's replicas, as soon as it is final (layers.py); at the end,
  the waits and the division by R.
- a tied parameter's grad goes to its owner, which adds it to its own before
  the step (after_backward); after the step the owner sends the new value back
  (sync_params).
- per step: the agreement on it (agreements.agree over the world) and one scalar
  all_reduce of the loss.
"""
from itertools import accumulate

import torch

from .. import agreements, comm, holding
from ..buckets import DEFAULT_BUCKET_BYTES, Buckets, buckets_from_runs, make_buckets
from ..distributed import init_distributed
from ..precision import ScaleGrad
from ..step import Wrapper
from .layers import LAYER_CLASSES
from .messages import PointToPoint, flatten, unflatten
from .schedule import FORWARD, SCHEDULES
from .stages import stage_sizes


class Pipeline(PointToPoint, Wrapper):
    layer_classes = LAYER_CLASSES
    params_whole_between_steps = False  # the parameters: only this stage's

    def __init__(self, seq, loss_fn, microbatches=4, schedule="1f1b", stages=None, balance=None,
                 bucket_bytes=DEFAULT_BUCKET_BYTES, **options):
        world = init_distributed()[1]
        stages = world if stages is None else stages
        counts = stage_sizes(seq, loss_fn, microbatches, schedule, stages, balance, world)  # every rank raises alike
        super().__init__(seq, **options)  # options: mixed_precision, reduce_dtype, loss_scaler, device
        self.loss_fn, self.microbatches, self.stages = loss_fn, microbatches, stages
        self.replicas = world // stages
        self.stage, self.replica = divmod(self.rank, self.replicas)
        self.first, self.last = self.stage == 0, self.stage == stages - 1
        self.actions = SCHEDULES[schedule](stages, microbatches, self.stage)
        agreements.agree("the pipeline", stages=stages, microbatches=microbatches,
                   schedule=list(SCHEDULES).index(schedule), balance=agreements.value_hash(counts))
        groups = [agreements.new_group(range(s * self.replicas, (s + 1) * self.replicas)) for s in range(stages)]
        self.replica_group = groups[self.stage]
        ends = list(accumulate(counts))
        children = [list(seq)[end - n:end] for n, end in zip(counts, ends)]
        self.layers = children[self.stage]
        held = [{p for child in run for p in child.parameters()} for run in children]
        self.holders = {p: [s for s in range(stages) if p in held[s]] for _, p in self.named_params}
        self.hold(held[self.stage], bucket_bytes)
        self.syncs_this_backward = False  # True in the last micro-batch's backward: buckets are sent as they fill
        # {the shapes of an input micro-batch: the Layout of what this stage sent or received for it}
        self.sent_layouts, self.received_layouts = {}, {}
        self.sent_reads, self.received_reads = {}, {}  # the same keys: which tensors a later stage read

    def hold(self, mine, bucket_bytes):
        """Materialise this stage's parameters only: a flat buffer as DDP's,
        its own parameters first (the shard the optimizer steps), then the
        copies of tied parameters that an earlier stage owns."""
        for _, p in self.named_params:
            if p not in mine:
                holding.set_data(self, p, holding.released(self, p))  # STRATEGY: another stage's: none here
        self.trainable = [p for p in self.trainable if p in mine]
        self.frozen = [p for p in self.frozen if p in mine]
        self.tied = [p for _, p in self.named_params if p in mine and len(self.holders[p]) > 1]
        own = [p for p in self.trainable if self.owns(p)]
        copies = [p for p in self.trainable if not self.owns(p)]
        runs = [b.params for b in make_buckets(own[::-1], bucket_bytes)]  # backward runs the last layer first
        buckets = buckets_from_runs(runs + ([copies] if copies else []))
        self.own_buckets = buckets[:len(runs)]
        self.flat_params = holding.flatten_params(self, buckets, own + copies)  # the stage's first replica's values
        holding.keep_whole(self, self.frozen)
        self.flat_grads = torch.zeros_like(self.flat_params, dtype=self.reduce_dtype)
        self.buckets = Buckets(buckets, self.reduce_dtype, self.device, flat=self.flat_grads,
                               average_over=self.replicas)  # STRATEGY: each bucket / R, before it is sent
        self.index_params(self.buckets)  # each trainable parameter's place in them (wrapping.py)
        stepped = sum(b.numel for b in self.own_buckets)
        self.shards = holding.fp32_shards(self, [self.flat_params[:stepped]])
        self.grads = {self.shards[0]: self.flat_grads[:stepped]}
        self.send_tied(self.tied)  # every holder starts from the owner's values

    def owns(self, param):
        return self.holders[param][0] == self.stage

    def rank_of(self, stage, replica=None):
        """The rank of `stage` in this rank's replica (or in `replica`)."""
        return stage * self.replicas + (self.replica if replica is None else replica)

    # ------------------------------------------------------------ one step

    def train_step(self, x, y):
        """Forward and backward of every micro-batch of (x, y) in the
        schedule's order; then, as after loss.backward() on the whole batch,
        grads averaged over the replicas and p.grad set. x and y: this
        replica's batch, on every rank (the first stage reads x, the last y).
        Returns the mean loss over micro-batches and replicas (a float, the
        same on every rank)."""
        self.run(self.actions, x, y, "train_step")
        self.backward_done()  # as at the end of a backward pass: after_backward(), then p.grad
        return self.mean_loss()

    @torch.no_grad()
    def eval_step(self, x, y):
        """Forward only, micro-batch after micro-batch; the mean loss on every rank."""
        self.run([(FORWARD, m) for m in range(self.microbatches)], x, y, "eval_step")
        return self.mean_loss()

    def run(self, actions, x, y, what):
        """Run this stage's actions (schedule.py), in order."""
        self.micro_batches(x, y, what)
        self.saved, self.outbox, self.sending, self.losses = {}, [], [], []
        self.syncs_this_backward = False
        for kind, m in actions:
            comm.where = f"stage {self.stage}, {what} {kind}{m}"
            if kind == FORWARD:
                self.forward_step(m)
            else:
                self.backward_step(m)
        self.exchange()  # the last action's sends
        for pending in self.sending:
            pending.wait()
        self.sending = []

    def micro_batches(self, x, y, what):
        """Check the batch (on every rank, before any collective: each has the
        same x and y), agree on the step, cut it into micro-batches.
        x and y: a tensor, or tuples, lists and dicts of them, cut by rows."""
        xs, ys = self.rows(x, "x", what), self.rows(y, "y", what)
        if torch.is_grad_enabled():  # a train step: its backward passes add to the grads
            self.before_backward()
        shapes = [(t.dtype, tuple(t.shape)) for t in xs[1]]
        agreements.agree(f"this {what}", step=self.steps, grad=int(torch.is_grad_enabled()),
                   no_sync=int(not self.require_grad_sync),
                   shapes=agreements.value_hash(shapes + [tuple(t.shape) for t in ys[1]]))
        self.input_key = (torch.is_grad_enabled(), self.microbatches, *shapes)  # the same on every stage
        self.inputs = self.chunks(*xs) if self.first else None
        self.targets = self.chunks(*ys) if self.last else None

    def rows(self, value, name, what):
        """(structure, tensors) of x or y, each tensor's rows divided by the micro-batches."""
        tensors = []
        structure = flatten(value, tensors, name)
        for t in tensors:
            if t.dim() == 0 or t.shape[0] % self.microbatches:
                raise ValueError(f"{what}: {name if structure == 0 else 'a tensor of ' + name} has "
                                 f"{t.shape[0] if t.dim() else 0} rows, which microbatches={self.microbatches} "
                                 "does not divide: the micro-batches are equal")
        return structure, tensors

    def chunks(self, structure, tensors):
        """The micro-batches: each tensor cut by rows, in the same structure."""
        cut = [t.to(self.device).chunk(self.microbatches) for t in tensors]
        return [unflatten(structure, [c[m] for c in cut]) for m in range(self.microbatches)]

    def forward_step(self, m):
        if self.first:
            self.exchange()
            x, inputs = self.inputs[m], []
        else:
            x, inputs = self.receive_activation()  # inputs: what came in that sends a grad back
        out = x
        for layer in self.layers:
            out = layer(out)
        if self.last:
            loss = self.loss(out, m)
            outs = [loss] if loss.requires_grad else []  # not where every stage is frozen
        else:
            outs = self.send_activation(out)  # outs: what went out that gets a grad back
        if torch.is_grad_enabled():
            self.saved[m] = (inputs, outs)  # STRATEGY: kept until this micro-batch's backward

    def backward_step(self, m):
        inputs, outs = self.saved.pop(m)
        if self.last:
            self.exchange()
            grads = None  # outs: this micro-batch's share of the loss
        else:
            grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in outs]  # contiguous
            outs, grads = self.receive_grads(outs, grads)  # of the outputs a later stage read
        if m == self.microbatches - 1:
            self.syncs_this_backward = self.require_grad_sync  # the grads are final in this backward
        if outs:
            torch.autograd.backward(outs, grads)
        self.buckets.add_held()  # grad hooks run once per micro-batch's backward, as in torch
        self.send_grads(inputs)

    def loss(self, out, m):
        """The last stage: this micro-batch's loss, kept for the step's mean;
        its backward starts from loss / M, so the grads are the whole batch's."""
        if self.loss_scaler is not None and torch.is_grad_enabled():  # fp16: grads scaled from where they enter
            tensors = []
            structure = flatten(out, tensors)
            out = unflatten(structure, [ScaleGrad.apply(t, self) if t.requires_grad else t for t in tensors])
        loss = self.loss_fn(out, self.targets[m])
        self.losses.append(loss.detach())
        return loss / self.microbatches

    def mean_loss(self):
        """The mean of the micro-batch losses over the replicas too: one
        all_reduce (the last stages hold them), on every rank."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.losses:
            total += torch.stack(self.losses).float().sum() / (self.microbatches * self.replicas)
        comm.all_reduce(total)
        return total.item()

    # ------------------------------------------------------------ grads

    def backward_started(self):
        """Nothing per micro-batch: the stages run different layers at
        different times, so they agree once per step, in micro_batches()."""

    @torch.no_grad()
    def all_reduce(self, bucket):
        """The replicas' average of a bucket, as torch DDP takes it: divided by R (Buckets), then summed.
        Grads averaged before (no zero_grad) are the same on every replica: they stay."""
        if self.replicas > 1:
            bucket.handle = comm.all_reduce(bucket.grads, async_op=True, group=self.replica_group)  # STRATEGY

    @torch.no_grad()
    def after_backward(self):
        for bucket in self.buckets.unsent():  # what backward did not send: parameters used no more
            self.all_reduce(bucket)
        self.buckets.wait()  # STRATEGY: the replicas' averages, at the end of the step
        self.send_tied_grads()

    @torch.no_grad()
    def send_tied_grads(self):
        """A tied parameter's grad, summed on its owner: each other stage
        that holds it sends its own (averaged over replicas) and drops it."""
        for p in self.tied:
            if not p.requires_grad:
                continue
            grad = self.buckets.of[p].view(self.flat_grads, p)
            if self.owns(p):
                for stage in self.holders[p][1:]:
                    theirs = torch.empty_like(grad)
                    comm.recv(theirs, self.rank_of(stage))  # STRATEGY: another stage's part of the grad
                    grad += theirs
            else:
                comm.send(grad, self.rank_of(self.holders[p][0]))  # STRATEGY: to the owner, which steps it
                grad.zero_()
                self.buckets.got_grad.discard(p)  # p.grad stays None here: the grad is the owner's

    def clear_grads(self, set_to_none):
        pass  # the buckets are views of flat_grads, which Buckets.clear zeroes

    def grad_attr(self, param):
        if param.dtype == self.reduce_dtype:
            return self.buckets.of[param].view(self.flat_grads, param)  # held whole, as under DDP
        return self.sharded_grad(param)

    def grad_square_sum(self):
        """Each stage's grads once: the first replica's (the others hold the same)."""
        square_sum = self.clipping.local_square_sum()
        comm.all_reduce(square_sum if self.replica == 0 else square_sum.zero_())
        return square_sum

    # ------------------------------------------------------------ parameters

    def pieces(self):
        """The parameters this stage owns; every replica of the stage holds the
        same (a copy of a tied parameter is not listed: its owner saves it)."""
        shard = self.shards[0]
        stepped = [piece._replace(replicated=True) for bucket in self.own_buckets
                   for piece in holding.bucket_pieces(self, bucket, 0, bucket.numel, shard, bucket.start)]
        return stepped + holding.whole_pieces(self, [p for p in self.frozen if self.owns(p)])

    @torch.no_grad()
    def full_values(self):
        """The parameters of each stage, from its first replica to every rank: one broadcast per stage."""
        mine = {piece.name: piece for piece in self.state_dicts.all_pieces()}
        full = {}
        for stage in range(self.stages):
            names = [name for name, p in self.named_params if self.holders[p][0] == stage]
            if not names:
                continue  # a stage of children without parameters (every rank knows it)
            sizes = [self.shapes[name].numel() for name in names]
            flat = torch.empty(sum(sizes), dtype=torch.float32, device=self.device)
            if stage == self.stage:
                torch.cat([mine[n].tensor[mine[n].offset:mine[n].offset + mine[n].hi].float() for n in names],
                          out=flat)
            comm.broadcast(flat, src=self.rank_of(stage, replica=0))
            for name, value in zip(names, flat.split(sizes)):
                full[self.module.get_parameter(name)] = value.view(self.shapes[name]).cpu()
        return full

    @torch.no_grad()
    def sync_params(self):
        self.send_tied([p for p in self.tied if p.requires_grad])  # what the step changed

    @torch.no_grad()
    def load_pieces(self, read, names=None):
        super().load_pieces(read, names)  # then sync_params()
        self.send_tied([p for p in self.tied if not p.requires_grad])  # a load changes frozen ones too

    def send_tied(self, params):
        """The owner's values of tied parameters, to the other stages that hold them."""
        for p in params:
            if self.owns(p):
                for stage in self.holders[p][1:]:
                    comm.send(p.data, self.rank_of(stage))  # STRATEGY: the new value, to each copy
            else:
                comm.recv(p.data, self.rank_of(self.holders[p][0]))  # STRATEGY

    def forward(self, *args, **kwargs):
        raise RuntimeError("a Pipeline runs forward and backward together, micro-batch by micro-batch: "
                           "call pipe.train_step(x, y) or pipe.eval_step(x, y)")
