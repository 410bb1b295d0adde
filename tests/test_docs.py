"""Every ```python block in docs/*.md runs (each page's blocks share one namespace), and every public
name is documented in code formatting."""

import importlib
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
PAGES_WITH_CODE = [p for p in DOCS if BLOCK.search(p.read_text())]
# Pages whose examples are the documentation: losing their Python blocks (a renamed fence, a
# deleted section) must fail here instead of the page silently counting as a pass with zero blocks.
MUST_HAVE_CODE = {
    "README.md",
    "attention.md",
    "autocast.md",
    "checkpoints.md",
    "diagnostics.md",
    "distributed.md",
    "doctor.md",
    "equinox.md",
    "flax.md",
    "formats.md",
    "fp8.md",
    "getting_started.md",
    "loss_scaling.md",
    "memory.md",
    "migrating.md",
    "optax.md",
    "policy.md",
    "speed.md",
}
# Any fenced block (```python, ```bash, ~~~), then inline code spans in what is left.
FENCE = re.compile(r"^(`{3,}|~{3,})[^\n]*\n(.*?)^\1[ \t]*$", re.S | re.M)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def code_identifiers(markdown: str) -> set[str]:
    """The identifiers inside code blocks and `inline code`; prose does not count."""
    blocks = [m.group(2) for m in FENCE.finditer(markdown)]
    spans = [m.group(2) for m in SPAN.finditer(FENCE.sub("", markdown))]
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", "\n".join(blocks + spans)))


def test_pages_that_must_have_examples_have_them():
    missing = MUST_HAVE_CODE - {p.name for p in PAGES_WITH_CODE}
    assert not missing, f"pages with no ```python block: {sorted(missing)}"


@pytest.mark.e2e
@pytest.mark.all_params  # each page's examples run in CI
@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=[p.name for p in PAGES_WITH_CODE])
def test_doc_examples_run(page, capsys):
    blocks = BLOCK.findall(page.read_text())
    assert blocks, f"{page.name} has no ```python block"
    namespace: dict = {}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{page.name}[block {i}]", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message is the point
            raise AssertionError(f"{page.name} block {i} failed: {e!r}\n{code}") from e


def test_only_code_formatted_mentions_count():
    text = "Sums accumulate in float32.\n\n```bash\npip install distributed\n```\nUse `export_params(p)`."
    assert code_identifiers(text) >= {"distributed", "export_params", "p"}
    assert "accumulate" not in code_identifiers(text)  # prose
    assert "float32" not in code_identifiers(text)


@pytest.mark.parametrize(
    "module",
    ["jmp_lite", "jmp_lite.amp", "jmp_lite.attention", "jmp_lite.distributed", "jmp_lite.doctor",
     "jmp_lite.flax", "jmp_lite.flax.linen", "jmp_lite.flax.nnx", "jmp_lite.fp8", "jmp_lite.losses",
     "jmp_lite.low_precision", "jmp_lite.memory"],
)  # fmt: skip
def test_every_public_name_is_documented(module):
    import jmp_lite

    mod = importlib.import_module(module)
    # In code formatting only: common words such as `accumulate` or `distributed` occur in prose anyway.
    # The API reference is generated from __all__ itself, so it cannot tell a name is documented.
    documented = code_identifiers("\n".join(p.read_text() for p in DOCS))
    missing = [n for n in mod.__all__ if n not in documented]
    assert not missing, f"public names of {module} never mentioned in `code` in the docs: {missing}"
    for name in mod.__all__:
        obj = getattr(mod, name)
        if callable(obj) and not isinstance(obj, type(jmp_lite.LossScale)):
            assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
            if not isinstance(obj, type) or name in ("Policy", "LossScalingState", "SkipLimitReachedError"):
                assert ">>>" in obj.__doc__, f"{name} has no runnable example in its docstring"
            for attr, member in vars(obj).items() if isinstance(obj, type) else ():
                if not attr.startswith("_") and callable(member):
                    assert (member.__doc__ or "").strip(), f"{name}.{attr} has no docstring"
