"""The shape of the code: rules that keep the step composed (see docs/design.md, "Modules").

Beside ``test_stages.py``'s import check: class and function sizes, test files' sizes, the facade's size and attributes,
messages built by keyword in the stage that owns them, knobs read in one place, no import cycle even
for type checkers, no timings in comments, and every function a step runs reviewed for Ctrl-C.
"""
from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest
import torch

import dpool
from dpool import knobs, step

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "dpool").rglob("*.py"), *(ROOT / "workers").glob("*.py")])

MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80
# Classes over MAX_CLASS_LINES that may keep their size but not grow (they are coherent: processes and
# rounds; the master's binding).
RATCHET = {"dpool/pool.py:Pool": 558, "dpool/replicate.py:Master": 412}
FACADE_METHOD_LINES = 25
FACADE_ATTRIBUTES = 15
MAX_TEST_FILE_LINES = 1000  # a test file is one subject; past this it is several

pytestmark = pytest.mark.timeout(120)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _trees() -> dict[str, ast.Module]:
    return {_rel(p): ast.parse(p.read_text(), str(p)) for p in SOURCES}


def _lines(node: ast.AST) -> int:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])  # type: ignore[attr-defined]
    return node.end_lineno - first + 1  # type: ignore[attr-defined]


def test_no_class_or_function_is_too_large():
    big = []
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                limit = RATCHET.get(f"{path}:{node.name}", MAX_CLASS_LINES)
                if _lines(node) > limit:
                    big.append(f"class {path}:{node.name} has {_lines(node)} lines (at most {limit})")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _lines(node) > MAX_FUNCTION_LINES:
                big.append(f"function {path}:{node.name} has {_lines(node)} lines (at most {MAX_FUNCTION_LINES})")
    assert not big, "\n".join(big)


def test_no_test_file_is_over_its_bound():
    """Tests are filed by subject (what they test), not by the history of the bugs that made them."""
    sizes = {_rel(p): len(p.read_text().splitlines()) for p in (ROOT / "tests").glob("*.py")}
    too_long = {name: n for name, n in sizes.items() if n > MAX_TEST_FILE_LINES}
    assert not too_long, f"test files over {MAX_TEST_FILE_LINES} lines (split them by subject): {too_long}"


def test_the_ratchet_is_tight():
    """A ratcheted class that shrank lowers its bound: the list must say what holds now."""
    sizes = {f"{p}:{n.name}": _lines(n) for p, t in _trees().items() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    assert {k: sizes[k] for k in RATCHET} == RATCHET


def _runtime_class() -> ast.ClassDef:
    tree = _trees()["dpool/step/runtime.py"]
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Runtime")


def test_the_runtime_only_composes():
    cls = _runtime_class()
    long = [f"{n.name}: {_lines(n)} lines" for n in cls.body
            if isinstance(n, ast.FunctionDef) and not n.name.startswith("_") and _lines(n) > FACADE_METHOD_LINES]
    assert not long, f"public methods of the facade over {FACADE_METHOD_LINES} lines (delegate instead): {long}"
    attrs = {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign))
             for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
             for t in (t.elts if isinstance(t, ast.Tuple) else [t])
             if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert len(attrs) <= FACADE_ATTRIBUTES, sorted(attrs)
    tree = _trees()["dpool/step/runtime.py"]
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "protocol" not in imported, "the facade builds no message: the stage that owns it does"


# Each message type is built by one stage module of dpool/step (the worker side builds replies).
OWNERS = {"Forward": {"dpool/step/forward.py"}, "Criterion": {"dpool/step/loss_round.py"},
          "ForwardCriterion": {"dpool/step/deferred.py"}, "Backward": {"dpool/step/backward.py"}}


def _message_calls(tree: ast.Module):
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "P"
                and node.func.attr[:1].isupper()):
            yield node


def test_each_message_is_built_by_its_stage_with_keywords():
    wrong = []
    for path, tree in _trees().items():
        for call in _message_calls(tree):
            owners = OWNERS.get(call.func.attr)  # type: ignore[attr-defined]
            if owners is not None and path.startswith("dpool/") and path not in owners:
                wrong.append(f"{path}:{call.lineno}: P.{call.func.attr} is built in {sorted(owners)}")  # type: ignore[attr-defined]
            if path.startswith("dpool/step/") and call.args:
                wrong.append(f"{path}:{call.lineno}: P.{call.func.attr}(...) with positional arguments")  # type: ignore[attr-defined]
    assert not wrong, "\n".join(wrong)


_KNOB = re.compile(r"\bDPOOL_[A-Z][A-Z_]*\b")


def test_knobs_are_read_in_one_place_and_every_name_is_declared():
    reads, unknown = [], []
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                unknown += [f"{path}:{node.lineno}: {m}" for m in _KNOB.findall(node.value) if m not in knobs.KNOBS]
            if path == "dpool/knobs.py":
                continue
            # os.environ.get("DPOOL_..."), os.environ["DPOOL_..."], os.getenv("DPOOL_...")
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                func = ast.unparse(node.func)
                if func in ("os.environ.get", "os.getenv", "environ.get") and _KNOB.match(str(node.args[0].value)):
                    reads.append(f"{path}:{node.lineno}: {func}({node.args[0].value!r})")
            if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                    and ast.unparse(node.value) in ("os.environ", "environ")
                    and isinstance(node.slice, ast.Constant) and _KNOB.match(str(node.slice.value))):
                reads.append(f"{path}:{node.lineno}: os.environ[{node.slice.value!r}]")
    assert not reads, "read DPOOL_* variables through dpool.knobs.get:\n" + "\n".join(reads)
    assert not unknown, "undeclared knobs (declare them in dpool/knobs.py):\n" + "\n".join(unknown)


def test_the_docs_table_of_knobs_is_current():
    assert (ROOT / "docs" / "knobs.md").read_text() == knobs.markdown(), \
        "docs/knobs.md is stale: regenerate it with the command at its top"


def test_a_bad_knob_value_names_the_variable_and_its_choices(monkeypatch):
    monkeypatch.setenv("DPOOL_GLOO_LOOP", "spin")
    with pytest.raises(dpool.DpoolValueError, match=r"DPOOL_GLOO_LOOP='spin' is not a policy; use one of batch, none"):
        knobs.get("DPOOL_GLOO_LOOP")
    monkeypatch.setenv("DPOOL_STEP_TIMEOUT", "soon")
    with pytest.raises(dpool.DpoolValueError, match=r"DPOOL_STEP_TIMEOUT='soon' is not a number of seconds"):
        dpool.Config()
    monkeypatch.setenv("DPOOL_STEP_TIMEOUT", "30s")
    assert dpool.Config().step_timeout_s == 30.0
    monkeypatch.setenv("DPOOL_CROSS_NODE_OVERLAP", "maybe")
    with pytest.raises(dpool.DpoolValueError, match="DPOOL_CROSS_NODE_OVERLAP='maybe'"):
        dpool.Config()
    monkeypatch.setenv("DPOOL_CROSS_NODE_OVERLAP", "0")
    assert dpool.Config().cross_node_overlap is False
    with pytest.raises(KeyError, match="DPOOL_NOPE is not a declared dpool knob"):
        knobs.get("DPOOL_NOPE")


def _imports(typing_too: bool) -> dict[str, set[str]]:
    """Module → the dpool modules it imports (``TYPE_CHECKING`` blocks included when ``typing_too``)."""
    graph: dict[str, set[str]] = {}
    for p in (ROOT / "dpool").rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        package = name if p.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(p.read_text())
        if not typing_too:
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    node.body = []
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{up}.{node.module}" if node.module else up
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    deps.add(sub if (ROOT / (sub.replace(".", "/") + ".py")).exists()
                             or (ROOT / sub.replace(".", "/")).is_dir() else base)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d.startswith("dpool.") and d != name}
    return graph


def test_no_import_cycle_even_for_type_checkers():
    graph = _imports(typing_too=True)
    edges = {m: {d for d in deps if d in graph and not m.startswith(d + ".")} for m, deps in graph.items()
             if m != "dpool"}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " → ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    users = sorted(m for m, deps in graph.items()
                   if any(d == "dpool.step" or d.startswith("dpool.step.") for d in deps)
                   and not m.startswith("dpool.step"))
    assert users == ["dpool.wrapper"], users


_TIMING = re.compile(r"\d+(\.\d+)? ?(ms|µs|us)\b")


def test_no_timings_in_comments_or_docstrings():
    """Numbers go stale silently: they belong in benchmarks/results/ and docs/performance.md."""
    found = []
    for p in SOURCES:
        src = p.read_text()
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT and _TIMING.search(tok.string):
                found.append(f"{_rel(p)}:{tok.start[0]}: {tok.string.strip()}")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and _TIMING.search(doc):
                    found.append(f"{_rel(p)}: the docstring of {getattr(node, 'name', 'the module')}")
    assert not found, "\n".join(found)


def _codes(fn: object) -> set:
    """The code objects of ``fn``: a property's getter, a decorated method's wrapper and what it wraps."""
    fn = fn.fget if isinstance(fn, property) else fn  # type: ignore[assignment]
    return {f.__code__ for f in (fn, getattr(fn, "__wrapped__", fn))}  # type: ignore[attr-defined]


def test_every_function_a_step_runs_is_a_reviewed_cut_point(wrap):
    """Ctrl-C safety depends on statement order: a function of dpool.step that a forward, a loss on the
    workers or a backward runs must be on ``dpool.step.CUT_POINTS`` (and so reviewed, and cut at every
    offset where it holds a ``try``: tests/test_lifecycle.py)."""
    listed = {c for f in step.CUT_POINTS for c in _codes(f)}
    prefix = str(ROOT / "dpool" / "step")
    ran: set[object] = set()

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(prefix):
            ran.add(frame.f_code)
        return None

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model, lossy = wrap(net, ["cpu", "cpu"]), wrap(torch.nn.Linear(4, 3), ["cpu", "cpu"], gather=False)
    crit = dpool.criterion(torch.nn.CrossEntropyLoss())
    x, t = torch.randn(6, 4), torch.randint(0, 3, (6,))
    sys.settrace(tracer)
    try:
        for _ in range(2):  # (the second step is the steady one)
            model(x).sum().backward()
            crit(lossy(x), t).backward()
    finally:
        sys.settrace(None)
    ran = {c for c in ran if c.co_name not in ("<lambda>", "<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>")}
    missing = sorted(f"{c.co_filename.rpartition('/')[2]}:{c.co_name}" for c in ran - listed)  # type: ignore[attr-defined]
    assert not missing, f"functions a step runs that dpool.step.CUT_POINTS does not list: {missing}"
    assert len(ran) > 30, len(ran)  # (the trace saw the step)


def test_the_ctrl_c_tests_cut_only_listed_functions():
    """The every-offset Ctrl-C tests name their targets by object: each of dpool.step must be a listed cut point."""
    listed = {c for f in step.CUT_POINTS for c in _codes(f)}
    src = (ROOT / "tests" / "test_lifecycle.py").read_text()
    names = sorted(set(re.findall(r"\b(fwd|rounds|replicas|deferred|loss_round)\.([A-Z]\w+)\.(\w+)", src)))
    modules = {"fwd": "forward"}
    targets = [getattr(getattr(getattr(step, modules.get(m, m)), cls), fn) for m, cls, fn in names]
    assert len(targets) >= 8, names
    assert all(_codes(t) & listed for t in targets), [n for n, t in zip(names, targets) if not _codes(t) & listed]
