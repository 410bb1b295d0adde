"""Sphinx configuration: the Markdown guide (MyST) plus an API reference built from ``__all__``.

The API pages are generated on every build from each public module's ``__all__`` (see
``_write_api_pages``), so a name another change adds shows up without editing the docs, and a public
name without a docstring stops the build (``_check_docstrings``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
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
templates_path: list[str] = []

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
    "jmp_lite.attention",
    "jmp_lite.amp",
    "jmp_lite.flax",
    "jmp_lite.flax.nnx",
    "jmp_lite.fp8",
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
        lines = list(docs[("", name)])
        return lines if any(line.strip() for line in lines) else None
    tree = ast.parse(analyzer.code)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and any(a.name == name for a in node.names):
            found = _attr_doc(node.module, name, seen | {module_name})
            if found:
                return found
    return None


def _data_doc(mod_name: str, name: str, obj: object) -> list[str] | None:
    """A constant's doc comment, or for an instance of one of our classes, that class's docstring."""
    doc = _attr_doc(mod_name, name)
    if doc is None and type(obj).__module__.split(".")[0] == "jmp_lite":
        doc = (inspect.getdoc(type(obj)) or "").splitlines() or None
    return doc


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
                ok = _data_doc(mod_name, name, obj) is not None
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
        doc = "\n".join(_data_doc(mod_name, name, obj) or [])
    else:
        doc = inspect.getdoc(obj) or ""
    doc = doc.strip().split("\n\n")[0].replace("\n", " ")
    end = doc.find(". ")
    return doc if end < 0 else doc[: end + 1]


def _home(name: str, obj: object, documented: frozenset[str]) -> str | None:
    """The one page that documents ``obj`` in full: its public module when that has a page (``_export``
    sets ``__module__`` to it), else the top-level package's; None for a module or a constant."""
    if inspect.ismodule(obj) or _kind(obj) == "data":
        return None
    module = getattr(obj, "__module__", None)
    if module in documented:
        return module
    return "jmp_lite" if name in getattr(jmp_lite, "__all__", ()) else None


def _page(mod_name: str, mod: ModuleType, documented: frozenset[str] = frozenset()) -> str:
    names = _public_names(mod)
    objs = {n: getattr(mod, n) for n in names}
    # an object documented on another page is listed here with a link to its home, not documented twice
    elsewhere = {n: h for n, obj in objs.items() if (h := _home(n, obj, documented)) not in (None, mod_name)}
    title = f"``{mod_name}``"
    lines = [title, "=" * len(title), "", f".. automodule:: {mod_name}", "   :no-members:"]
    parent, _, leaf = mod_name.rpartition(".")
    if parent and getattr(sys.modules[parent], leaf, mod) is not mod:
        # The package exports a same-named object over the module (the deprecated module path
        # jmp_lite.autocast under the function jmp_lite.autocast): the object owns the name.
        lines += ["   :no-index:"]
    lines += [""]
    # A summary table of our own: autosummary would describe a type alias by its type's docstring.
    lines += [f".. currentmodule:: {mod_name}", "", ".. list-table::", "   :widths: 30 70", ""]
    for n, obj in objs.items():
        if n in elsewhere:
            summary = f"documented as :py:obj:`{elsewhere[n]}.{n}`: {_summary(mod_name, n, obj)}"
            lines += [f"   * - ``{n}``", f"     - {summary}"]
        else:
            lines += [f"   * - :py:obj:`{n}`", f"     - {_summary(mod_name, n, obj)}"]
    lines += [""]
    for n, obj in objs.items():
        if n in elsewhere:
            continue
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
            value = repr(obj)
            lines += [f".. py:data:: {n}"] + ([f"   :value: {value}"] if "\n" not in value else []) + [""]
            lines += [f"   {line}" for line in _data_doc(mod_name, n, obj) or []] + [""]
    return "\n".join(lines)


def _with_exported_submodules(modules: dict[str, ModuleType]) -> dict[str, ModuleType]:
    """Adds every submodule that a documented module exports in ``__all__`` (e.g. a later one)."""
    found = dict(modules)
    todo = list(modules.values())
    while todo:
        mod = todo.pop()
        for name in _public_names(mod):
            sub = getattr(mod, name, None)
            if inspect.ismodule(sub) and sub.__name__ not in found:
                if _import_optional(sub.__name__) is not None:  # this tree's own submodules only
                    found[sub.__name__] = sub
                    todo.append(sub)
    return found


def _write_api_pages(app: object, config: object) -> None:
    modules = _with_exported_submodules({n: m for n in API_MODULES if (m := _import_optional(n)) is not None})
    _check_docstrings(modules)
    API_DIR.mkdir(parents=True, exist_ok=True)
    documented = frozenset(modules)
    wanted = {f"{n}.rst": _page(n, m, documented) for n, m in modules.items()}
    for stale in API_DIR.glob("*.rst"):
        if stale.name not in wanted:
            stale.unlink()
    for fname, text in wanted.items():
        path = API_DIR / fname
        if not path.exists() or path.read_text() != text:  # unchanged files keep incremental builds
            path.write_text(text)


# Markdown files of the repository outside docs/ get a page of their own under docs/repo/ (an include),
# always for these and for any that a page links to as ``../path.md``. The pages keep their
# repository-relative links, which work on GitHub; the site rewrites them to those pages.
REPO_PAGES = ["CHANGELOG.md", "benchmarks/RESULTS.md"]
REPO_DIR = DOCS / "repo"
_REPO_LINK = re.compile(r"\]\(\.\./([A-Za-z0-9_./-]+\.md)(#[^)]*)?\)")


def _linked_repo_files() -> set[str]:
    found = set(REPO_PAGES)
    for page in DOCS.glob("*.md"):
        found |= {m.group(1) for m in _REPO_LINK.finditer(page.read_text())}
    return {f for f in found if (DOCS.parent / f).is_file() and not f.startswith("docs/")}


def _write_repo_pages(app: object, config: object) -> None:
    wanted = {}
    for rel in _linked_repo_files():
        up = "../" * (rel.count("/") + 2)  # from docs/repo/<rel> back to the repository root
        wanted[REPO_DIR / rel] = f"---\norphan: true\n---\n\n```{{include}} {up}{rel}\n```\n"
    for stale in REPO_DIR.rglob("*.md") if REPO_DIR.exists() else ():
        if stale not in wanted:
            stale.unlink()
    for path, text in wanted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


_GUIDE_TOC = re.compile(r"(```\{toctree\}\n(?::.*\n)*:caption: Guide\n(?::.*\n)*\n)((?:.+\n)*)(```)")


def _complete_guide_toc(app: object, docname: str, source: list[str]) -> None:
    # A guide page added later joins the end of the Guide toctree without an edit to index.md.
    if docname != "index":
        return

    def add_missing(m: re.Match) -> str:
        listed = set(m.group(2).split())
        missing = sorted(p.stem for p in DOCS.glob("*.md") if p.stem not in listed | {"index"})
        return m.group(1) + m.group(2) + "".join(f"{name}\n" for name in missing) + m.group(3)

    source[0] = _GUIDE_TOC.sub(add_missing, source[0], count=1)


def _rewrite_repo_links(app: object, docname: str, source: list[str]) -> None:
    if "/" in docname:  # only the top-level guide pages link with ../
        return
    source[0] = _REPO_LINK.sub(
        lambda m: (
            f"](repo/{m.group(1)}{m.group(2) or ''})" if (REPO_DIR / m.group(1)).exists() else m.group(0)
        ),
        source[0],
    )


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
    app.connect("config-inited", _write_repo_pages)
    app.connect("source-read", _rewrite_repo_links)
    app.connect("source-read", _complete_guide_toc)
    return {"parallel_read_safe": True}
