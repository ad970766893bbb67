"""Each parameter's AdamW step count, and the stretches of shards one
update runs over (a first reader may skip this file). Held by StrategyAdamW
as opt.counts.

A parameter keeps its own count, as torch's does: one that has no grad is
not stepped. fp32, bf16: the counts are Python ints, as every step the host
takes happens. fp16: a skip is decided on the device, so the counts are a
tensor there (where the shards are), advanced by (1 - found_inf), and the
kernel reads its stretch's. A stretch (a run) is adjacent pieces of a shard
whose parameters step now, in the same group, with the same count: the
update runs once per stretch, usually once per shard. The bookkeeping is by
a parameter's index, its place in model.named_params (a dict keyed by
Parameter objects hashes each one in Python, thousands of times a step)."""
from itertools import groupby

import torch


class StepCounts:
    """The step counts of one wrapper's parameters (by index), and the
    stretches of its shards (model.shards) that step together."""

    def __init__(self, model):
        self.model = model
        params = [p for _, p in model.named_params]
        self.index_of = {id(p): i for i, p in enumerate(params)}
        self.on_host = [0] * len(params)  # fp32, bf16
        device = model.shards[0].device if model.shards else model.device
        self.on_device = torch.zeros(len(params), device=device) if model.loss_scaler is not None else None  # fp16
        # `stamps` (fp16; and loaded counts): a hash of the steps each parameter was stepped in (equal
        # stamps, equal counts), which groups the runs without reading the counts on the device
        self.stamps = [0] * len(params)
        self.masks = {}  # fp16: the stepping parameters' indices -> a 0/1 tensor over the counts
        position = {id(s): i for i, s in enumerate(model.shards)}
        pieces = sorted((p for p in model.state_dicts.all_pieces() if id(p.tensor) in position),
                        key=lambda p: (position[id(p.tensor)], p.offset))  # in layout order
        by_name = dict(model.named_params)
        # (parameter index, shard index, lo, hi) of each piece this rank steps, in layout order
        self.piece_rows = [(self.index_of[id(by_name[p.name])], position[id(p.tensor)], p.offset,
                            p.offset + p.hi - p.lo) for p in pieces]
        self.cached_runs = None  # (the key runs() was computed for, its runs)
        self.group_key = None  # the param groups that group_index was computed for
        self.group_index = [None] * len(params)  # each parameter's group (its index), None if none

    def indices(self, params, groups):
        """The indices of `params` (the parameters that step), less those in
        none of `groups` (the optimizer's param groups)."""
        group_index = self.update_group_index(groups)
        stepped = list(map(self.index_of.__getitem__, map(id, params)))  # in C: a step's longest loop
        if None in group_index:  # some of the model's parameters are in no group of this optimizer
            stepped = [i for i in stepped if group_index[i] is not None]
        return stepped

    def update_group_index(self, groups):
        """group_index, recomputed only when the param groups changed."""
        key = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if key != self.group_key:
            self.group_index = [None] * len(self.on_host)
            for g, group in enumerate(groups):
                for p in group["params"]:
                    self.group_index[self.index_of[id(p)]] = g
            self.group_key = key
        return self.group_index

    def runs(self, stepped, groups):
        """(shard index, lo, hi, group, first parameter's index): the stretches
        of shards to update, one launch each: adjacent pieces of parameters
        that step now (indices(), of the same `groups`), in the same group,
        with the same step count. A piece that does not step ends a stretch.
        Made again only when the parameters that step, or the groups, change:
        where the same ones step as last time, their counts all moved together."""
        key = (tuple(stepped), self.group_key)
        if self.cached_runs is not None and self.cached_runs[0] == key:
            return self.cached_runs[1]
        steps = [False] * len(self.on_host)
        for i in stepped:
            steps[i] = True
        stamps, group_index = self.on_host if self.on_device is None else self.stamps, self.group_index
        keys = [(shard, group_index[i], stamps[i]) if steps[i] else None for i, shard, _, _ in self.piece_rows]
        runs = []
        for run_key, same in groupby(zip(keys, self.piece_rows), key=lambda item: item[0]):
            if run_key is None:
                continue
            rows = [row for _, row in same]
            (first, shard, lo, _), hi = rows[0], rows[-1][3]
            runs.append((shard, lo, hi, groups[run_key[1]], first))
        self.cached_runs = (key, runs)
        return runs

    def advance(self, stepped, found_inf):
        """The step counts of the parameters `stepped` (indices) go up by one,
        before their update reads them; under fp16 on the device, where the
        step was not skipped, in one op."""
        if self.on_device is None:
            counts = self.on_host
            for i in stepped:
                counts[i] += 1
            return
        stamps, step = self.stamps, self.model.steps  # runs tells counts apart by these (it reads counts in fp32)
        for i in stepped:
            stamps[i] = (stamps[i] * 31 + step + 1) % (1 << 61)
        key = tuple(stepped)
        if key not in self.masks:
            mask = torch.zeros(len(self.on_host))
            mask[list(stepped)] = 1.0
            self.masks[key] = mask.to(self.on_device.device)  # once per set of stepping parameters
        self.on_device.addcmul_(self.masks[key], 1 - found_inf.to(self.on_device.device))

    def count(self, i):
        """Parameter i's step count: a number, or under fp16 a 0-d tensor on
        the device, which the kernel reads (float() of it is a host read)."""
        return self.on_host[i] if self.on_device is None else self.on_device[i]

    def has_count(self, i):
        """Whether parameter i has stepped (fp32, bf16: its count; fp16: its
        stamp), or had a count loaded."""
        return bool(self.on_host[i] or self.stamps[i])

    def load(self, i, step):
        """Parameter i's count is `step` (a state dict's or a checkpoint's)."""
        if self.on_device is None:
            self.on_host[i] = int(step)
        else:
            self.on_device[i] = float(step)
        self.stamps[i] = (1 << 60) + int(step)  # equal counts, equal stamps: no history to tell them apart
        self.cached_runs = None
