"""Every ```python block in docs/*.md runs (each page's blocks share one namespace)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_doc_examples_run(page, capsys):
    blocks = BLOCK.findall(page.read_text())
    namespace: dict = {}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{page.name}[block {i}]", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message is the point
            raise AssertionError(f"{page.name} block {i} failed: {e!r}\n{code}") from e


@pytest.mark.parametrize("module", ["jmp_lite", "jmp_lite.flax", "jmp_lite.flax.nnx"])
def test_every_public_name_is_documented(module):
    import importlib

    import jmp_lite

    mod = importlib.import_module(module)
    text = "\n".join(p.read_text() for p in DOCS)
    # whole names only: "LossScale" inside "DynamicLossScale" does not count
    missing = [n for n in mod.__all__ if not re.search(rf"(?<![A-Za-z_]){n}(?![A-Za-z_])", text)]
    assert not missing, f"public names of {module} with no docs entry: {missing}"
    for name in mod.__all__:
        obj = getattr(mod, name)
        if callable(obj) and not isinstance(obj, type(jmp_lite.LossScale)):
            assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
            if not isinstance(obj, type) or name in ("Policy", "LossScalingState", "SkipLimitReachedError"):
                assert ">>>" in obj.__doc__, f"{name} has no runnable example in its docstring"
            for attr, member in vars(obj).items() if isinstance(obj, type) else ():
                if not attr.startswith("_") and callable(member):
                    assert (member.__doc__ or "").strip(), f"{name}.{attr} has no docstring"
