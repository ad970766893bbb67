"""torch's hooks that tiny_zero runs itself (a first reader may skip this
file): parameters' grad hooks (register_hook,
register_post_accumulate_grad_hook), which a strategy runs as autograd would
and the layers without a strategy refuse; modules' load_state_dict hooks,
which a wrapper's load runs as torch's load_state_dict would."""
from torch.nn.modules.module import _IncompatibleKeys


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


def loaded_with_hooks(top, values, key_prefix, strict, metadata, load):
    """A load_state_dict called on `top` (`values` keyed key_prefix + its
    keys), with torch's load_state_dict hooks of top and its submodules, in
    torch's order: each module's pre-hooks before its children's (they may
    rename or convert keys), then load(values keyed as top's own keys, strict)
    -> (missing, unexpected), then the post-hooks, children first (they may
    edit the incompatible keys, which a strict load checks after them)."""
    modules = list(top.named_modules())
    post = [(m, hook) for m in post_order(top) for hook in m._load_state_dict_post_hooks.values()]
    missing, unexpected, errors = [], [], []
    for path, m in modules:
        prefix = key_prefix + (path + "." if path else "")
        for hook in m._load_state_dict_pre_hooks.values():
            hook(values, prefix, metadata.get(prefix[:-1], {}), strict, missing, unexpected, errors)
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(top).__name__}:\n\t" + "\n\t".join(errors))
    got_missing, got_unexpected = load({k.removeprefix(key_prefix): v for k, v in values.items()}, strict and not post)
    keys = _IncompatibleKeys(missing + [key_prefix + k for k in got_missing],
                             unexpected + [key_prefix + k for k in got_unexpected])
    for m, hook in post:
        hook(m, keys)
    if strict and (keys.missing_keys or keys.unexpected_keys):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(top).__name__}: missing keys "
                           f"{keys.missing_keys}, unexpected keys {keys.unexpected_keys}")
    return keys


def post_order(module):
    """module's submodules, each after its children (torch's order of the load's post-hooks)."""
    for child in module.children():
        yield from post_order(child)
    yield module


def unhooked_state_dict(module, prefix=""):
    """module.state_dict(keep_vars=True) without its hooks: the keys that
    torch's load_state_dict matches (each module's own, after the load's
    pre-hooks), whatever state_dict hooks rename on saving."""
    out = {}
    module._save_to_state_dict(out, prefix, keep_vars=True)
    for name, child in module._modules.items():
        if child is not None:
            out.update(unhooked_state_dict(child, prefix + name + "."))
    return out
