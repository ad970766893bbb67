"""The param -> rank table of ZeRO-3: each whole tensor is owned by one rank.

Largest tensors first, each to the rank with the least load so far (ties to
the lower rank, names break size ties). It depends only on names and shapes,
so every rank computes the same table without communicating.
"""


def owner_table(named_shapes, world_size):
    """{name: rank} for [(name, numel), ...], balanced by numel."""
    load = [0] * world_size
    owner = {}
    for name, numel in sorted(named_shapes, key=lambda item: (-item[1], item[0])):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += numel
    return owner


def loads(owner, named_shapes, world_size):
    """Elements owned by each rank."""
    load = [0] * world_size
    for name, numel in named_shapes:
        load[owner[name]] += numel
    return load
