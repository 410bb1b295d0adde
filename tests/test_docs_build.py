"""The documentation site builds with warnings as errors (a broken reference or an undocumented
public name fails), and its API reference lists every public name."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import jmp_lite
import jmp_lite.flax
import jmp_lite.flax.nnx

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("sphinx", reason="the docs build needs the docs extra: pip install -e '.[docs]'")
pytest.importorskip("myst_parser", reason="the docs build needs the docs extra: pip install -e '.[docs]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, f"sphinx-build failed:\n{res.stdout}\n{res.stderr}"
    return out


def _ids(page: Path) -> set[str]:
    return set(re.findall(r'id="([^"]+)"', page.read_text()))


@pytest.mark.parametrize("module", [jmp_lite, jmp_lite.flax, jmp_lite.flax.nnx], ids=lambda m: m.__name__)
def test_api_reference_lists_every_public_name(site, module):
    page = site / "api" / "generated" / f"{module.__name__}.html"
    ids = _ids(page)
    text = page.read_text()
    for name in module.__all__:
        obj = getattr(module, name)
        if isinstance(obj, type(sys)):  # a submodule: linked to its own page
            assert f'href="{obj.__name__}.html' in text, name
            continue
        home = getattr(obj, "__module__", module.__name__)
        if f"{module.__name__}.{name}" in ids:
            continue
        # documented once, on its home page (its public module's), and linked from here
        missing = f"{module.__name__}.{name} is not in the API reference"
        assert f'href="{home}.html#{home}.{name}"' in text, missing
        assert f"{home}.{name}" in _ids(site / "api" / "generated" / f"{home}.html")


def test_api_reference_documents_each_object_once(site):
    pages = sorted((site / "api" / "generated").glob("jmp_lite*.html"))
    seen: dict = {}
    for page in pages:
        for ident in _ids(page):
            if ident.count(".") >= 1 and not ident.endswith(".html"):
                module, _, name = ident.rpartition(".")
                obj = getattr(sys.modules.get(module), name, None)
                if obj is not None and callable(obj):
                    seen.setdefault(id(obj), set()).add(ident)
    twice = {min(v): sorted(v) for v in seen.values() if len(v) > 1}
    assert not twice, f"objects documented on more than one page: {twice}"


def test_guide_pages_are_in_the_site(site):
    for md in (ROOT / "docs").glob("*.md"):
        assert (site / f"{md.stem}.html").exists(), md.name
    # cross-links from the guide resolve to pages of the site
    assert 'href="repo/benchmarks/RESULTS.html' in (site / "optax.html").read_text()
    assert (site / "repo" / "CHANGELOG.html").exists()


def test_a_public_name_without_a_docstring_fails_the_build(tmp_path):
    # A copy of the package with one docstring removed; conf.py documents whatever it imports.
    pkg = tmp_path / "src"
    shutil.copytree(ROOT / "jmp_lite", pkg / "jmp_lite", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("_build", "generated"))
    policy = pkg / "jmp_lite" / "_src" / "base" / "policy.py"
    src = policy.read_text()
    start = src.index('    """', src.index("def cast_to_full("))
    end = src.index('"""', start + 7) + 3
    policy.write_text(src[:start] + "    pass  # no docstring\n" + src[end:])
    conf = tmp_path / "docs" / "conf.py"
    conf.write_text(conf.read_text().replace("DOCS.parent", repr(str(pkg)), 1))
    cmd = [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", "docs", str(tmp_path / "out")]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode != 0
    assert "jmp_lite.cast_to_full" in res.stderr and "docstring" in res.stderr
