"""ZeroOffloadAdamW: AdamW over this rank's chunks, as Zero2AdamW, but on the
host: the fp32 masters, the moments and the averaged grads it reads are CPU
tensors, and the update is torch's fused CPU AdamW kernel (one vectorised
pass; tiny_zero/optim/fused.py) on this rank's share of the host's cores.
After the step the wrapper copies the updated chunks back to the device and
all-gathers them (ZeroOffload.sync_params)."""
from ..strategy import StrategyAdamW
from .wrapper import ZeroOffload


class ZeroOffloadAdamW(StrategyAdamW):
    wrapper = ZeroOffload
    kernel = "fused"  # STRATEGY: the step runs on the CPU, with torch's fastest AdamW there

    def step(self, closure=None):
        with self.model.host_threads():  # STRATEGY: on every core this rank has on the host
            return super().step(closure)
