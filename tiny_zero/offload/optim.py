"""ZeroOffloadAdamW: AdamW over this rank's chunks, as Zero2AdamW, but on the
host: the fp32 masters, the AdamW state and the averaged grads it reads are CPU
tensors, and the update is torch's fused CPU AdamW kernel (one vectorised
pass; tiny_zero/optim/fused.py) on this rank's share of the host's cores.
After the step the wrapper copies the updated chunks back to the device and
all-gathers them (ZeroOffload.sync_params)."""
from ..optimizer import StrategyAdamW
from .wrapper import ZeroOffload


class ZeroOffloadAdamW(StrategyAdamW):
    wrapper = ZeroOffload
    kernel = "fused"  # torch's fastest AdamW on the CPU (tiny_zero/optim/fused.py)

    def step(self, closure=None):
        with self.model.host_threads():  # STRATEGY: the step runs on the host, on this rank's share of its cores
            return super().step(closure)
