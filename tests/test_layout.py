"""The house: each strategy folder tells its strategy's story, and the
folders stay parallel, so that `diff -ru tiny_zero/zero2 tiny_zero/zero3`
shows what one more level of sharding changes.

- ddp, zero1, zero2, zero3, fsdp and offload, and the model-parallel tensor,
  have the same four files, the same public names per role (the <Prefix>Layer mixin and LAYER_CLASSES in
  layers.py, the wrapper in wrapper.py, <Prefix>AdamW in optim.py), and a
  docstring on top of each file that says what the strategy holds and sends.
- What a reader follows in one training step (tests/reading.py: the
  functions the step runs, outside the files a first reader may skip) stays
  within MOST_LINES_TO_FOLLOW lines in MOST_FILES_TO_FOLLOW files, and a
  folder's page lists the shared files it imports in its reading order.
- No file of the package is over MOST_FILE_LINES lines (measure/ and
  checkpoint/ aside), and no class over MOST_CLASS_LINES.
- Every `# STRATEGY` line is inside a strategy folder. A short function of
  such lines may stand in two folders (the same collective in zero1 and
  zero2, say); any other copied function body may not: shared logic lives
  in one place.
- A wrapper's MRO holds at most four tiny_zero classes (offload: five): it
  holds p.grad's conventions, the clip, the state dicts and Join as objects
  (model.torch_grads, model.clipping, model.state_dicts, model.joining).
- No import runs back up: nothing inside the package imports a name from its
  __init__, and the shared files import no strategy folder and no tooling.
- pipeline, the model-parallel folder, is held to the same rules, with one
  file more (schedule.py: what each stage runs, in which order); it is not in
  tiny_zero.STRATEGIES, whose users wrap any module data-parallel.
"""
import ast
import re
import sys
from itertools import combinations
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tiny_zero  # noqa: E402
from tiny_zero.module.swap import DEFAULT_CLASSES  # noqa: E402
from tiny_zero.hooked import HookedLayer  # noqa: E402
from tiny_zero.pipeline import Pipeline, PipelineAdamW  # noqa: E402
from tiny_zero.optimizer import StrategyAdamW  # noqa: E402
from tiny_zero.step import LayerMoments, StrategyLayer, Wrapper  # noqa: E402
from tiny_zero.guards import ConversionGuard  # noqa: E402
from tiny_zero.tensor import TensorParallel, TensorParallelAdamW  # noqa: E402

DATA_PARALLEL = ["ddp", "zero1", "zero2", "zero3", "fsdp", "offload"]
# tensor and pipeline are not in tiny_zero.STRATEGIES: the ranks of one replica take the same
# batch, where what iterates STRATEGIES gives every rank its own
CLASSES = {**{name: tiny_zero.STRATEGIES[name] for name in DATA_PARALLEL},
           "tensor": (TensorParallel, TensorParallelAdamW), "pipeline": (Pipeline, PipelineAdamW)}
FOLDERS = list(CLASSES)  # every strategy folder
# context (the sequence split) is a strategy folder too, of other files: ddp's wrapper and layers, its own attention
# experts (the MoE layers over ranks) too: a data-parallel wrapper for the rest, its own all-to-alls
STRATEGY_FOLDERS = FOLDERS + ["context", "experts"]
FILES = {"__init__.py", "layers.py", "wrapper.py", "optim.py"}
DOCUMENTED = ["layers.py", "wrapper.py", "optim.py"]  # the files a reader reads top to bottom
EXTRA = {"pipeline": ["schedule.py", "messages.py", "stages.py"]}  # files a folder has beyond the four
PACKAGE = ROOT / "tiny_zero"
TOOLING = ("checkpoint", "measure", "engine.py", "explain.py")  # above the strategies: they may import them
MOST_LINES_TO_FOLLOW = 1000  # zero3's and fsdp's step, the layers' math and the collectives included
MOST_FILES_TO_FOLLOW = 10  # zero3, fsdp: 9; offload: 10 (the host's fused AdamW)
MOST_FILE_LINES = 400
MOST_CLASS_LINES = 300
LONG_FILES_ALLOWED = ("measure", "checkpoint")  # tooling, not a step
MOST_COPIED_LINES = 6  # a function body marked # STRATEGY this short may stand in two folders
MOST_BASES = {"offload": 5}  # tiny_zero classes in a wrapper's MRO, itself included (else 4): offload adds HostMemory


def folder(name):
    return PACKAGE / name


def files(name):
    return FILES | set(EXTRA.get(name, []))


def documented(name):
    return DOCUMENTED + EXTRA.get(name, [])


def tree(path):
    return ast.parse(path.read_text(), filename=str(path))


def top_level_names(path):
    names = set()
    for node in tree(path).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def prefix(name):
    """DDP, Zero1, ...: the wrapper's class name, which every public name starts with."""
    return CLASSES[name][0].__name__


def test_the_strategies_include_the_data_parallel_ones():
    assert list(tiny_zero.STRATEGIES) == DATA_PARALLEL


@pytest.mark.parametrize("name", FOLDERS)
def test_same_files_in_every_folder(name):
    found = {p.name for p in folder(name).iterdir() if p.name != "__pycache__"}
    assert found == files(name), f"tiny_zero/{name}: {sorted(found)} (expected {sorted(files(name))})"


@pytest.mark.parametrize("name", FOLDERS)
def test_layers_define_the_mixin_and_layer_classes(name):
    names = top_level_names(folder(name) / "layers.py")
    expected = {prefix(name) + "Layer", "LAYER_CLASSES"}
    assert expected <= names, f"tiny_zero/{name}/layers.py lacks {sorted(expected - names)}"
    module = __import__(f"tiny_zero.{name}.layers", fromlist=["LAYER_CLASSES"])
    mixin = getattr(module, prefix(name) + "Layer")
    assert set(module.LAYER_CLASSES) == set(DEFAULT_CLASSES) | {HookedLayer}
    hooked = module.LAYER_CLASSES[HookedLayer]  # the same moments for the modules reached through hooks
    assert hooked.__name__ == prefix(name) + "Hooked" and hooked.__mro__[1:4] == (HookedLayer, mixin, LayerMoments)
    for torch_class, cls in module.LAYER_CLASSES.items():
        if torch_class is HookedLayer:
            continue
        assert cls.__name__ == prefix(name) + DEFAULT_CLASSES[torch_class].__name__
        assert cls.__mro__[1:6] == (StrategyLayer, ConversionGuard, mixin, LayerMoments, DEFAULT_CLASSES[torch_class])
    assert CLASSES[name][0].layer_classes is module.LAYER_CLASSES
    written = {node.name for node in tree(folder(name) / "layers.py").body if isinstance(node, ast.ClassDef)}
    unwritten = [cls.__name__ for cls in module.LAYER_CLASSES.values() if cls.__name__ not in written]
    assert not unwritten, f"tiny_zero/{name}/layers.py: {unwritten} not written as a class statement (grep finds none)"


def tiny_zero_bases(cls):
    """The tiny_zero classes of a class's MRO, itself first."""
    return [base.__name__ for base in cls.__mro__ if base.__module__.startswith("tiny_zero")]


@pytest.mark.parametrize("name", DATA_PARALLEL)
def test_a_wrapper_holds_its_conventions_rather_than_inheriting_them(name):
    """A wrapper inherits Wrapper and Wrapping, and at most its shared means
    (zero3, fsdp: Unsharding; zero1, zero2: HeldInChunks; offload: HostMemory
    too): p.grad's conventions, the clip, fp16's scale, the state dicts and
    Join are objects it holds, found by name."""
    most = MOST_BASES.get(name, 4)
    bases = tiny_zero_bases(CLASSES[name][0])
    assert len(bases) <= most, f"{name}: {len(bases)} tiny_zero classes in its MRO (at most {most}): {bases}"

def test_no_attribute_assignment_has_side_effects():
    """No __setattr__ in the package: `self.buckets = ...` only assigns."""
    found = [str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*.py")
             if any(isinstance(node, ast.FunctionDef) and node.name == "__setattr__" for node in ast.walk(tree(path)))]
    assert not found, f"__setattr__ defined in {found}"


@pytest.mark.parametrize("name", FOLDERS)
def test_wrapper_and_optim_define_the_registered_classes(name):
    wrapper, optimizer = CLASSES[name]
    assert wrapper.__name__ in top_level_names(folder(name) / "wrapper.py")
    assert wrapper.__module__ == f"tiny_zero.{name}.wrapper" and issubclass(wrapper, Wrapper)
    assert optimizer.__name__ == prefix(name) + "AdamW"
    assert optimizer.__name__ in top_level_names(folder(name) / "optim.py")
    assert optimizer.__module__ == f"tiny_zero.{name}.optim" and issubclass(optimizer, StrategyAdamW)
    package = __import__(f"tiny_zero.{name}", fromlist=["__all__"])
    assert sorted(package.__all__) == sorted([wrapper.__name__, optimizer.__name__])


@pytest.mark.parametrize("name", FOLDERS)
def test_every_hook_of_the_base_wrapper_is_filled_in(name):
    wrapper = CLASSES[name][0]
    hooks = [n for base in Wrapper.__mro__ if base.__module__.startswith("tiny_zero")
             for n, f in vars(base).items() if callable(f) and raises_not_implemented(f)]
    assert hooks, "the base wrapper declares no hook"
    missing = [h for h in hooks if raises_not_implemented(getattr(wrapper, h))]
    assert not missing, f"{wrapper.__name__} does not fill in {missing}"


def raises_not_implemented(function):
    body = ast.parse(ast.unparse(tree_of(function))).body[0].body
    return any(isinstance(node, ast.Raise) and "NotImplementedError" in ast.unparse(node) for node in body)


def tree_of(function):
    import inspect
    import textwrap
    return ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]


@pytest.mark.parametrize("name, file", [(name, file) for name in FOLDERS for file in documented(name)])
def test_each_file_starts_with_a_docstring(name, file):
    body = tree(folder(name) / file).body
    first = body[0] if body else None
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
        and isinstance(first.value.value, str) and first.value.value.strip(), \
        f"tiny_zero/{name}/{file} does not start with a docstring"


# ---------------------------------------------------------------- repetition

def functions(path):
    """(qualified name, normalised body, code lines, marked lines) of every
    function with a body of at least three statements: one-liners (a hook
    that calls a shared helper, say) may legitimately look alike."""
    text = path.read_text().splitlines()
    found = []

    def walk(node, qualified):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                walk(child, qualified + child.name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if sum(isinstance(n, ast.stmt) for n in ast.walk(child)) - 1 >= 3:
                    lines = text[child.body[0].lineno - 1:child.end_lineno]
                    code = [line for line in lines if line.split("#", 1)[0].strip()]
                    found.append((qualified + child.name, ast.dump(ast.Module(body=child.body, type_ignores=[])),
                                  len(code), sum("# STRATEGY" in line for line in code)))
    walk(tree(path), "")
    return found


def test_no_logic_is_copied_between_strategy_folders():
    """Shared logic lives in a shared file: no function body of three or more
    statements stands in two strategy folders, unless it is a few lines that
    are the strategy itself (at most MOST_COPIED_LINES, some marked # STRATEGY:
    zero1's and zero2's all-gather after the step, say)."""
    bodies = {name: {} for name in FOLDERS}
    for name in FOLDERS:
        for file in sorted(files(name)):
            for qualified, dump, lines, marked in functions(folder(name) / file):
                bodies[name][dump] = (f"tiny_zero/{name}/{file}: {qualified}", lines, marked)
    copies = [(bodies[a][d][0], bodies[b][d][0]) for a, b in combinations(FOLDERS, 2)
              for d in set(bodies[a]) & set(bodies[b])
              if bodies[a][d][1] > MOST_COPIED_LINES or not bodies[a][d][2]]
    assert not copies, f"the same function body in two strategies (share it instead): {copies}"


def test_every_strategy_line_is_in_a_strategy_folder():
    outside = [f"{path.relative_to(ROOT)}:{n}" for path in PACKAGE.rglob("*.py")
               if path.parent.name not in STRATEGY_FOLDERS
               for n, line in enumerate(path.read_text().splitlines(), 1) if "# STRATEGY" in line]
    assert not outside, f"# STRATEGY lines outside the strategy folders: {outside}"


@pytest.mark.parametrize("name", FOLDERS)
def test_each_folder_marks_its_strategy(name):
    marked = sum("# STRATEGY" in line for file in documented(name)
                 for line in (folder(name) / file).read_text().splitlines())
    assert marked >= 2, f"tiny_zero/{name} marks {marked} lines # STRATEGY"


# ---------------------------------------------------------------- imports

def imported_files(path):
    """The package files that `path` imports from (relative imports), as
    paths relative to ROOT: a name from a package resolves to its own file."""
    found = set()
    base = path.parent
    for node in ast.walk(tree(path)):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        package = base
        for _ in range(node.level - 1):
            package = package.parent
        target = package.joinpath(*node.module.split(".")) if node.module else package
        for alias in node.names:
            found.add(defining_file(target, alias.name))
    return {f.relative_to(ROOT).as_posix() for f in found}


def defining_file(target, name):
    if (target / f"{name}.py").is_file():  # `from .. import comm`
        return target / f"{name}.py"
    if target.is_dir():  # `from ..module import expects_backward`: the file of the package that defines it
        for file in sorted(target.glob("*.py")):
            if name in top_level_names(file) and file.name != "__init__.py":
                return file
        return target / "__init__.py"
    return target.with_suffix(".py")


def shared_files(name):
    return sorted(f for file in files(name) for f in imported_files(folder(name) / file)
                  if not f.startswith(f"tiny_zero/{name}/"))


def reading_order(name):
    """The tiny_zero files listed under the page's "Reading order" heading."""
    page = (ROOT / "docs" / f"{name}.md").read_text()
    section = re.search(r"^## Reading order\n(.*?)(?=^## |\Z)", page, re.MULTILINE | re.DOTALL)
    assert section, f"docs/{name}.md has no '## Reading order' section"
    return re.findall(r"(tiny_zero/[\w/]+\.py)", section.group(1))


@pytest.mark.parametrize("name", FOLDERS)
def test_the_reading_order_lists_the_folder_and_the_shared_files_it_imports(name):
    shared = sorted(set(shared_files(name)))
    order = reading_order(name)
    own = {f"tiny_zero/{name}/{f}" for f in documented(name)}
    assert own | set(shared) <= set(order), f"docs/{name}.md's reading order {order} lacks some of {own} {shared}"


@pytest.mark.slow
def test_one_step_reads_in_a_bounded_number_of_lines_and_files():
    """What one steady step of each data-parallel strategy makes a reader
    follow (tests/reading.py), the files a first reader may skip aside.
    experts' row is ddp's step and the MoE layers' together: not bounded."""
    import reading
    for name, parts in reading.measure().items():
        if name not in DATA_PARALLEL:
            continue
        follow = reading.followed(parts["step"])
        assert sum(follow.values()) <= MOST_LINES_TO_FOLLOW, (name, follow)
        assert len(follow) <= MOST_FILES_TO_FOLLOW, (name, sorted(follow))


def test_no_import_runs_back_up():
    """Nothing inside the package imports from its __init__ (only
    submodules); the shared files import no strategy folder and no tooling."""
    problems = []
    strategies = set(STRATEGY_FOLDERS)
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tiny_zero" for a in node.names):
                problems.append(f"{rel}: import tiny_zero")
            if isinstance(node, ast.ImportFrom) and node.level and not node.module:
                package = path.parent
                for _ in range(node.level - 1):
                    package = package.parent
                for alias in node.names:  # `from .. import x`: x must be a submodule
                    if not ((package / f"{alias.name}.py").is_file() or (package / alias.name).is_dir()):
                        problems.append(f"{rel}: imports {alias.name} from a package __init__")
        top = rel.parts[0]
        if top not in strategies and top not in TOOLING and top != "__init__.py":
            for f in imported_files(path):
                part = f.split("/")[1]
                if part in strategies or part in TOOLING:
                    problems.append(f"{rel}: a shared file imports {f}")
    assert not problems, problems


def test_the_readme_bounds_the_data_parallel_folders_length():
    """The README's opening says how long a strategy folder is: it must stay true."""
    counts = {name: sum(len(p.read_text().splitlines()) for p in folder(name).glob("*.py")) for name in DATA_PARALLEL}
    opening = re.sub(r"\s+", " ", (ROOT / "README.md").read_text()[:600])
    claim = re.search(r"one folder per strategy, under (\d+) lines each", opening)
    assert claim, "the README's opening no longer says how many lines a strategy folder has"
    assert max(counts.values()) < int(claim[1]), counts


def test_the_diff_guide_says_what_one_step_makes_a_reader_follow():
    """docs/diff-guide.md's table of the lines and files one steady step of
    each strategy runs (tests/reading.py) is what the code gives."""
    import reading
    page = (ROOT / "docs" / "diff-guide.md").read_text()
    assert reading.table(reading.measure()) in page


# ---------------------------------------------------------------- sizes

def test_no_file_or_class_is_too_long():
    """A file a reader opens fits a sitting: no file over MOST_FILE_LINES lines
    outside measure/ and checkpoint/, no class over MOST_CLASS_LINES anywhere."""
    long_files, long_classes = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        lines = len(path.read_text().splitlines())
        if rel.parts[0] not in LONG_FILES_ALLOWED and lines > MOST_FILE_LINES:
            long_files.append(f"tiny_zero/{rel.as_posix()}: {lines} lines")
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MOST_CLASS_LINES:
                long_classes.append(f"tiny_zero/{rel.as_posix()}: {node.name}, {node.end_lineno - node.lineno + 1} lines")
    assert not long_files, f"files over {MOST_FILE_LINES} lines: {long_files}"
    assert not long_classes, f"classes over {MOST_CLASS_LINES} lines: {long_classes}"
