"""Zero1AdamW: AdamW over this rank's chunks only (8 bytes of state per
parameter, divided by N); after the step, all_gather the parameters."""
from ..flat_shards import FlatShardAdamW


class Zero1AdamW(FlatShardAdamW):
    pass
