"""Tensor parallel layers: Megatron's column and row Linears. Rank k of a
tensor group holds slice k of a planned Linear (wrapper.py):

    column   rows of W and b: output features k     forward  y_k = x W_kᵀ + b_k     x is whole: nothing sent
                                                    backward dx = Σ_k dy_k W_k       all_reduce in the tensor group
    row      columns of W: input features k         forward  y = Σ_k x_k W_kᵀ, + b   all_reduce in the tensor group
                                                    backward dx_k = dy W_k           dy is whole: nothing sent

A column Linear followed by a row Linear (attention's q, k, v then o; an MLP's
up then down) hands its output slice straight to the row Linear, so each
pair costs one all-reduce in forward (the row Linear's) and one in backward:
the column Linears that read one x (q, k and v) read it through one
SumOverSlices, so autograd adds their shares of dx before the all-reduce.
The other layers are whole on every rank and compute the same thing on each.

Every layer's grads are averaged over the replicas as ddp's are: each goes
into its bucket, and a bucket whose grads are final is all-reduced across
the replicas at once, asynchronously, while backward goes on."""
import torch

from .. import comm
from ..hooked import HookedLayer
from ..module import Conv1D, Embedding, LayerNorm, Linear, RMSNorm
from ..step import LayerMoments, StrategyLayer, layer_classes


class TensorParallelLayer:
    def grad_ready(self, param, grad):
        wrapper = self.wrapper
        for bucket in wrapper.buckets.add(param, grad, send=wrapper.require_grad_sync):  # into flat_grads
            wrapper.all_reduce(bucket)  # STRATEGY: across the replicas, now, async; backward goes on


class ColumnParallel(TensorParallelLayer):
    @torch.compiler.disable
    def forward(self, x):
        wrapper = self.wrapper
        if wrapper.column_input is None or wrapper.column_input[0] is not x:  # q, k and v read one x: one SumOverSlices
            wrapper.column_input = (x, SumOverSlices.apply(x, wrapper.tensor_group))
        return super().forward(wrapper.column_input[1])


class SumOverSlices(torch.autograd.Function):
    """Megatron's f, in front of the column Linears that read x: the identity
    in forward; in backward, autograd has added up their grads of x (each
    dy_k W_k of this rank's slices), and the sum over the ranks is dx."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        comm.all_reduce(grad, group=ctx.group)  # STRATEGY: dx, summed over the slices
        return grad, None


class RowParallel(TensorParallelLayer):
    def forward_callback(self, ctx, x):
        ctx.save_for_backward(x)  # x_k, for Linear's backward: dW_k = dyᵀ x_k, dx_k = dy W_k
        y = x @ self.weight.t()  # x_k W_kᵀ: this rank's share of the sum over the input features
        comm.all_reduce(y, group=self.wrapper.tensor_group)  # STRATEGY: y, summed over the slices
        return y if self.bias is None else y + self.bias.to(y.dtype)  # the bias once, after the sum


# The layers this strategy swaps in (module/layers.py's math, this mixin's moments, step.py's around them),
# and the same moments for a module reached through hooks (hooked.py):
class TensorParallelLinear(StrategyLayer, TensorParallelLayer, LayerMoments, Linear): pass
class TensorParallelLayerNorm(StrategyLayer, TensorParallelLayer, LayerMoments, LayerNorm): pass
class TensorParallelRMSNorm(StrategyLayer, TensorParallelLayer, LayerMoments, RMSNorm): pass
class TensorParallelEmbedding(StrategyLayer, TensorParallelLayer, LayerMoments, Embedding): pass
class TensorParallelConv1D(StrategyLayer, TensorParallelLayer, LayerMoments, Conv1D): pass
class TensorParallelHooked(HookedLayer, TensorParallelLayer, LayerMoments): pass

LAYER_CLASSES = layer_classes(TensorParallelLinear, TensorParallelLayerNorm, TensorParallelRMSNorm,
                              TensorParallelEmbedding, TensorParallelConv1D, TensorParallelHooked)


class ColumnParallelLinear(StrategyLayer, ColumnParallel, LayerMoments, Linear): pass
class RowParallelLinear(StrategyLayer, RowParallel, LayerMoments, Linear): pass
COLUMN_LINEAR, ROW_LINEAR = ColumnParallelLinear, RowParallelLinear
