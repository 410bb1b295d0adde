"""Sphinx configuration: the Markdown guide (MyST) plus an API reference built from ``__all__``.

The API pages are generated on every build from each public module's ``__all__`` (see
``_write_api_pages``), so a name another change adds shows up without editing the docs, and a public
name without a docstring stops the build (``_check_docstrings``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path
from types import ModuleType

from sphinx.errors import ExtensionError
from sphinx.pycode import ModuleAnalyzer

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))

import jmp_lite  # noqa: E402

project = "jmp_lite"
author = "jmp_lite authors"
copyright = "2026, jmp_lite authors"
release = jmp_lite.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "img/*.md"]
templates_path = ["_templates"]

# MyST: ```python fences stay plain code (tests/test_docs.py executes them); `$...$` math as in the pages.
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
autosummary_generate = False
# Google-style "Attributes:" as a field list, so NamedTuple fields are not documented twice.
napoleon_use_ivar = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"jmp_lite {release}"
html_static_path: list[str] = []

# Public modules with an API page. A module not present yet (e.g. added by a later change) is skipped.
API_MODULES = [
    "jmp_lite",
    "jmp_lite.distributed",
    "jmp_lite.autocast",
    "jmp_lite.flax",
    "jmp_lite.flax.nnx",
]
API_DIR = DOCS / "api" / "generated"


def _import_optional(name: str) -> ModuleType | None:
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:  # the module itself does not exist; a missing dependency is still an error
            return None
        raise
    # An editable install of another checkout can supply a submodule this tree lacks: document this tree.
    if not Path(mod.__file__).resolve().is_relative_to(Path(jmp_lite.__file__).resolve().parent):
        return None
    return mod


def _public_names(mod: ModuleType) -> list[str]:
    """``__all__``, or (for a module without one) the public functions and classes it defines."""
    names = getattr(mod, "__all__", None)
    if names is not None:
        return list(names)
    return sorted(
        n
        for n, obj in vars(mod).items()
        if not n.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and obj.__module__ == mod.__name__
    )


def _attr_doc(module_name: str, name: str, seen: frozenset[str] = frozenset()) -> list[str] | None:
    """The ``#:`` comment or string literal documenting a module-level constant, following re-exports."""
    if module_name in seen:
        return None
    try:
        analyzer = ModuleAnalyzer.for_module(module_name)
    except Exception:
        return None
    docs = analyzer.find_attr_docs()
    if ("", name) in docs:
        return [line for line in docs[("", name)] if line.strip()] or None
    tree = ast.parse(analyzer.code)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and any(a.name == name for a in node.names):
            found = _attr_doc(node.module, name, seen | {module_name})
            if found:
                return found
    return None


def _kind(obj: object) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "class"
    if callable(obj) and getattr(obj, "__doc__", None) is not type(obj).__doc__:
        return "function"
    return "data"


def _check_docstrings(modules: dict[str, ModuleType]) -> None:
    missing = []
    for mod_name, mod in modules.items():
        if not (mod.__doc__ or "").strip():
            missing.append(mod_name)
        for name in _public_names(mod):
            if not hasattr(mod, name):
                missing.append(f"{mod_name}.{name} (listed in __all__ but not defined)")
                continue
            obj = getattr(mod, name)
            kind = _kind(obj)
            if kind == "data":
                ok = _attr_doc(mod_name, name) is not None
            elif kind == "class":
                ok = bool((obj.__dict__.get("__doc__") or "").strip())
            else:
                ok = bool((getattr(obj, "__doc__", None) or "").strip())
            if not ok:
                missing.append(f"{mod_name}.{name}")
    if missing:
        raise ExtensionError(
            "public names without a docstring (give each a docstring, or a `#:` comment or string "
            f"literal under a module-level constant): {', '.join(missing)}"
        )


def _summary(mod_name: str, name: str, obj: object) -> str:
    """The first sentence of the docstring (of the doc comment for a constant)."""
    if _kind(obj) == "data":
        doc = " ".join(_attr_doc(mod_name, name) or [])
    else:
        doc = (inspect.getdoc(obj) or "").split("\n\n")[0].replace("\n", " ")
    end = doc.find(". ")
    return doc if end < 0 else doc[: end + 1]


def _page(mod_name: str, mod: ModuleType) -> str:
    names = _public_names(mod)
    objs = {n: getattr(mod, n) for n in names}
    title = f"``{mod_name}``"
    lines = [title, "=" * len(title), "", f".. automodule:: {mod_name}", "   :no-members:", ""]
    # A summary table of our own: autosummary would describe a type alias by its type's docstring.
    lines += [f".. currentmodule:: {mod_name}", "", ".. list-table::", "   :widths: 30 70", ""]
    for n, obj in objs.items():
        lines += [f"   * - :py:obj:`{n}`", f"     - {_summary(mod_name, n, obj)}"]
    lines += [""]
    for n, obj in objs.items():
        kind = _kind(obj)
        if kind == "module":
            continue  # the table links to the submodule's own page
        if kind == "class":
            lines += [f".. autoclass:: {n}", ""]
        elif kind == "function":
            lines += [f".. autofunction:: {n}", ""]
        else:
            # Written out rather than autodata'd: autodoc looks for the doc comment only in this
            # module's source, and re-exported constants are documented where they are defined.
            lines += [f".. py:data:: {n}", f"   :value: {obj!r}", ""]
            lines += [f"   {line}" for line in _attr_doc(mod_name, n) or []] + [""]
    return "\n".join(lines)


def _write_api_pages(app: object, config: object) -> None:
    modules = {n: m for n in API_MODULES if (m := _import_optional(n)) is not None}
    _check_docstrings(modules)
    API_DIR.mkdir(parents=True, exist_ok=True)
    wanted = {f"{n}.rst": _page(n, m) for n, m in modules.items()}
    for stale in API_DIR.glob("*.rst"):
        if stale.name not in wanted:
            stale.unlink()
    for fname, text in wanted.items():
        path = API_DIR / fname
        if not path.exists() or path.read_text() != text:  # unchanged files keep incremental builds
            path.write_text(text)


# Repository files outside docs/ that the pages link to and the site includes as a page of its own.
# The Markdown keeps its repository-relative links (they work on GitHub); the site rewrites them.
INCLUDED_PAGES = {"../benchmarks/RESULTS.md": "results.md"}


def _rewrite_repo_links(app: object, docname: str, source: list[str]) -> None:
    for target, page in INCLUDED_PAGES.items():
        source[0] = source[0].replace(f"]({target})", f"]({page})")


def _skip_namedtuple_fields(
    app: object, what: str, name: str, obj: object, skip: bool, options: object
) -> bool | None:
    # NamedTuple fields are documented in the class's "Attributes:" section; autodoc would add an
    # "Alias for field number N" entry for each.
    if type(obj).__name__ == "_tuplegetter":
        return True
    return None


def setup(app: object) -> dict[str, object]:
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
    app.connect("config-inited", _write_api_pages)
    app.connect("source-read", _rewrite_repo_links)
    return {"parallel_read_safe": True}
