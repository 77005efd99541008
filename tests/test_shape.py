"""The shape of the code: rules that keep the step composed (see docs/design.md, "Modules").

Beside ``test_building_blocks.py``'s import check: class and function sizes, test files' sizes, the facade's size and attributes,
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
RATCHET = {"dpool/pool.py:Pool": 557, "dpool/replicate.py:Master": 412}
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
    offset where it holds a ``try``: tests/test_ctrl_c.py)."""
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
    src = (ROOT / "tests" / "test_ctrl_c.py").read_text()
    names = sorted(set(re.findall(r"\b(fwd|rounds|replicas|deferred|loss_round)\.([A-Z]\w+)\.(\w+)", src)))
    modules = {"fwd": "forward"}
    targets = [getattr(getattr(getattr(step, modules.get(m, m)), cls), fn) for m, cls, fn in names]
    assert len(targets) >= 8, names
    assert all(_codes(t) & listed for t in targets), [n for n, t in zip(names, targets) if not _codes(t) & listed]


# ---------------------------------------------------------------------- the seams between the stages
MAX_STAGE_PARAMETERS = 6  # a stage takes the StepParts and the stages it calls
MAX_RUNTIME_FILE_LINES = 300
# Private names of torch, the standard library and other libraries that dpool must touch, each with why.
FOREIGN_PRIVATE = {
    "_C": "torch's C bindings: autograd's graph task, the functorch stack, CUDA and cuDNN queries",
    "_version": "a tensor's version counter: how in-place changes are seen (torch exposes no other)",
    "_BatchNorm": "torch.nn.modules.batchnorm._BatchNorm: every BatchNorm's base class",
    "_buffers": "nn.Module's registries, read and set without its __setattr__ (as torch's own copies do)",
    "_parameters": "nn.Module's registries (as _buffers)",
    "_modules": "nn.Module's registries (as _buffers)",
    "_non_persistent_buffers_set": "nn.Module's registries (as _buffers)",
    "_forward_pre_hooks": "nn.Module's hooks, followed into the replicas",
    "_backward_hooks": "a tensor's hooks: torch lists them nowhere else",
    "_post_accumulate_grad_hooks": "a tensor's hooks (as _backward_hooks)",
    "_global_forward_hooks": "torch.nn.modules.module's global hooks, which the workers cannot run",
    "_global_forward_pre_hooks": "as _global_forward_hooks",
    "_global_backward_hooks": "as _global_forward_hooks",
    "_global_backward_pre_hooks": "as _global_forward_hooks",
    "_execution_engine": "torch.autograd.Variable._execution_engine: the graph task a hook runs in",
    "_autograd": "torch._C._autograd: the graph task a hook runs in",
    "_current_level": "torch.autograd.forward_ad's dual level: is forward-mode AD on",
    "_cdata": "a tensor's identity across Python wrappers",
    "_values": "a sparse COO tensor's values without coalescing",
    "_foreach_add_": "torch's multi-tensor kernels",
    "_foreach_copy_": "torch's multi-tensor kernels",
    "_foreach_zero_": "torch's multi-tensor kernels",
    "_dynamo": "torch._dynamo.disable: the coordinator's call stays out of a compiled graph",
    "_get_cudnn_allow_tf32": "torch's TF32 setting, which has no public getter on older torch",
    "_is_fastpath_enabled": "nn.MultiheadAttention's fast path setting",
    "_inject_new_class": "torch.nn.utils.parametrize, followed into the replicas",
    "_inject_property": "torch.nn.utils.parametrize, followed into the replicas",
    "_lazy_init": "torch.cuda's initialisation before an IPC handle is opened",
    "_new_shared_cuda": "torch's CUDA IPC: a storage from a handle",
    "_share_cuda_": "torch's CUDA IPC: a storage's handle",
    "_release_ipc_counter_cuda": "torch's CUDA IPC: the producer's reference count",
    "_set_allocator_settings": "the CUDA caching allocator's settings, set as PYTORCH_CUDA_ALLOC_CONF would",
    "_cuda_getDriverVersion": "the CUDA driver version, for dpool-workers doctor",
    "_log_api_usage_once": "the usage log nn.DataParallel writes too",
    "_metadata": "a state_dict's metadata (its versions), kept as torch keeps it",
    "_get_default_store": "torch.distributed's store, for the nodes' heartbeats",
    "_world": "torch.distributed's groups",
    "_getframe": "sys._getframe: the user's stack level of a warning",
    "_exit": "os._exit: a process ends past the interpreter's teardown",
    "_inst": "random._inst: the random module's generator, seeded in the workers",
    "_reconstructor": "copyreg._reconstructor: a subclass pickles as its base",
    "_n_gpu": "transformers' TrainingArguments._n_gpu, which its n_gpu reads",
    "_can_record_outputs": "transformers' output recording, followed into the replicas",
    "_compiled_call_impl": "nn.Module's compiled call, which Lightning's strategy sets",
}
# dpool/step/__init__.py lists every function a step runs, private ones too: that list is the Ctrl-C review.
PRIVATE_EXEMPT = {"dpool/step/__init__.py"}


def _own_names(tree: ast.Module) -> set[str]:
    """The names a module defines: its functions, classes, assigned names and attributes, and arguments."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
        elif isinstance(node, ast.alias):
            own.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.arg):
            own.add(node.arg)
    return own


def test_no_module_reads_or_writes_another_modules_private_names():
    """A private name is its module's: another module asks through a public one (torch's and other libraries'
    internals that dpool must touch are listed, each with its reason)."""
    foreign = []
    for path, tree in _trees().items():
        if path in PRIVATE_EXEMPT:
            continue
        own = _own_names(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and node.attr not in own and node.attr not in FOREIGN_PRIVATE):
                foreign.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    assert not foreign, "private names of another module:\n" + "\n".join(foreign)
    unused = set(FOREIGN_PRIVATE) - {n.attr for t in _trees().values() for n in ast.walk(t)
                                     if isinstance(n, ast.Attribute)}
    assert not unused, f"FOREIGN_PRIVATE lists names no module uses any more: {sorted(unused)}"


def _step_trees() -> dict[str, ast.Module]:
    return {p: t for p, t in _trees().items() if p.startswith("dpool/step/")}


def test_no_stage_constructor_takes_more_than_the_parts_and_the_stages_it_calls():
    wide = [f"{path}:{cls.name}.__init__ takes {len(init.args.args) - 1 + len(init.args.kwonlyargs)}"
            for path, tree in _step_trees().items() for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
            for init in cls.body if isinstance(init, ast.FunctionDef) and init.name == "__init__"
            and len(init.args.args) - 1 + len(init.args.kwonlyargs) > MAX_STAGE_PARAMETERS]
    assert not wide, f"constructors in dpool/step over {MAX_STAGE_PARAMETERS} parameters (take a StepParts): {wide}"


def _step_state_fields() -> set[str]:
    tree = _trees()["dpool/step/state.py"]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StepState")
    return {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}


def test_the_step_state_changes_only_through_its_methods():
    """Each change of the step's state is a named transition of StepState (defer, take and drop the held
    forward; begin and end a restart; hold and release; forget what was sent): no module assigns its fields."""
    fields = _step_state_fields()
    assert {"pending", "restarting", "restarts_left", "workers_hold", "sent_flags"} <= fields, fields
    writes = []
    for path, tree in _trees().items():
        if path == "dpool/step/state.py":
            continue
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                for a in ast.walk(t):
                    if (isinstance(a, ast.Attribute) and a.attr in fields and isinstance(a.ctx, ast.Store)
                            and ast.unparse(a.value).rpartition(".")[2] == "state"):
                        writes.append(f"{path}:{node.lineno}: {ast.unparse(a)}")
    assert not writes, "StepState fields assigned outside dpool/step/state.py:\n" + "\n".join(writes)


def test_a_call_state_is_never_named_state():
    """``state`` is the step's state (StepState); one forward call's is ``call_state`` (CallState)."""
    misnamed = []
    for path, tree in _trees().items():
        if not (path.startswith("dpool/step/") or path in ("dpool/bridge.py", "dpool/loss.py")):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and node.arg == "state" and ast.unparse(node.annotation or node) != "StepState":
                misnamed.append(f"{path}:{node.lineno}: parameter state")
            if isinstance(node, ast.Attribute) and node.attr == "state" and path in ("dpool/bridge.py", "dpool/loss.py"):
                misnamed.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "state" for t in node.targets)
                    and ast.unparse(node.value) != "self.state" and not ast.unparse(node.value).startswith("StepState(")):
                misnamed.append(f"{path}:{node.lineno}: state = {ast.unparse(node.value)}")
    assert not misnamed, "\n".join(misnamed)


def test_no_stage_gets_a_bound_method_of_the_facade():
    """The stages call each other and CrossNode (its ``synced``), never back into the runtime."""
    cls = _runtime_class()
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    passed = [f"line {node.lineno}: {ast.unparse(arg)}" for node in ast.walk(cls) if isinstance(node, ast.Call)
              for arg in [*node.args, *(k.value for k in node.keywords)]
              if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "self"
              and arg.attr in methods and not (isinstance(node.func, ast.Attribute) and node.func.attr == "WeakMethod")
              and ast.unparse(node.func) != "arm_exit_guard"]
    assert not passed, f"the runtime passes its own methods down: {passed}"


def test_the_facade_file_stays_small():
    lines = len((ROOT / "dpool" / "step" / "runtime.py").read_text().splitlines())
    assert lines <= MAX_RUNTIME_FILE_LINES, f"dpool/step/runtime.py has {lines} lines (at most {MAX_RUNTIME_FILE_LINES})"


def test_one_round_ritual():
    """Every round ends the same way (:meth:`dpool.step.rounds.Rounds.settle`): the segment names go, then the
    first failure is raised. Only ``rounds.py`` does it (``pool.py`` owns the segments)."""
    elsewhere = [f"{path}:{node.lineno}: {ast.unparse(node.func)}" for path, tree in _trees().items()
                 if path not in ("dpool/step/rounds.py", "dpool/pool.py") for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                 and node.func.attr in ("unlink_segments", "raise_failures")]
    assert not elsewhere, "the round ritual outside dpool/step/rounds.py:\n" + "\n".join(elsewhere)


# Calls that may pass more than MAX_POSITIONAL arguments by position: the standard library's and torch's
FOREIGN_POSITIONAL = {
    "finalize": "weakref.finalize(obj, fn, *args): its arguments are fn's",
    "debug": "logging: %-style arguments", "info": "logging", "warning": "logging", "error": "logging",
    "_new_shared_cuda": "torch's CUDA IPC: a storage from a handle's eight fields",
}
MAX_POSITIONAL = 5


def test_no_call_passes_more_than_five_arguments_by_position():
    """Past five, arguments are named: two adjacent ones of one type swapped would pass every check."""
    long = [f"{path}:{node.lineno}: {ast.unparse(node.func)} with {len(node.args)}"
            for path, tree in _trees().items() for node in ast.walk(tree)
            if isinstance(node, ast.Call) and len(node.args) > MAX_POSITIONAL
            and (node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", ""))
            not in FOREIGN_POSITIONAL]
    assert not long, "calls with more than five positional arguments:\n" + "\n".join(long)


def test_every_message_is_built_by_keyword_on_both_sides():
    """A message's fields are named where it is built, by the coordinator and by the workers."""
    from dpool import protocol as P

    positional = [f"{path}:{call.lineno}: P.{call.func.attr}(...)" for path, tree in _trees().items()  # type: ignore[attr-defined]
                  for call in _message_calls(tree) if call.args
                  and isinstance(getattr(P, call.func.attr, None), type) and issubclass(getattr(P, call.func.attr), P.Message)]  # type: ignore[attr-defined]
    assert not positional, "messages built with positional arguments:\n" + "\n".join(positional)


def test_each_protocol_field_is_declared_once():
    """A message's fields are its annotations, which also say what a decoded body may hold there."""
    from dpool import protocol as P

    tree = _trees()["dpool/protocol.py"]
    twice = [f"line {d.lineno}: {ast.unparse(d)}" for node in tree.body if isinstance(node, ast.ClassDef)
             for d in node.decorator_list if isinstance(d, ast.Call) and d.keywords]
    assert not twice, f"message fields declared again in the decorator: {twice}"
    assert all(list(m._types) == [f.name for f in P.fields(m)] for m in P.MESSAGES.values())  # type: ignore[attr-defined]
