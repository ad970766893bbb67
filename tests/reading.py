"""What a reader follows to understand one strategy's training step: the
tiny_zero functions that one steady step runs, counted in lines, by file,
and the functions that wrapping runs, which lay out the state the step reads.

    python tests/reading.py            # a table for every strategy (2 gloo ranks)

A step is model(x), loss.backward(), model.clip_grad_norm_(1.0), opt.step()
and opt.zero_grad(), on rank 0 of 2 ranks (experts: of the example MoE GPT), after two warm-up steps (the first
records what later ones repeat). A function counts whole, with its
docstring, once, however often it runs: that is what a reader opens. The
layers' math (tiny_zero/module) and the collectives (tiny_zero/comm.py)
count; the checkpoints do not, as the step does not run them. A file whose
docstring says "a first reader may skip this file" (torch's conventions,
the ranks' agreements) is counted apart: what the step runs there keeps
torch's behaviour, not the strategy's, though a reader meets its calls.
Wrapping the model and making its optimizer count apart too (the wrap-time
layout, which says what the step's state holds: zero3's owned_start, a
unit's buffer), in the files to follow, each function not in the step.
docs/diff-guide.md quotes the table; tests/test_layout.py keeps it true.
"""
import ast
import functools
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tiny_zero"


class Reached:
    """The line ranges of the package's functions called while active."""

    def __init__(self):
        self.codes = set()

    def __enter__(self):
        sys.setprofile(self.profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    def profile(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            self.codes.add(frame.f_code)

    def lines(self):
        """{file relative to the repository: lines of the functions reached}."""
        return {path: len(lines) for path, lines in self.ranges().items()}

    def ranges(self):
        """{file relative to the repository: {line numbers of the functions reached}}."""
        ranges = {}
        for code in self.codes:
            if code.co_name == "<module>":
                continue
            try:
                source, first = inspect.getsourcelines(code)
            except OSError:
                continue
            path = str(Path(code.co_filename).relative_to(ROOT))
            ranges.setdefault(path, set()).update(range(first, first + len(source)))
        return dict(sorted(ranges.items()))


def step_lines(name):
    """{"step": {file: lines} that one steady step of strategy `name` reaches
    on this rank, "wrap": {file: lines} of the functions that wrapping the
    model and making its optimizer run, the step's aside}."""
    import torch

    import tiny_zero
    from example.model import build_model

    torch.manual_seed(0)
    wrapper, adamw = tiny_zero.STRATEGIES[name] if name in tiny_zero.STRATEGIES else OTHERS[name]()
    module = build_model("moe-tiny" if name == "experts" else "tiny")
    with Reached() as wrapping:
        model = wrapper(module)
        opt = adamw(model, lr=1e-3)
    x = torch.randint(0, 256, (2, 16))

    def step():
        model(x, x).backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    step()
    step()
    with Reached() as reached:
        step()
    stepped = reached.ranges()
    wrap = {f: len(lines - stepped.get(f, set())) for f, lines in wrapping.ranges().items()}
    return {"step": reached.lines(), "wrap": {f: n for f, n in wrap.items() if n}}


def experts():
    from tiny_zero.experts import ExpertParallel, ExpertParallelAdamW
    return ExpertParallel, ExpertParallelAdamW


OTHERS = {"experts": experts}  # beside the data-parallel ones: the example MoE GPT, experts over both ranks


def every_strategy():
    import torch.distributed as dist

    import tiny_zero
    out = {name: step_lines(name) for name in [*tiny_zero.STRATEGIES, *OTHERS]}
    return out if dist.get_rank() == 0 else None


@functools.cache
def measure():
    """{strategy: {file: lines}}, from rank 0 of a world of 2."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from harness import run_world
    return run_world(2, "reading", "every_strategy")[0]


def skipped(path):
    """A file a first reader may skip, as its docstring says."""
    doc = ast.get_docstring(ast.parse((ROOT / path).read_text())) or ""
    return "a first reader may skip this file" in " ".join(doc.split()).lower()


def followed(files):
    """{file: lines} of the files a reader follows: the others are skipped."""
    return {f: n for f, n in files.items() if not skipped(f)}


def table(figures):
    """The step's files to follow, the skip files it calls into, the wrap-time
    functions (in files to follow) that lay out the state it reads, the three
    added up, and the folder's share of the step's lines."""
    rows = ["| strategy | step: files to follow | their lines | in its folder | step's calls into files to skip: "
            "files | their lines | wrap: files to follow | their lines | whole path: lines | folder's share of "
            "the step |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, parts in figures.items():
        step, wrap = parts["step"], followed(parts["wrap"])
        follow = followed(step)
        own = sum(n for f, n in step.items() if f.startswith(f"tiny_zero/{name}/"))
        skip = len(step) - len(follow), sum(step.values()) - sum(follow.values())
        whole = sum(step.values()) + sum(wrap.values())
        share = round(100 * own / sum(step.values()))
        rows.append(f"| {name} | {len(follow)} | {sum(follow.values())} | {own} | {skip[0]} | {skip[1]} "
                    f"| {len(wrap)} | {sum(wrap.values())} | {whole} | {share}% |")
    return "\n".join(rows)


if __name__ == "__main__":
    import argparse
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    figures = measure()
    for name, parts in figures.items():
        files = parts["step"]
        print(name, followed(files), "skipped:", sorted(set(files) - set(followed(files))),
              "wrap:", followed(parts["wrap"]))
    print(table(figures))
