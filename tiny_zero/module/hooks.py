"""Parameters' grad hooks (register_hook, register_post_accumulate_grad_hook;
a first reader may skip this file): a strategy runs them as autograd would, and the
layers without a strategy refuse them."""


def has_grad_hook(param):
    """autograd runs a parameter's hooks as it adds the parameter's grad in;
    tiny_zero's layers hand each grad to grad_ready instead, where a
    strategy runs them (run_grad_hooks), and the layers alone refuse them."""
    return bool(param._backward_hooks or param._post_accumulate_grad_hooks)



def check_no_grad_hooks(param):
    """Refuse a grad hook on `param` (has_grad_hook), in the layers without a strategy."""
    if has_grad_hook(param):
        raise RuntimeError(f"a parameter of shape {tuple(param.shape)} has a grad hook (Tensor.register_hook or "
                           "register_post_accumulate_grad_hook): tiny_zero's layers without a strategy hand each "
                           "grad to grad_ready, not to autograd, so it would never run; remove it, act on "
                           "p.grad after backward(), or wrap the model in a strategy, which runs it")



def run_grad_hooks(param, grad, local):
    """What autograd does with a parameter's grad of one backward pass, for a
    strategy: `grad`, the sum of its contributions, goes through the hooks of
    p.register_hook (each may return a replacement); local(grad) adds the
    result to this rank's grads and returns them; then the hooks of
    p.register_post_accumulate_grad_hook run, while p.grad shows those grads
    (in the parameter's dtype: a copy, written back, where they are kept in
    another). p.grad is then restored."""
    for hook in tuple((param._backward_hooks or {}).values()):
        result = hook(grad)
        if result is not None:
            grad = result
    grads = local(grad)
    hooks = tuple((param._post_accumulate_grad_hooks or {}).values())
    if not hooks:
        return
    before = param.grad
    shown = grads if grads.dtype == param.dtype else grads.to(param.dtype)
    param.grad = shown
    try:
        for hook in hooks:
            hook(param)
    finally:
        param.grad = before
        if shown is not grads:
            grads.copy_(shown)
