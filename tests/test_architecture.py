"""The package's shape (ARCHITECTURE.md), read from the source with ``ast``.

- no module imports a private (underscore) name from a public jmp_lite module;
- public modules outside ``jmp_lite/_src`` only re-export: imports, ``__all__``, ``_export(...)``;
- the module-level import graph of ``jmp_lite._src`` has no cycle.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jmp_lite"
# Programs, not library API: the console script and ``python -m jmp_lite``.
ENTRY_POINTS = {"jmp_lite.cli", "jmp_lite.__main__"}
# Beyond imports, __all__ and _export: the version string, and the deprecated Linen names at the old path.
EXTRA_NAMES = {
    "jmp_lite": {"__version__", "__getattr__"},  # the tools, loaded on first use
    "jmp_lite.amp": {"__getattr__", "_EXPLAIN"},
    "jmp_lite.autocast": {"__getattr__"},  # the deprecated module path, with a warning
    "jmp_lite.fp8": {"__getattr__", "_REPORT"},
    "jmp_lite.flax": {"__getattr__"},  # deprecated paths, with a warning
    "jmp_lite.flax.nnx": {"__getattr__"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_private(module: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in module.split("."))


PUBLIC = sorted(m for m in MODULES if not is_private(m) and m not in ENTRY_POINTS)


def absolute(module: str, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` reads from, relative imports resolved."""
    if not node.level:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")[: len(module.split(".")) - node.level + is_package]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str, tree: ast.AST) -> list[tuple[str, str, str]]:
    """(source module, imported name or "", bound alias) for every import in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, "", a.asname or a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = absolute(module, node)
            found += [(source, a.name, a.asname or a.name) for a in node.names]
    return found


def private_names_from_public_modules(module: str, source: str) -> list[str]:
    tree = ast.parse(source)
    bad, aliases = [], {}
    for src, name, alias in imports(module, tree):
        if not src.startswith("jmp_lite"):
            continue
        target = f"{src}.{name}" if name and f"{src}.{name}" in MODULES else src
        if name and target == src and not is_private(src) and is_private(name):
            bad.append(f"{module} imports {name} from {src}")
        if not is_private(target) and target in MODULES:
            aliases[alias] = target  # a public module bound to a name: check attribute reads below
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and is_private(node.attr)
        ):
            bad.append(f"{module} reads {aliases[node.value.id]}.{node.attr}")
    return bad


def test_no_module_imports_a_private_name_from_a_public_module():
    bad = [b for m, p in MODULES.items() for b in private_names_from_public_modules(m, p.read_text())]
    assert not bad, "private names of public modules are API by accident; move them into jmp_lite._src:\n" + (
        "\n".join(bad)
    )


def test_the_private_import_check_sees_both_spellings():
    code = "from jmp_lite.policy import _parse\nimport jmp_lite.loss_scale as ls\nls._apply(1)\n"
    found = private_names_from_public_modules("jmp_lite._src.engine.engine", code)
    assert found == [
        "jmp_lite._src.engine.engine imports _parse from jmp_lite.policy",
        "jmp_lite._src.engine.engine reads jmp_lite.loss_scale._apply",
    ]
    assert not private_names_from_public_modules(
        "jmp_lite.policy", "from jmp_lite._src.base.policy import _x\n"
    )


def is_export_call(node: ast.stmt) -> bool:
    call = node.value if isinstance(node, ast.Expr) else None
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "_export"


def bound_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return {t.id for t in targets if isinstance(t, ast.Name)}


def reexport_violations(module: str, source: str) -> list[str]:
    bad = []
    for i, node in enumerate(ast.parse(source).body):
        if isinstance(node, (ast.Import, ast.ImportFrom)) or is_export_call(node):
            continue
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        names = bound_names(node)
        if names and names <= {"__all__"} | EXTRA_NAMES.get(module, set()):
            continue
        bad.append(f"{module}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return bad


@pytest.mark.parametrize("module", PUBLIC)
def test_public_modules_only_reexport(module):
    source = MODULES[module].read_text()
    bad = reexport_violations(module, source)
    assert not bad, "implementation belongs in jmp_lite/_src; public modules only re-export:\n" + "\n".join(
        bad
    )
    # a leaf module: its names carry its public path (a deprecated path exports nothing of its own)
    if MODULES[module].name != "__init__.py" and importlib.import_module(module).__all__:
        assert any(is_export_call(n) for n in ast.parse(source).body), f"{module} never calls _export"
        mod = importlib.import_module(module)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if isinstance(obj, type) or callable(obj) and hasattr(obj, "__code__"):
                assert obj.__module__ == module, f"{module}.{name}.__module__ is {obj.__module__}"


def test_the_reexport_check_refuses_code():
    code = '"""doc"""\nimport x\n__all__ = ["f"]\n_export(__name__, globals(), __all__)\ndef f():\n    pass\n'
    assert reexport_violations("jmp_lite.policy", code) == ["jmp_lite.policy:5: def f():"]
    assert reexport_violations("jmp_lite.policy", "_CACHE = {}\n") == ["jmp_lite.policy:1: _CACHE = {}"]


def module_level_imports(module: str, tree: ast.Module) -> set[str]:
    """The jmp_lite._src modules ``module`` imports when it is imported (function bodies excluded)."""
    found = set()
    nodes = list(tree.body)
    while nodes:  # statements at module level, including those under if/try/with
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for src, name, _ in imports(module, ast.Module(body=[node], type_ignores=[])):
                full = f"{src}.{name}" if name else src
                found.add(full if full in MODULES else src)
        else:
            nodes += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
    return {m for m in found if m.startswith("jmp_lite._src") and m != module}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of modules (first == last), or [] if the graph is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return []


def test_private_core_import_graph_is_acyclic():
    graph = {m: module_level_imports(m, ast.parse(p.read_text())) for m, p in MODULES.items()}
    graph = {m: deps for m, deps in graph.items() if m.startswith("jmp_lite._src")}
    assert (
        "jmp_lite._src.engine.engine" in graph and graph["jmp_lite._src.engine.engine"]
    )  # the parse found edges
    cycle = find_cycle(graph)
    assert not cycle, "import cycle in jmp_lite._src: " + " -> ".join(cycle)


def test_the_cycle_check_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    tree = ast.parse("import jmp_lite._src.base.policy\ndef f():\n    from jmp_lite._src import engine\n")
    assert module_level_imports("jmp_lite._src.base.dtypes", tree) == {"jmp_lite._src.base.policy"}


def all_imports(module: str, tree: ast.AST) -> set[str]:
    """Every jmp_lite module ``module`` imports, at module level or inside functions."""
    found = set()
    for src, name, _ in imports(module, tree):
        full = f"{src}.{name}" if name else src
        found.add(full if full in MODULES else src)
    return {m for m in found if m.startswith("jmp_lite") and m != module}


def test_the_private_core_never_imports_upwards_not_even_inside_functions():
    # public modules re-export _src: a _src module importing one (even lazily, in a function body)
    # is an arrow running back up the layers
    upward = {
        m: sorted(
            d
            for d in all_imports(m, ast.parse(p.read_text()))
            if not d.startswith(("jmp_lite._src", "jmp_lite._demo"))
        )
        for m, p in MODULES.items()
        if m.startswith("jmp_lite._src")
    }
    upward = {m: d for m, d in upward.items() if d}
    assert not upward, f"jmp_lite._src modules importing public modules: {upward}"


def test_the_demo_uses_the_public_modules_not_the_package_root():
    # the package root imports everything public; the demo (and the command line above it) stand on the
    # public modules, so the root is one floor, not one more under the demo
    rooted = {
        m: sorted(d for d in all_imports(m, ast.parse(p.read_text())) if d == "jmp_lite")
        for m, p in MODULES.items()
        if m.startswith("jmp_lite._demo")
    }
    assert not {m: d for m, d in rooted.items() if d}, rooted


def test_the_private_core_has_no_cycle_counting_function_level_imports():
    graph = {
        m: {d for d in all_imports(m, ast.parse(p.read_text())) if d.startswith("jmp_lite._src")}
        for m, p in MODULES.items()
        if m.startswith("jmp_lite._src")
    }
    cycle = find_cycle(graph)
    assert not cycle, "import cycle in jmp_lite._src (function-level imports included): " + " -> ".join(cycle)


TOOLS = sorted(m.rsplit(".", 1)[1] for m in MODULES if m.startswith("jmp_lite._src.tools."))


def test_the_core_never_imports_a_tool_not_even_inside_functions():
    # the core is what a training step runs; the tools (reports, doctor, memory accounting) sit above it
    down = {
        m: sorted(d for d in all_imports(m, ast.parse(p.read_text())) if d.startswith("jmp_lite._src.tools"))
        for m, p in MODULES.items()
        if m.startswith("jmp_lite._src") and not m.startswith("jmp_lite._src.tools")
    }
    down = {m: d for m, d in down.items() if d}
    assert {"diagnostics", "precision_report", "doctor", "memory", "explain"} <= set(TOOLS)
    assert not down, f"core modules importing tools: {down}"


def test_tools_see_front_end_models_only_through_their_protocol():
    # precision_report, explain, ... re-run a Flax model under other engine options through the
    # model's __jmp_lite_model__() (engine.ModelUnderPolicy): no front-end import, no private attribute
    for tool in TOOLS:
        module = f"jmp_lite._src.tools.{tool}"
        tree = ast.parse(MODULES[module].read_text())
        front_ends = sorted(d for d in all_imports(module, tree) if d.startswith("jmp_lite._src.flax"))
        assert not front_ends, f"{module} imports the front-ends {front_ends}"
        privates = sorted(
            {
                node.attr
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "jax", "np"))
            }
        )
        assert not privates, f"{module} reads private attributes of other objects: {privates}"


# engine.Context's fields and the modules that set each (engine.entering(field=...)), as its docstring says
CONTEXT_WRITERS = {
    "tracing": {"jmp_lite._src.engine.engine", "jmp_lite._src.tools.precision_report"},
    "fp8_weights": {"jmp_lite._src.frontends.fp8_weights"},
    "observation": {"jmp_lite._src.tools.precision_report"},
    "modules": {"jmp_lite._src.flax.module_rules"},
    "module_stack": {"jmp_lite._src.flax.module_rules"},
    "frontend": {"jmp_lite._src.flax.linen", "jmp_lite._src.flax.nnx_policy"},
    "platform": {"jmp_lite._src.tools.compiled"},
}


def context_writes(module: str, tree: ast.AST) -> list[tuple[str, str]]:
    """(module, field) for every ``entering(field=...)`` call in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "entering":
                found += [(module, k.arg or "**") for k in node.keywords]
    return found


def test_the_engine_owns_the_one_context_variable():
    # front-ends talk to the engine through arguments, return values and engine.Context: no side channel
    owners = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("ContextVar"):
                owners.append(module)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and "contextvars" in ast.unparse(node):
                assert module == "jmp_lite._src.engine.scopes", f"{module} imports contextvars"
    assert owners == ["jmp_lite._src.engine.scopes"]
    from jmp_lite._src.engine import engine

    assert set(engine.Context._fields) == set(CONTEXT_WRITERS)
    for field in CONTEXT_WRITERS:
        assert f"``{field}``" in engine.Context.__doc__, f"engine.Context's docstring omits {field}"


def test_each_context_field_has_its_documented_writers():
    writes: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        for mod, field in context_writes(module, ast.parse(path.read_text())):
            writes.setdefault(field, set()).add(mod)
    assert writes == CONTEXT_WRITERS


def test_the_context_writer_check_sees_a_write():
    tree = ast.parse("from jmp_lite._src import engine\nwith engine.entering(tracing=True): pass\n")
    assert context_writes("m", tree) == [("m", "tracing")]


METADATA = {"__name__", "__qualname__", "__module__", "__doc__"}  # naming an object is no patch


def class_patches(module: str, tree: ast.AST) -> list[str]:
    """``module.function`` for every ``setattr`` and assignment to a dunder method (``cls.__call__ = f``),
    named by the innermost function holding it (``<module>`` outside any)."""
    found = []

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = node.name
        targets = node.targets if isinstance(node, ast.Assign) else []
        attrs = [t.attr for t in targets if isinstance(t, ast.Attribute)]
        dunder = any(a.startswith("__") and a.endswith("__") and a not in METADATA for a in attrs)
        if dunder or (isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr"):
            found.append(f"{module}.{where}")
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(tree, "<module>")
    return found


def test_classes_are_patched_in_one_documented_place_only():
    # NNX modules have no method interceptor: their __call__ is wrapped while a view traces, there only
    found = set()
    for module, path in MODULES.items():
        found |= set(class_patches(module, ast.parse(path.read_text())))
    assert found == {"jmp_lite._src.flax.nnx_policy._module_calls"}
    assert "_module_calls" in (ROOT / "ARCHITECTURE.md").read_text()


def test_the_patch_check_sees_a_patch():
    tree = ast.parse("def f(cls):\n    cls.__call__ = None\n")
    assert "m.f" in class_patches("m", tree)


def documented_modules(section: str) -> set[str]:
    """The module files the table under ARCHITECTURE.md's heading ``section`` lists (first column)."""
    text = (ROOT / "ARCHITECTURE.md").read_text().split(section, 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([\w/]+\.py)`", row)}


def test_architecture_md_lists_every_core_and_tool_module_in_its_own_table():
    src = PACKAGE / "_src"
    files = {p.relative_to(src).as_posix() for p in src.rglob("*.py") if p.name != "__init__.py"}
    core = {f for f in files if not f.startswith("tools/")}
    tools = {f.removeprefix("tools/") for f in files - core}
    assert documented_modules("## The core: `jmp_lite/_src`") == core
    assert documented_modules("## The tools: `jmp_lite/_src/tools`") == tools


@pytest.mark.e2e
def test_importing_jmp_lite_loads_the_core_only():
    code = (
        "import sys, jmp_lite\n"
        "print(sorted(m for m in sys.modules if m.startswith('jmp_lite._src.tools.')))\n"
        "jmp_lite.precision_report, jmp_lite.fp8.fp8_report\n"
        "print(sorted(m for m in sys.modules if m.startswith('jmp_lite._src.tools.')))\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    before, after = out.stdout.splitlines()
    assert before == "[]"
    assert "'jmp_lite._src.tools.precision_report'" in after and "'jmp_lite._src.tools.fp8_report'" in after


# --- one interpreter: every rewrite of a program is a hook of interpret.evaluate ---------------------

EVALUATOR = "jmp_lite._src.interpret.evaluate"


def _walks_eqns(node: ast.AST) -> bool:
    """A ``for`` over ``<x>.eqns`` (or ``enumerate(<x>.eqns)``)."""
    target = node.iter if isinstance(node, ast.For) else None
    if isinstance(target, ast.Call) and getattr(target.func, "id", None) == "enumerate" and target.args:
        target = target.args[0]
    return isinstance(target, ast.Attribute) and target.attr == "eqns"


def _binds(node: ast.AST) -> bool:
    """A call of something named ``bind`` (``primitive.bind``, ``interpret.bind``, ``_bind``), or results
    paired with an equation's outputs (``zip(eqn.outvars, outs)``: an evaluation that binds elsewhere)."""
    for n in ast.walk(node):
        if not isinstance(n, ast.Call):
            continue
        name = getattr(n.func, "attr", None) or getattr(n.func, "id", None) or ""
        if name.lstrip("_") == "bind":
            return True
        pairs = [getattr(a, "attr", None) for a in n.args]
        if name == "zip" and pairs[:1] == ["outvars"] and "outvars" not in pairs[1:]:
            return True  # (zip(eqn.outvars, body.outvars) relates variables, as an analysis does)
    return False


def evaluators(sources: dict[str, str]) -> list[str]:
    """Every function that walks a program's equations and binds primitives as it goes: an evaluator."""
    found = []
    for module, text in sources.items():
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            loops = [n for n in ast.walk(fn) if _walks_eqns(n)]
            if any(_binds(ast.Module(body=loop.body, type_ignores=[])) for loop in loops):
                found.append(f"{module}.{fn.name}")
    return sorted(found)


def test_the_package_has_one_evaluator_of_programs():
    sources = {m: p.read_text() for m, p in MODULES.items()}
    assert evaluators(sources) == [EVALUATOR], (
        "a second function walks jaxpr.eqns and binds: write the rewrite as a hook of interpret.evaluate"
    )


def test_the_evaluator_check_sees_a_second_evaluator():
    own = """
def eval_it(jaxpr, env):
    for eqn in jaxpr.eqns:
        env[eqn.outvars[0]] = eqn.primitive.bind(*[env[v] for v in eqn.invars])

def delegating(jaxpr, env):
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, rule(eqn, [env[v] for v in eqn.invars])))

def analyse(jaxpr):
    for i, eqn in enumerate(jaxpr.eqns):
        print(eqn.primitive.name)  # reads, binds nothing: an analysis, allowed
"""
    assert evaluators({"m": own}) == ["m.delegating", "m.eval_it"]


# --- one primitive table: no module keeps a list of primitive names of its own -----------------------

# the table itself, and the attention matcher (a pattern over named ops)
NAME_LISTS_ALLOWED = {"jmp_lite._src.primitive_rules", "jmp_lite._src.engine.attention_pattern"}


def primitive_name_lists(sources: dict[str, str], names: frozenset) -> list[str]:
    """String collections (tuple, list, set, dict keys) naming two or more primitives, outside ``__all__``."""
    found = []
    for module, text in sources.items():
        tree = ast.parse(text)
        exports = {
            id(n.value)
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets)
        }
        for node in ast.walk(tree):
            if id(node) in exports:
                continue
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                elements = node.elts
            elif isinstance(node, ast.Dict):
                elements = [k for k in node.keys if k is not None]
            else:
                continue
            named = [e.value for e in elements if isinstance(e, ast.Constant) and e.value in names]
            if len(named) >= 2:
                found.append(f"{module}:{node.lineno} {named}")
    return found


def test_primitive_names_are_listed_only_in_the_table_and_the_attention_matcher():
    from jmp_lite._src import primitive_rules

    sources = {m: p.read_text() for m, p in MODULES.items() if m not in NAME_LISTS_ALLOWED}
    assert primitive_name_lists(sources, frozenset(primitive_rules.TABLE)) == [], (
        "a module keeps its own list of primitive names: give primitive_rules a property instead"
    )


def test_the_name_list_check_sees_a_list():
    own = '__all__ = ["scan", "jit"]\n_REMAT = ("remat2", "checkpoint")\n_X = {"scan": 1, "while": 2}\n'
    found = primitive_name_lists({"m": own}, frozenset({"scan", "jit", "remat2", "while"}))
    assert found == ["m:3 ['scan', 'while']"]


# --- the subsystems of the core, in layers (ARCHITECTURE.md, "The core") ---------------------------------

# from the top down; a module outside every folder (the interpreter, the primitive table) sits between
# kernels/ and base/
SUBSYSTEMS = ["tools", "flax", "frontends", "optim", "parallel", "engine", "fp8", "kernels", "", "base"]


def subsystem(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 else ""


def upward_subsystem_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {name: i for i, name in enumerate(SUBSYSTEMS)}
    return sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if d.startswith("jmp_lite._src.") and rank[subsystem(d)] < rank[subsystem(m)]
    )


def test_the_core_subsystems_import_downwards_only_not_even_inside_functions():
    graph = {
        m: all_imports(m, ast.parse(p.read_text()))
        for m, p in MODULES.items()
        if m.startswith("jmp_lite._src.")
    }
    assert {subsystem(m) for m in graph} == set(SUBSYSTEMS), "a folder of _src is missing from SUBSYSTEMS"
    assert upward_subsystem_imports(graph) == []


def test_the_subsystem_check_sees_an_upward_import():
    graph = {
        "jmp_lite._src.kernels.accumulate": {"jmp_lite._src.engine.decisions", "jmp_lite._src.base.policy"}
    }
    assert upward_subsystem_imports(graph) == [
        "jmp_lite._src.kernels.accumulate -> jmp_lite._src.engine.decisions"
    ]


# --- each front-end checks its policy and its fp8 recipe once, at the door (frontends/options.py) -------

POLICY, RECIPE = "p=f32,c=bf16,o=f32", "hybrid,current"


def _front_ends():
    import flax.linen as nn
    from flax import nnx

    import jmp_lite
    import jmp_lite.flax

    def f(w, x):
        return x @ w

    return {
        "autocast": lambda: jmp_lite.autocast(f, POLICY, fp8=RECIPE),
        "autocast decorator": lambda: jmp_lite.autocast(POLICY, fp8=RECIPE)(f),
        "linen": lambda: jmp_lite.flax.linen.apply_policy(nn.Dense(4), POLICY, fp8=RECIPE),
        "nnx": lambda: jmp_lite.flax.nnx.apply_policy(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), POLICY, fp8=RECIPE),
    }


@pytest.mark.parametrize("front_end", ["autocast", "autocast decorator", "linen", "nnx"])
def test_each_front_end_checks_its_policy_and_fp8_recipe_once(front_end, monkeypatch):
    from jmp_lite._src.base import validate
    from jmp_lite._src.frontends import fp8_weights

    seen = []
    real_policy, real_recipe = validate.policy, fp8_weights.as_fp8_recipe

    def policy(value, what, **kw):
        seen.append(("policy", value))
        return real_policy(value, what, **kw)

    def recipe(value, what="fp8"):
        seen.append(("fp8", value))
        return real_recipe(value, what)

    monkeypatch.setattr(validate, "policy", policy)
    monkeypatch.setattr(fp8_weights, "as_fp8_recipe", recipe)
    _front_ends()[front_end]()
    assert [s for s in seen if s[0] == "policy"] == [("policy", POLICY)], seen
    assert [s for s in seen if s[0] == "fp8"] == [("fp8", RECIPE)], seen
