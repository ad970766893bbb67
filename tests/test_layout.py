"""The strategy folders stay parallel, so that `diff -ru tiny_zero/zero2
tiny_zero/zero3` shows only what the strategy changes.

Each of ddp, zero1, zero2, zero3 and fsdp has the same four files, the same
public names per role (the <Prefix>Layer mixin and LAYER_CLASSES in
layers.py, the wrapper in wrapper.py, <Prefix>AdamW in optim.py), and a
docstring at the top of each file that says what the strategy holds and
sends. Logic shared by strategies lives in one place, not in copies.
"""
import ast
import sys
from itertools import combinations
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tiny_zero  # noqa: E402
from tiny_zero.module import DEFAULT_CLASSES  # noqa: E402
from tiny_zero.strategy import StrategyAdamW, Wrapper  # noqa: E402

NAMES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
FILES = {"__init__.py", "layers.py", "wrapper.py", "optim.py"}
DOCUMENTED = ["layers.py", "wrapper.py", "optim.py"]  # the files a reader reads top to bottom


def folder(name):
    return ROOT / "tiny_zero" / name


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
    return tiny_zero.STRATEGIES[name][0].__name__


def test_strategies_are_the_five_names():
    assert list(tiny_zero.STRATEGIES) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_same_files_in_every_folder(name):
    files = {p.name for p in folder(name).iterdir() if p.name != "__pycache__"}
    assert files == FILES, f"tiny_zero/{name}: {sorted(files)} (expected {sorted(FILES)})"


@pytest.mark.parametrize("name", NAMES)
def test_layers_define_the_mixin_and_layer_classes(name):
    names = top_level_names(folder(name) / "layers.py")
    expected = {prefix(name) + "Layer", "LAYER_CLASSES"}
    assert expected <= names, f"tiny_zero/{name}/layers.py lacks {sorted(expected - names)}"

    module = __import__(f"tiny_zero.{name}.layers", fromlist=["LAYER_CLASSES"])
    assert set(module.LAYER_CLASSES) == set(DEFAULT_CLASSES)  # nn.Linear ... nn.RMSNorm, Conv1D
    for kind, cls in module.LAYER_CLASSES.items():
        assert cls.__name__ == prefix(name) + kind.__name__
        assert issubclass(cls, DEFAULT_CLASSES[kind])
    assert tiny_zero.STRATEGIES[name][0].layer_classes is module.LAYER_CLASSES


@pytest.mark.parametrize("name", NAMES)
def test_model_and_optim_define_the_registered_classes(name):
    wrapper, optimizer = tiny_zero.STRATEGIES[name]
    assert wrapper.__name__ in top_level_names(folder(name) / "wrapper.py")
    assert wrapper.__module__ == f"tiny_zero.{name}.wrapper" and issubclass(wrapper, Wrapper)
    assert optimizer.__name__ == prefix(name) + "AdamW"
    assert optimizer.__name__ in top_level_names(folder(name) / "optim.py")
    assert optimizer.__module__ == f"tiny_zero.{name}.optim" and issubclass(optimizer, StrategyAdamW)
    package = __import__(f"tiny_zero.{name}", fromlist=["__all__"])
    assert sorted(package.__all__) == sorted([wrapper.__name__, optimizer.__name__])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("file", DOCUMENTED)
def test_each_file_starts_with_a_docstring(name, file):
    body = tree(folder(name) / file).body
    first = body[0] if body else None
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
        and isinstance(first.value.value, str) and first.value.value.strip(), \
        f"tiny_zero/{name}/{file} does not start with a docstring"


def functions(path):
    """(qualified name, normalised source) of every function with a body of
    at least three statements: small ones (`pass`, one-line getters) may
    legitimately look alike."""
    found = []

    def walk(node, prefix_):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                walk(child, prefix_ + child.name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                statements = sum(isinstance(n, ast.stmt) for n in ast.walk(child)) - 1
                if statements >= 3:
                    body = ast.Module(body=child.body, type_ignores=[])
                    found.append((prefix_ + child.name, ast.dump(body)))
    walk(tree(path), "")
    return found


def test_no_logic_is_copied_between_strategy_folders():
    """Shared logic lives in module/, optim/ or a shared helper: no function
    body of three or more statements appears in two strategy folders."""
    bodies = {name: {} for name in NAMES}
    for name in NAMES:
        for file in sorted(FILES):
            for qualname, dump in functions(folder(name) / file):
                bodies[name][dump] = f"tiny_zero/{name}/{file}: {qualname}"
    copies = [(bodies[a][d], bodies[b][d]) for a, b in combinations(NAMES, 2)
              for d in set(bodies[a]) & set(bodies[b])]
    assert not copies, f"the same function body in two strategies (share it instead): {copies}"
