"""The schedules: in which order each stage runs the forward (F) and backward
(B) of the micro-batches of one training step. The order is the whole
difference between GPipe and 1F1B; the wrapper runs whichever list it is
given (wrapper.py: Pipeline.run).

A stage's forward of micro-batch m needs the previous stage's forward of m;
its backward of m needs the next stage's backward of m. A stage keeps a
micro-batch's activations from its forward until its backward: that is the
memory a schedule decides.

GPipe (Huang et al., 2019): every forward, then every backward. Stage 0 holds
all M micro-batches' activations at once.

    stage 0   F0 F1 F2 F3 B0 B1 B2 B3
    stage 1   F0 F1 F2 F3 B0 B1 B2 B3

1F1B (PipeDream-Flush, Narayanan et al., 2021): stage s runs S - 1 - s
forwards ahead (the warm-up), then alternates one forward and one backward,
then runs the backwards left. Stage 0 holds at most S micro-batches'
activations, whatever M is; the idle time (the bubble) is the same as GPipe's.

    stage 0   F0 F1 B0 F2 B1 F3 B2 B3
    stage 1   F0 B0 F1 B1 F2 B2 F3 B3

With equal stages the bubble, the fraction of a step a stage waits, is
(S - 1) / (M + S - 1) for both (bubble()).
"""
FORWARD, BACKWARD = "F", "B"


def gpipe(stages, microbatches, stage):
    """[(FORWARD or BACKWARD, micro-batch)]: what `stage` runs, in order."""
    return [(FORWARD, m) for m in range(microbatches)] + [(BACKWARD, m) for m in range(microbatches)]


def one_f_one_b(stages, microbatches, stage):
    warmup = min(stages - 1 - stage, microbatches)  # forwards ahead: the later stages' first backward comes back then
    actions = [(FORWARD, m) for m in range(warmup)]
    for m in range(microbatches - warmup):  # steady: one forward, one backward
        actions += [(FORWARD, warmup + m), (BACKWARD, m)]
    return actions + [(BACKWARD, m) for m in range(microbatches - warmup, microbatches)]


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def bubble(stages, microbatches):
    """The fraction of a step each stage is idle, for equal stages."""
    return (stages - 1) / (microbatches + stages - 1)


def live_activations(actions):
    """The most micro-batches whose activations a stage holds at once."""
    live = peak = 0
    for kind, _ in actions:
        live += 1 if kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def timeline(schedule, stages, microbatches, backward_cost=2):
    """The schedule as a picture: one row per stage, one column per time unit,
    a forward taking one unit and a backward `backward_cost`; '.' is idle.
    Each action starts as soon as the stage is free and its input has arrived."""
    done = {}  # (kind, stage, micro-batch) -> when it ends
    rows, clock = [[] for _ in range(stages)], [0] * stages
    todo = [list(schedule(stages, microbatches, s)) for s in range(stages)]
    while any(todo):
        before = sum(map(len, todo))
        for s in range(stages):
            while todo[s]:
                kind, m = todo[s][0]
                needs = (FORWARD, s - 1, m) if kind == FORWARD else (BACKWARD, s + 1, m)
                if needs[1] in (-1, stages):
                    ready = 0
                elif needs in done:
                    ready = done[needs]
                else:
                    break  # waits for another stage
                cost = 1 if kind == FORWARD else backward_cost
                start = max(clock[s], ready)
                rows[s] += ["."] * (start - clock[s]) + [f"{kind}{m}"] * cost
                clock[s] = done[kind, s, m] = start + cost
                todo[s].pop(0)
        if sum(map(len, todo)) == before:
            raise ValueError(f"{schedule.__name__} deadlocks: every stage waits for another")
    width = max(clock)
    return "\n".join(f"stage {s}  " + " ".join(f"{cell:>3}" for cell in row + ["."] * (width - len(row)))
                     for s, row in enumerate(rows))
