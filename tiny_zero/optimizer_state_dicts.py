"""The state dicts of a strategy's optimizer (a first reader may skip this file).

    opt.state_dict()         this rank's shard of the optimizer state, marked with the strategy,
                             rank and world size that made it: it loads only there
    opt.load_state_dict()    back on the rank that saved it; the param groups' settings as torch's

A checkpoint reads and writes each parameter's piece of the state
(piece_state, load_piece_state), and compares param groups by name
(param_group_differences).
"""
import torch


class OptimizerStateDicts:
    """Mixed into StrategyAdamW."""

    def piece_state(self, piece):
        """exp_avg, exp_avg_sq (their slices for this piece; None before the
        first step) and the step count of piece's parameter: what a checkpoint
        keeps."""
        i = self.counts.index_of[id(dict(self.model.named_params)[piece.name])]
        state = self.state.get(piece.tensor, {})
        place = slice(piece.offset, piece.offset + piece.hi - piece.lo)
        exp_avgs = [state[k][place] if k in state else None for k in ("exp_avg", "exp_avg_sq")]
        return exp_avgs[0], exp_avgs[1], float(self.counts.count(i))

    def load_piece_state(self, piece, exp_avg, exp_avg_sq, step):
        i = self.counts.index_of[id(dict(self.model.named_params)[piece.name])]
        place = slice(piece.offset, piece.offset + piece.hi - piece.lo)
        m, v = self.adam_state(piece.tensor)
        m[place], v[place] = exp_avg, exp_avg_sq
        self.counts.load(i, step)

    def state_dict(self):
        """This rank's state (its shards' exp_avg and exp_avg_sq, the step counts) and the
        param groups, marked with the strategy, rank and world size that made
        it: it loads only there (tiny_zero.checkpoint saves and loads across
        strategies and world sizes). A parameter's count is torch's
        state["step"], a float32 CPU scalar, made here (under fp16 read
        from the device), for each parameter that has stepped or been loaded."""
        model = self.model
        shard_index = {id(s): i for i, s in enumerate(model.shards)}
        state = {}
        for key, value in self.state.items():
            if id(key) in shard_index:
                state[f"shard{shard_index[id(key)]}"] = {k: v.clone() for k, v in value.items()}
        for i, (name, _) in enumerate(model.named_params):
            if self.counts.has_count(i):
                state[name] = {"step": torch.tensor(float(self.counts.count(i)))}
        return {"state": state, "param_groups": self.named_param_groups(), "skipped_steps": self.skipped_steps,
                "made_by": self.made_by()}

    def named_param_groups(self):
        """opt.param_groups as torch's state_dict keeps them: every setting
        (lr, betas, ..., what a scheduler adds, such as initial_lr), and the
        parameters by name, so that the groups load on any strategy."""
        names = self.model.name_of
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
                for g in self.param_groups]

    def load_param_groups(self, saved):
        """Take every setting of the `saved` groups (named_param_groups()), as
        torch's load_state_dict does: each group becomes the saved one, with
        its own parameters. Raises ValueError if the groups hold other
        parameters than the saved ones, before changing anything."""
        problem = param_group_differences(saved, self.named_param_groups())
        if problem:
            raise ValueError(f"the saved param groups differ from this optimizer's: {problem}")
        for group, settings in zip(self.param_groups, saved):
            params = group["params"]
            group.clear()  # keys the saved group lacks go too, as in torch
            group.update({**settings, "params": params})

    def made_by(self):
        """Where this state belongs. Under ddp every rank's is the same, so any
        rank's loads anywhere in the world (rank None), as with torch DDP."""
        model = self.model
        return {"strategy": type(model).__name__, "rank": None if model.grads_replicated else model.rank,
                "world_size": model.world_size, "shards": [tuple(s.shape) for s in model.shards]}

    def load_state_dict(self, state_dict):
        made_by = state_dict.get("made_by")
        if made_by != self.made_by():
            raise ValueError(
                f"this optimizer state was saved by {_describe(made_by)}; this is {_describe(self.made_by())}. "
                "Each rank must load its own state_dict into the same strategy and world size; "
                "tiny_zero.checkpoint.save/load move state across strategies and world sizes")
        model = self.model
        self.load_param_groups(state_dict["param_groups"])
        by_name = dict(model.named_params)
        for key, value in state_dict["state"].items():
            if key.startswith("shard"):
                target = model.shards[int(key[5:])]
                self.state[target] = {k: v.to(target.device).clone() for k, v in value.items()}
            else:
                self.counts.load(self.counts.index_of[id(by_name[key])], float(value["step"]))
        self.skipped_steps = state_dict.get("skipped_steps", 0)


def param_group_differences(saved, mine):
    """What differs between two lists of named param groups in which
    parameters they hold (their settings may differ): a sentence, or None."""
    if len(saved) != len(mine):
        return f"{len(saved)} groups saved, {len(mine)} in this optimizer"
    problems = []
    for i, (theirs, ours) in enumerate(zip(saved, mine)):
        in_saved, in_mine = set(theirs["params"]), set(ours["params"])
        only_saved = [name for name in theirs["params"] if name not in in_mine]
        only_mine = [name for name in ours["params"] if name not in in_saved]
        differ = ([f"{some(only_saved, 4)} in the saved one only"] if only_saved else []) + \
                 ([f"{some(only_mine, 4)} in this optimizer's only"] if only_mine else [])
        if differ:
            problems.append(f"group {i} holds " + " and ".join(differ))
    return "; ".join(problems) or None


def some(items, most=6):
    """The first `most` items, and how many more."""
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def _describe(made_by):
    if not made_by:
        return "something other than a tiny_zero strategy optimizer"
    rank = "every rank" if made_by["rank"] is None else f"rank {made_by['rank']}"
    return f"{rank} of {made_by['world_size']} under {made_by['strategy']}"
