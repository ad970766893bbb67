"""Zero2AdamW: the same as Zero1AdamW; only where the grads come from differs."""
from ..flat_shards import FlatShardAdamW


class Zero2AdamW(FlatShardAdamW):
    pass
