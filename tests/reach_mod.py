"""Per file: reached functions (name:lines) and unreached top-level/method defs, for given strategies."""
import sys, ast, inspect, json
from pathlib import Path
ROOT = Path("/work/main"); sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import reading

def every(names):
    import torch.distributed as dist
    out = {}
    for name in names:
        import torch, tiny_zero
        from example.model import build_model
        torch.manual_seed(0)
        wrapper, adamw = tiny_zero.STRATEGIES[name]
        model = wrapper(build_model("tiny")); opt = adamw(model, lr=1e-3)
        x = torch.randint(0, 256, (2, 16))
        def step():
            model(x, x).backward(); model.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()
        step(); step()
        with reading.Reached() as r:
            step()
        out[name] = sorted({(str(Path(c.co_filename).relative_to(ROOT)), c.co_firstlineno, c.co_qualname) for c in r.codes if c.co_name != "<module>"})
    return out if dist.get_rank() == 0 else None

if __name__ == "__main__":
    from harness import run_world
    res = run_world(2, "reach_mod", "every", sys.argv[1].split(","))[0]
    json.dump(res, open("/tmp/w/reach.json", "w"))
