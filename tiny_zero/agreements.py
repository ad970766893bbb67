"""The ranks' agreements (a first reader may skip this file): before
collectives that would otherwise mismatch or hang, every rank checks that
every rank is about to run the same ones, and all raise the same clear error
if not.

agree(what, **values): every rank checks that every rank passed the same
    integers, on a side channel (a gloo group of its own, CPU tensors). The
    check of a step goes out without waiting and is settled before the
    rank's next collective (comm.py calls check_agreements). new_group(ranks)
    makes a process group with a side channel of its own, for
    agree(group=...) among those ranks only.
At exit (_settle_at_exit): the checks still in flight are waited for (a
    disagreement is told), then the process groups are destroyed, while the
    interpreter is whole: see there why a run would otherwise abort now and
    then on its way out. A run that failed (the script raised, or a
    collective failed) ends at once instead (_end_failed_run).
"""
import atexit
import logging
import os
import signal
import sys
import weakref
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from . import comm
from .comm import DisagreementError, Pending

# ---------------------------------------------------------------- agreement

# process group -> its side group; weak, so that both go when torch lets go of
# the group (dist.destroy_process_group): held here they would outlive it into
# the interpreter's teardown, where gloo can abort the process
_side_groups = weakref.WeakKeyDictionary()


def open_side_channel():
    """Create the side group agree() uses. Collective: every rank calls it at
    the same point (the wrappers do, at wrap time)."""
    world = dist.group.WORLD
    if world not in _side_groups and _has_peers():
        _side_groups[world] = dist.new_group(backend="gloo")


def new_group(ranks):
    """A process group of global `ranks`, with its own side channel for
    agree(group=...). Collective over the world: every rank calls it for every
    group, in the same order. A rank outside `ranks` gets None."""
    ranks = list(ranks)
    group = dist.new_group(ranks)
    side = dist.new_group(ranks, backend="gloo") if len(ranks) > 1 and _has_peers() else None
    if dist.get_rank() not in ranks:
        return None
    _side_groups[group] = side
    return group


def _has_peers():
    """More than one rank, and real ones (torch's fake process group, which
    simulates a large world in one process, has none to agree with)."""
    return dist.get_world_size() > 1 and dist.get_backend() != "fake"


def agree(what, group=None, wait=True, defer=False, **values):
    """Check that every rank (of `group`, one from new_group; default: the
    world) passed the same integers (one small all-reduce on the side group);
    raise DisagreementError, the same on every rank, if not. wait=False: the
    check is sent now and settled before this rank's next collective (or its
    next agree that waits), so its all-reduce runs while the rank computes.
    defer=True: not sent on its own; its values go out with this rank's next
    agree on the same group, or before its next collective if that comes
    first: one all-reduce for two checks. A value given as Spread(n) may
    differ: with wait=True agree returns {its name: (lowest, highest)}."""
    spread = {name: (v, v) for name, v in values.items() if isinstance(v, Spread)}
    if not _has_peers() or (group is not None and dist.get_world_size(group) < 2):
        return spread
    if defer:
        _deferred.append((group, what, values))
        return None
    checks = [(what, values)] + _take_deferred(group)  # one all-reduce for this check and those waiting for it
    if wait:  # the earlier ones first: should one of them raise, nothing of this one is in flight
        check_agreements()
    _send(group, checks)
    if wait:
        check_agreements()
        return {name: _spreads.pop(name) for name in spread}
    return None


class Spread(int):
    """A value of agree() in which the ranks may differ: not checked; an
    agree() that waits returns its lowest and highest over the ranks."""


def value_hash(value):
    """An integer that names `value` for agree(), the same on every rank."""
    return zlib.crc32(repr(value).encode())


_deferred = []  # agreements not sent yet: (group, what, values)
_unsettled = []  # agreements sent and not yet checked: (pending, [(what, values), ...], result)
_spreads = {}  # the name of a Spread value settled -> (lowest, highest) over the ranks


def _take_deferred(group):
    """The deferred agreements on `group`, taken out of the queue."""
    taken = [(what, values) for g, what, values in _deferred if g is group]
    _deferred[:] = [d for d in _deferred if d[0] is not group]
    return taken


SLOTS = 32  # numbers per agreement: always as many, so that ranks at different checks still send equal sizes


def _message(checks):
    """The numbers one agreement sends for `checks`: first a name of what is
    checked (_name), then the values, padded with zeros to SLOTS. Values
    past the last slot but one are folded into it."""
    numbers = [v for _, values in checks for v in values.values()]
    if len(numbers) > SLOTS - 1:
        numbers = numbers[:SLOTS - 2] + [value_hash(numbers[SLOTS - 2:])]
    return [_name(checks)] + numbers + [0] * (SLOTS - 1 - len(numbers))


def _name(checks):
    """A number for the checks and their values' names: equal wherever the ranks are at the same checks."""
    return value_hash("|".join(f"{what}:{','.join(values)}" for what, values in checks))


# what a value that differs means, in words, after its numbers
MEANING = {"layers_used_in_forward": ": a rank ran a forward that expects a backward (not under torch.no_grad()) "
                                     "that the others did not run, or used other layers in it. Evaluate under "
                                     "torch.no_grad(), or on every rank"}

# the check of model.state_dict() where parameters are sharded (state_dicts.py: meet_for_state_dict)
TAKING_STATE_DICT = "a state dict of the model"
STATE_DICT_ALONE = (
    "a state dict of the model, which some ranks take and others do not. Where the parameters are "
    "sharded (zero1, zero2, zero3, fsdp, offload), model.state_dict() and model.full_state_dict() are "
    "collectives: call them on every rank, then save on rank 0 alone; or, under zero1, zero2 and offload, "
    "take model.module.state_dict() on one rank (the module holds whole values between steps). Under "
    "ddp a state dict is local")


def _send(group, checks):
    """One all-reduce for `checks` ([(what, values), ...]): each number of
    their message and its negation, with MAX, so that every rank learns the
    largest and the smallest."""
    numbers = _message(checks)
    named = checks[0][0] + "".join(f" (with {what})" for what, _ in checks[1:])
    # bookkeeping, not the model's memory: out of sight of tensor-counting modes
    # (whose counts gloo's worker thread would otherwise race when it lets go)
    with _disable_current_modes():
        everyone = torch.tensor(numbers + [-v for v in numbers], dtype=torch.int64)
        side = _side_groups[dist.group.WORLD if group is None else group]
        work = dist.all_reduce(everyone, op=dist.ReduceOp.MAX, group=side, async_op=True)
    _unsettled.append((Pending(work, f"the agreement on {named}", everyone), checks, named, everyone))


def check_agreements():
    """Send the deferred agreements, then wait for every agreement sent so far
    and check them, in the order sent."""
    while _deferred:
        group = _deferred[0][0]
        _send(group, _take_deferred(group))
    while _unsettled:
        pending, checks, named, everyone = _unsettled.pop(0)
        with _disable_current_modes():
            pending.wait()
        low, high = (-everyone[SLOTS:]).tolist(), everyone[:SLOTS].tolist()
        if low[0] != high[0] and _name([(TAKING_STATE_DICT, {})]) in (low[0], high[0]):
            _disagree(STATE_DICT_ALONE)
        if low[0] != high[0]:
            _disagree(f"what to check: this rank is at {named}, another rank at something else (a backward "
                      "pass, an optimizer step or a gather that this rank did not reach, or reached in another order)")
        count = sum(len(values) for _, values in checks)
        direct = count if count < SLOTS else SLOTS - 2  # the values with a slot of their own, from slot 1
        differ, i = [], 1
        for what, values in checks:
            ranges = []
            for name, value in values.items():
                if isinstance(value, Spread):
                    _spreads[name] = (low[i], high[i])
                    low[i] = high[i]  # differing is allowed
                elif i <= direct and low[i] != high[i]:
                    ranges.append(f"{name} from {low[i]} to {high[i]} (this rank: {value}){MEANING.get(name, '')}")
                i += 1
            if ranges:
                differ.append(f"{what}: {'; '.join(ranges)}")
        if differ or low != high:
            _disagree("; and on ".join(differ) or f"{named}: the values past the first {SLOTS - 2}")


def _disagree(what):
    _unsettled.clear()
    raise DisagreementError(f"ranks disagree on {what}. Every rank must run the same forward, backward, no_sync() "
                            "and optimizer steps, and change the same parameters")


@atexit.register
def _settle_at_exit():
    """At exit, while the interpreter is whole: settle the agreements still
    in flight (a step's own is sent without waiting; a disagreement is still
    told), then let go of the side groups and destroy the process groups.

    Why: a gloo worker thread lets go of a collective it ran only after the
    rank's wait() has returned, and letting go takes the GIL (the collective
    holds tensors and thread-local state that belong to Python). Should that
    come after the interpreter began its teardown, the thread is ended inside
    C++ and the process aborts ("terminate called without an active
    exception") after a run that went right. It happens now and then, under
    load, to the last collectives of a run: this check's, or the model's.
    Destroying a group joins its worker threads (with the GIL released), so
    they let go of everything now. torch's destroy_process_group() does that
    for the groups only it holds: the side groups are let go here, and the
    world is destroyed here when the script did not. A run that failed
    ends first, without any of this (_end_failed_run): a collective of its
    may still wait for the other ranks, and joining its thread would wait
    with it. Deferred checks are dropped, and no wait lasts over a minute:
    sending or waiting now could wait for a rank that has gone."""
    raised = getattr(sys, "last_value", None)  # the script raised: Python printed its traceback
    if dist.is_initialized() and (raised is not None or comm.failed):
        _end_failed_run(raised)
    comm.timeout = min(comm.timeout, timedelta(seconds=60))
    _deferred.clear()
    while _unsettled:
        try:
            check_agreements()
        except DisagreementError as e:
            print(f"tiny_zero, at exit: {e}", file=sys.stderr)
        except RuntimeError:
            pass  # CollectiveError: the group was destroyed before it ran, or a rank has gone
    _side_groups.clear()  # their last references but torch's
    if dist.is_initialized():
        dist.destroy_process_group()


def _end_failed_run(raised):
    """Exit now, without tearing down the process groups: a failed run ends
    within seconds of its error, on every rank (torchrun stops the others as
    this one exits). Teardown would wait: gloo's process group joins its
    worker thread, which may still wait in a collective that a rank never
    joins, until gloo's own timeout (30 minutes, whatever comm.timeout says).
    The code is Python's for what the script raised (1; SIGINT's for ^C);
    1 where the script went on after a CollectiveError. The exit handlers
    registered before tiny_zero was imported do not run, but logging's."""
    if raised is None:
        print(f"tiny_zero: a collective failed ({comm.failed}): exiting with code 1, without waiting for it",
              file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if isinstance(raised, KeyboardInterrupt):  # as Python ends on ^C: by the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(1)
