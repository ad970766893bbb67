"""The docs (README.md and docs/*.md) say what the code does, and keep saying it.

- every ```python block runs (the blocks of one page share a namespace, like
  a notebook; a block can opt out with a first line `# not run: <reason>`,
  and one whose reason is `quoted from <file>` must match that file line for
  line);
- every ```diff block quotes lines that are in the two files it names;
- every command (```bash lines, and inline `python ...`/`torchrun ...` spans)
  names scripts and paths that exist and only flags (and choices) that the
  script's `--help`, or torchrun's, lists;
- every `tiny_zero.x.y` / `from tiny_zero... import name` reference imports,
  every `file.py: Class.function` and `tests/...py::test_name` citation
  exists, and every local link (and #anchor) resolves;
- each strategy page has a mermaid sequence diagram, cites every function
  of its folder that carries a `# STRATEGY` mark, and its byte table for gpt2
  is what the code's own layout gives.
"""
import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp", "offload"]
MODEL_PARALLEL = ["tensor", "pipeline", "context", "experts"]  # strategy pages too, without the data-parallel byte table
# Written by the benchmark work; pages may link to it before it lands. Once
# the file exists it is checked like every other page.
PENDING = {"docs/benchmarks.md"}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"#\s*not run\b:?\s*(.*)")


def rel(path):
    return path.relative_to(ROOT).as_posix()


def page_id(page):
    return rel(page)


@lru_cache(maxsize=None)
def text(page):
    return page.read_text()


def blocks(page, lang=None):
    """(language, body, line number) of each fenced block."""
    found = []
    for m in FENCE.finditer(text(page)):
        if lang is None or m.group(1) == lang:
            found.append((m.group(1), m.group(2), text(page).count("\n", 0, m.start()) + 1))
    return found


def prose(page):
    """The page without its fenced blocks."""
    return FENCE.sub("", text(page))


def code_spans(page):
    return [re.sub(r"\s+", " ", s).strip() for s in re.findall(r"`([^`]+)`", prose(page))]


# ---------------------------------------------------------------- python blocks

RUNNER = textwrap.dedent("""
    import contextlib, io, json, sys, traceback
    import torch
    torch.set_num_threads(1)
    results = {}
    for page, codes in json.loads(sys.argv[1]).items():
        namespace = {"__name__": "__main__"}
        for line, code in codes:
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    exec(compile(code, f"{page}, block at line {line}", "exec"), namespace)
                error = None
            except BaseException:
                error = traceback.format_exc()
            results.setdefault(page, []).append([line, error])
    print(json.dumps(results))
""")


def runnable(page):
    return [(line, body) for _, body, line in blocks(page, "python") if not NOT_RUN.match(body.lstrip())]


@pytest.fixture(scope="module")
def block_results():
    """Run every page's python blocks in one subprocess (one torch import)."""
    todo = {page_id(p): runnable(p) for p in PAGES if runnable(p)}
    if not todo:
        return {}
    result = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(todo)], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_blocks_run(page, block_results):
    errors = [f"block at line {line}:\n{error}" for line, error in block_results.get(page_id(page), []) if error]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_blocks_not_run_say_why_and_quotes_match(page):
    problems = []
    for _, body, line in blocks(page, "python"):
        first, _, rest = body.lstrip().partition("\n")
        m = NOT_RUN.match(first)
        if not m:
            continue
        reason = m.group(1).strip()
        if not reason:
            problems.append(f"line {line}: '# not run:' needs a reason")
            continue
        quoted = re.match(r"quoted from (\S+)", reason)
        if quoted:
            source = ROOT / quoted.group(1)
            if not source.is_file():
                problems.append(f"line {line}: quotes {quoted.group(1)}, which does not exist")
                continue
            lines = set(source.read_text().splitlines())
            problems += [f"line {line}: not in {quoted.group(1)}: {q!r}"
                         for q in rest.splitlines() if q.strip() and q.rstrip() not in lines]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- diff blocks

@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_quoted_diffs_match_the_code(page):
    problems = []
    for _, body, line in blocks(page, "diff"):
        lines = body.splitlines()
        if len(lines) < 2 or not lines[0].startswith("--- ") or not lines[1].startswith("+++ "):
            problems.append(f"line {line}: a diff block starts with '--- old' and '+++ new'")
            continue
        old, new = (ROOT / lines[i][4:].split()[0] for i in (0, 1))
        if not old.is_file() or not new.is_file():
            problems.append(f"line {line}: {rel(old) if old.exists() else old} or {new} does not exist")
            continue
        old_lines, new_lines = set(old.read_text().splitlines()), set(new.read_text().splitlines())
        for q in lines[2:]:
            if q.startswith("@@"):
                continue
            kind, content = q[:1], q[1:].rstrip()
            where = {"-": [old_lines], "+": [new_lines], " ": [old_lines, new_lines], "": [old_lines, new_lines]}
            if kind not in where:
                problems.append(f"line {line}: not a diff line: {q!r}")
            elif not all(content in lines_ for lines_ in where[kind]):
                problems.append(f"line {line}: {q!r} is not in {rel(old) if kind == '-' else rel(new)}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- commands

REPO_PATH = re.compile(r"^(tiny_zero|example|tests|docs)(/[\w./-]*)?$")
PYTHONS = {"python", "python3"}
TORCHRUN = "torchrun"


def commands(page):
    """Shell commands of a page: ```bash lines and inline python/torchrun spans."""
    found = []
    for _, body, line in blocks(page, "bash"):
        for command_line in body.replace("\\\n", " ").splitlines():
            command_line = command_line.strip()
            if command_line and not command_line.startswith("#"):
                found += [c for c in re.split(r"&&|\|\||;|\|", command_line) if c.strip()]
    found += [s for s in code_spans(page) if s.split()[0] in PYTHONS | {TORCHRUN}]
    return found


def parse(command):
    """-> (launcher flags or None, script or module, script args), or None for other programs."""
    words = shlex.split(command, comments=True)
    while words and re.match(r"^\w+=", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return None
    if words[0] in PYTHONS and words[1:3] == ["-m", "torch.distributed.run"]:
        words = [TORCHRUN] + words[3:]
    if words[0] == TORCHRUN:
        for i, w in enumerate(words[1:], 1):
            if w.endswith(".py"):
                return ("torchrun", words[1:i]), w, words[i + 1:]
        return ("torchrun", words[1:]), None, []
    if words[0] in PYTHONS:
        if words[1:2] == ["-m"]:
            return None, "-m " + words[2], words[3:]
        return None, words[1], words[2:]
    return None


@lru_cache(maxsize=None)
def help_text_of(key):
    return _help_texts()[key]


_HELP = {}


# `--help` of many scripts in one process: torch is imported once, not once a script
_HELP_ALL = r"""
import contextlib, io, json, runpy, sys
out = {}
for key in sys.argv[1:]:
    sys.argv, text, code = [key, "--help"], io.StringIO(), None
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            if key == "torchrun":
                runpy.run_module("torch.distributed.run", run_name="__main__")
            else:
                runpy.run_path(key, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except Exception as e:
        code = repr(e)
    out[key] = text.getvalue() if code in (0, None) else None
print("HELP-JSON " + json.dumps(out))
"""


def _help_texts():
    """`--help` of every script the docs run (and torchrun's): all in one
    process; a script whose --help fails there is run again on its own."""
    if _HELP:
        return _HELP
    wanted = {"torchrun"}
    for page in PAGES:
        for command in commands(page):
            parsed = parse(command)
            if parsed and parsed[1] and parsed[1].endswith(".py") and (ROOT / parsed[1]).is_file():
                wanted.add(parsed[1])
    done = subprocess.run([sys.executable, "-c", _HELP_ALL, *sorted(wanted)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("HELP-JSON ")]
    _HELP.update(json.loads(lines[-1][len("HELP-JSON "):]) if lines else {})
    for key in sorted(wanted):
        if _HELP.get(key) is None:
            argv = [sys.executable, "-m", "torch.distributed.run", "--help"] if key == "torchrun" \
                else [sys.executable, key, "--help"]
            alone = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
            _HELP[key] = alone.stdout + alone.stderr if alone.returncode == 0 else None
    return _HELP


def flags_and_choices(help_text):
    flags = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", help_text))
    choices = {flag: set(values.split(",")) for flag, values in re.findall(r"(--[\w-]+) \{([^}]*)\}", help_text)}
    return flags, choices


def check_args(args, help_text, what):
    flags, choices = flags_and_choices(help_text)
    problems = []
    for i, arg in enumerate(args):
        if not arg.startswith("-") or re.match(r"^-\d", arg):
            continue
        name, _, value = arg.partition("=")
        if name not in flags:
            problems.append(f"{what} has no flag {name}")
        elif name in choices:
            value = value or (args[i + 1] if i + 1 < len(args) else "")
            if value not in choices[name]:
                problems.append(f"{what} {name}: {value!r} is not one of {sorted(choices[name])}")
    return problems


def check_command(command):
    problems = []
    for word in shlex.split(command, comments=True):
        if REPO_PATH.match(word) and not (ROOT / word).exists():
            problems.append(f"no such path: {word}")
    parsed = parse(command)
    if parsed is None:
        return problems
    launcher, target, args = parsed
    if launcher:
        problems += check_args(launcher[1], help_text_of("torchrun"), "torchrun")
    if target is None:
        return problems + ["no script to run"]
    if target.startswith("-m "):
        module = target[3:]
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            problems.append(f"no module {module}")
        return problems
    if not (ROOT / target).is_file():
        return problems + [f"no script {target}"]
    help_text = help_text_of(target)
    if help_text is None:
        return problems + [f"{target} --help failed"]
    return problems + check_args(args, help_text, target)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_commands_use_existing_scripts_and_flags(page):
    problems = [f"`{c.strip()}`: {p}" for c in commands(page) for p in check_command(c)]
    assert not problems, "\n".join(problems)


def test_the_flag_check_catches_a_stale_flag():
    assert check_command("torchrun --nproc_per_node 2 example/zero3/train.py --model tiny") == []
    assert check_command("torchrun --nproc_per_node 2 example/zero3/train.py --no-such-flag 1")
    assert check_command("python example/zero3/train.py --model gpt5")
    assert check_command("torchrun --nodes 2 example/zero3/train.py")
    assert check_command("python example/zero9/train.py")


# ---------------------------------------------------------------- names, citations, links

NAME = re.compile(r"(?<![\w./])(tiny_zero(?:\.[A-Za-z_]\w*)+)")
EXAMPLE_NAME = re.compile(r"(?<![\w./])(example(?:\.[A-Za-z_]\w*)+)")
FROM_IMPORT = re.compile(r"from\s+((?:tiny_zero|example)(?:\.\w+)*)\s+import\s+\(?([\w\s,]+?)\)?\s*(?:#|$)",
                         re.MULTILINE)


def resolve(dotted):
    """Import the longest module prefix of `dotted`, then getattr the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def references(page):
    code = "\n".join(body for _, body, _ in blocks(page)) + "\n" + "\n".join(code_spans(page))
    names = set(NAME.findall(text(page))) | set(EXAMPLE_NAME.findall(code))
    for module, imported in FROM_IMPORT.findall(code):
        for item in imported.split(","):
            item = item.split(" as ")[0].strip()
            if item:
                names.add(f"{module}.{item}")
    return sorted(names)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_names_resolve(page):
    problems = []
    for name in references(page):
        try:
            resolve(name)
        except (ImportError, AttributeError) as e:
            problems.append(f"{name}: {type(e).__name__}: {e}")
    assert not problems, "\n".join(problems)


def defined_names(path):
    """Qualified names of the classes and functions defined in a file."""
    names = set()

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(prefix + child.name)
                walk(child, prefix + child.name + ".")
    walk(ast.parse(path.read_text()), "")
    return names


CITATION = re.compile(r"^((?:tiny_zero|example)/[\w/]+\.py): ([\w.]+)$")
TEST_CITATION = re.compile(r"^(tests/[\w/]+\.py)::(\w+)")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_cited_code_and_tests_exist(page):
    problems = []
    for span in code_spans(page):
        m = CITATION.match(span) or TEST_CITATION.match(span)
        if m:
            path, name = ROOT / m.group(1), m.group(2)
            if not path.is_file():
                problems.append(f"{span}: no file {m.group(1)}")
            elif name not in defined_names(path):
                problems.append(f"{span}: {m.group(1)} defines no {name}")
        elif REPO_PATH.match(span) and not (ROOT / span).exists():
            problems.append(f"{span}: no such path")
    assert not problems, "\n".join(problems)


def slug(heading):
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page):
    return {slug(h) for h in re.findall(r"^#+\s+(.*)$", prose(page), re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_local_links_exist(page):
    problems = []
    for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose(page)):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            if rel(file) not in PENDING:
                problems.append(f"{target}: no such file")
            continue
        if anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{target}: no heading #{anchor} in {rel(file)}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- strategy pages

def strategy_page(name):
    return ROOT / "docs" / f"{name}.md"


MESSAGE = re.compile(r"^(\w+)\s*(?:-->>|->>|-->|->|--x|-x|--\)|-\))\s*[+-]?(\w+)\s*:\s*\S")
NOTE = re.compile(r"^Note (?:over|left of|right of) (\w+)(?:\s*,\s*(\w+))?\s*:\s*\S")
CONTROL = re.compile(r"^(?:loop|alt|else|opt|par|and|critical|break|rect)\b|^(?:end|autonumber)$")


def mermaid_problems(body):
    lines = [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("%%")]
    if not lines or lines[0] != "sequenceDiagram":
        return ["the diagram does not start with sequenceDiagram"]
    problems, declared, opened = [], set(), 0
    for ln in lines[1:]:
        if ";" in ln or "#" in ln or ln.count(":") > 1:
            problems.append(f"';', '#' or a second ':' may break mermaid: {ln}")
        participant = re.match(r"^(?:participant|actor) (\w+)(?: as .+)?$", ln)
        names = []
        if participant:
            declared.add(participant.group(1))
        elif MESSAGE.match(ln):
            names = MESSAGE.match(ln).groups()
        elif NOTE.match(ln):
            names = [n for n in NOTE.match(ln).groups() if n]
        elif m := re.match(r"^(?:activate|deactivate) (\w+)$", ln):
            names = [m.group(1)]
        elif CONTROL.match(ln):
            opened += ln.split()[0] in ("loop", "alt", "opt", "par", "critical", "break", "rect")
            opened -= ln == "end"
        else:
            problems.append(f"not a sequence diagram line: {ln}")
        problems += [f"undeclared participant {n}: {ln}" for n in names if n not in declared]
    if opened != 0:
        problems.append("a loop/alt/opt block is not closed by 'end'")
    return problems


@pytest.mark.parametrize("name", STRATEGIES + MODEL_PARALLEL)
def test_strategy_page_has_a_sequence_diagram(name):
    diagrams = [body for _, body, _ in blocks(strategy_page(name), "mermaid")]
    assert diagrams, f"docs/{name}.md has no mermaid block"
    assert not [p for d in diagrams for p in mermaid_problems(d)]


def strategy_marks():
    """{(file, qualified function)} holding a `# STRATEGY` comment."""
    marks = set()
    for path in sorted((ROOT / "tiny_zero").rglob("*.py")):
        lines = [i + 1 for i, ln in enumerate(path.read_text().splitlines()) if "# STRATEGY" in ln]
        if not lines:
            continue
        spans = []

        def walk(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    if not isinstance(child, ast.ClassDef):
                        spans.append((child.lineno, child.end_lineno, prefix + child.name))
                    walk(child, prefix + child.name + ".")
        walk(ast.parse(path.read_text()), "")
        for line in lines:
            inner = [s for s in spans if s[0] <= line <= s[1]]
            marks.add((rel(path), max(inner)[2] if inner else "<module>"))
    return marks


@pytest.mark.parametrize("name", STRATEGIES + MODEL_PARALLEL)
def test_strategy_page_cites_every_marked_function(name):
    cited = {f"{m.group(1)}: {m.group(2)}" for s in code_spans(strategy_page(name)) if (m := CITATION.match(s))}
    own = {f"{f}: {q}" for f, q in strategy_marks() if f.startswith(f"tiny_zero/{name}/")}
    assert own - cited == set(), f"docs/{name}.md does not cite {sorted(own - cited)}"


@pytest.mark.parametrize("name", STRATEGIES)
def test_strategy_page_shows_its_step(name):
    """The pictures example/benchmark/timeline.py draws: the strategy's timeline
    and the memory of all strategies (test_local_links_exist: they exist)."""
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", prose(strategy_page(name)))
    assert {f"timeline_{name}.png", "memory_over_step.png"} <= set(images)


def test_shared_marked_functions_are_cited_somewhere():
    cited = {f"{m.group(1)}: {m.group(2)}" for p in PAGES for s in code_spans(p) if (m := CITATION.match(s))}
    shared = {f"{f}: {q}" for f, q in strategy_marks()
              if not any(f.startswith(f"tiny_zero/{n}/") for n in STRATEGIES + MODEL_PARALLEL)}
    assert shared - cited == set(), f"no page cites {sorted(shared - cited)}"


@lru_cache(maxsize=None)
def held_elements(strategy, n):
    """Per rank: (parameter, gradient, optimizer-shard) elements of gpt2 in
    fp32 between steps, from the strategy's own layout code."""
    import torch.nn as nn
    from example.model import build_model
    from tiny_zero.buckets import make_buckets
    from tiny_zero.measure.estimate import fsdp_units
    from tiny_zero.zero3.wrapper import loads, owner_table

    model = build_model("gpt2", device="meta")
    named = list(model.named_parameters())
    params = [p for _, p in named]
    psi = sum(p.numel() for p in params)
    if strategy == "ddp":
        return [(psi, psi, psi)] * n
    if strategy in ("zero1", "zero2", "offload"):
        wrapper = resolve("tiny_zero.STRATEGIES")[strategy][0]
        bucket_bytes = inspect.signature(wrapper.__init__).parameters["bucket_bytes"].default
        padded = sum(b.numel for b in make_buckets(params[::-1], bucket_bytes, pad_to=n))
        grads = padded if strategy == "zero1" else padded // n  # zero1: its averaged chunks are in the full grads
        return [(padded, grads, padded // n)] * n
    if strategy == "zero3":
        shapes = [(name, p.numel()) for name, p in named]
        return [(owned,) * 3 for owned in loads(owner_table(shapes, n), shapes, n)]
    share = sum(u.numel for u in fsdp_units(model, n)) // n
    return [(share,) * 3] * n


def held_bytes(strategy, n):
    """Per rank: {row label: bytes} for the pages' tables (offload's fp32
    masters are apart from its parameters: 12 bytes of AdamW state)."""
    state = 12 if strategy == "offload" else 8
    return [{"parameters": 4 * p, "gradients": 4 * g, "AdamW state": state * s, "total": 4 * p + 4 * g + state * s}
            for p, g, s in held_elements(strategy, n)]


def byte_table(page):
    """{(row label, column header): bytes} of the table headed 'bytes on one rank'."""
    rows = [ln for ln in prose(page).splitlines() if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in rows]
    start = next(i for i, c in enumerate(cells) if c[0].startswith("bytes on one rank"))
    header, table = cells[start], {}
    for row in cells[start + 2:]:
        if not any(row[0].startswith(label) for label in held_bytes("ddp", 1)[0]):
            break
        label = next(label for label in held_bytes("ddp", 1)[0] if row[0].startswith(label))
        for column, cell in zip(header[2:], row[2:]):
            table[label, column] = int(re.search(r"\d[\d,]*", cell).group().replace(",", ""))
    return table


@pytest.mark.parametrize("name", STRATEGIES)
def test_strategy_byte_table_is_what_the_code_holds(name):
    table = byte_table(strategy_page(name))
    assert {label for label, _ in table} == {"parameters", "gradients", "AdamW state", "total"}
    problems = []
    for (label, column), value in table.items():
        n = int(re.search(r"N=(\d+)", column).group(1))
        ranks = held_bytes(name, n)
        rank = re.search(r"rank (\d+)", column)
        expected = {ranks[int(rank.group(1))][label]} if rank else {r[label] for r in ranks}
        if expected != {value}:
            problems.append(f"{label}, {column}: the page says {value:,}, the code gives "
                            f"{', '.join(f'{e:,}' for e in sorted(expected))}")
    assert not problems, "\n".join(problems)


def test_readme_gpt2_row_is_the_fullest_rank():
    lines = text(ROOT / "README.md").splitlines()
    row = next(ln for ln in lines if ln.startswith("| the example's gpt2 at N=8"))
    header = next(ln for ln in reversed(lines[:lines.index(row)]) if ln.startswith("| per rank"))
    columns = [c.strip() for c in header.strip("|").split("|")][1:]  # the strategies, in the table's order
    quoted = [float(x) for x in re.findall(r"(\d+\.\d+) GB", row)]
    computed = [round(max(r["total"] for r in held_bytes(s, 8)) / 1e9, 2) for s in columns]
    assert quoted == computed


def test_readme_is_one_screen_of_tour_with_its_two_commands_first():
    """The README stays a tour (under 1,500 words) and opens with the two
    commands for a fresh machine: the example, then the tests."""
    readme = text(ROOT / "README.md")
    assert len(readme.split()) < 1500, f"README.md has {len(readme.split())} words"
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)[:2]
    assert commands[0].startswith("pip install") and "example/zero3/train.py" in commands[0]
    assert commands[1].startswith("pip install") and commands[1].endswith("python -m pytest -q")
