"""Gives the tests 8 CPU devices (before jax is imported), or the GPU under ``-m gpu``; tiers them by kind.

Every test has exactly one kind, a marker that says what it tests (declared in pyproject.toml): ``unit``
(one function's, class's or module's contract on small inputs: results, dtypes, shapes, errors, warnings,
counts, architecture rules), ``numerics`` (values against a float32, NumPy or exact reference over
dtypes, shapes or recipes, or a model trained to an accuracy or loss bound), ``property`` (random
programs or inputs drawn by hypothesis), ``composition`` (several features together: the composition
matrix, front-ends with FSDP, fp8, optimizers or several devices, peers' models), ``compiled`` (compiles
for a TPU or NVIDIA target without the hardware, or asserts on a compiled program: its memory,
collectives, copies, host transfers) and ``e2e`` (what a user runs: examples, the demo, the CLI, docs
pages, the docstring examples (conftest.py marks them) and the Sphinx build, the wheel, lint, benchmarks'
dry runs, subprocesses, multihost, Hugging Face models). A test file states its kind once (``pytestmark =
pytest.mark.unit``); a test of another kind in it carries its own kind mark, which replaces the file's:
the kind marks of the node nearest the test win (the test, then its class, then its module), and only
that kind stays on the test, so ``-m numerics`` selects exactly the numerics tests. A test with no kind,
or with two kinds on its nearest marked node, fails the collection (``--collect-only`` and every ``-m``
run alike), naming it.

The tiers follow from the kind (``_tier``), never from how long a test takes:

- fast, ``python -m pytest -q -m "not system"`` (the README's test command): ``unit`` and ``property``,
  each test with its first parameters (every case of an ``all_params`` test: different subjects);
- system, ``python -m pytest -q -m system`` (marked ``system`` here): the other cases of the ``unit`` and
  ``property`` tests (all in CI, never nightly; marked ``later_case``), ``numerics``, ``composition``,
  ``compiled``, ``e2e``, and ``property`` tests marked ``scale`` (the same properties on more programs
  with a seed);
- nightly, ``-m nightly``: a part of the system tier, each system test's parameters after its first (see
  ``_mark_nightly``) and the tests marked ``nightly``; ``.ci/run`` runs the fast tier and then
  ``-m "system and not nightly"``.

``python -m pytest -m gpu`` on a machine with an NVIDIA GPU runs the GPU tests there, with no file to
edit.
"""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    # Before any test module imports jax. The CPU backend with 8 virtual devices, unless the run
    # selects the GPU tests (`-m gpu`): those need the real device, and nothing is to be edited first.
    wants_gpu = "gpu" in (config.option.markexpr or "").replace("not gpu", "")
    if not wants_gpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if not wants_gpu and "xla_force_host_platform_device_count" not in flags:
        flags = (flags + " --xla_force_host_platform_device_count=8").strip()
    # The tests' programs are tiny, so XLA:CPU's time goes to compiling them: at LLVM's -O1 a compile takes
    # about half as long (the tests assert values and counts, never speed). Not -O0: there a program with a
    # checkpoint name or sharding constraint rounds differently from the same program without it.
    if not wants_gpu and "xla_backend_optimization_level" not in flags:
        flags += " --xla_backend_optimization_level=1"
    # XLA:CPU's newer fusion emitters compile these small programs about a third slower than its loop
    # emitters (measured on the suite's 2-core machine); the tests check values, not kernels.
    if not wants_gpu and "xla_cpu_use_fusion_emitters" not in flags:
        flags += " --xla_cpu_use_fusion_emitters=false"
    os.environ["XLA_FLAGS"] = flags.strip()
    # JAX's persistent compilation cache, shared by both workers, the system tier after the fast one, and
    # the examples, demo and benchmarks the tests spawn (they inherit the environment). Every program is
    # kept: at -O1 most compile in well under a second, and a warm cache cuts a rerun's time by about a
    # third. Keys include the jax version, the backend and XLA_FLAGS. JAX_COMPILATION_CACHE_DIR moves it;
    # JAX_ENABLE_COMPILATION_CACHE=false turns it off.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax_compilation_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


# The files that take longest in either tier (a minute and more of one core each, `--durations`), handed
# to the two workers first: with whole files per worker (`--dist loadfile`), a long file last would leave
# one core idle at the end of the run. Scheduling only: the tiers come from the kinds (below).
LONGEST_FIRST = (
    "tests/test_fp8_block.py",
    "tests/test_compiled_targets.py",
    "tests/test_examples.py",
    "tests/test_quantized_state.py",
    "tests/test_composition_frontends.py",
    "tests/test_fp8.py",
    "tests/test_engine_fuzz.py",
    "tests/test_optax_transform.py",
    "tests/test_low_precision.py",
    "tests/test_fp8_training.py",
    "tests/test_demo.py",
    "tests/test_benchmarks.py",
    "tests/test_report.py",
    "tests/test_flax_linen.py",
    "tests/test_flax_nnx.py",
    "tests/test_docs.py",
    "tests/test_autocast.py",
)


KINDS = ("unit", "numerics", "property", "composition", "compiled", "e2e")
FAST_KINDS = ("unit", "property")  # the fast tier; a property test marked ``scale`` is a system test


@pytest.hookimpl(tryfirst=True)  # before -m deselects: it must see the kinds and the derived marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.DoctestItem):  # doctests carry no marks of their own
            item.add_marker(pytest.mark.e2e)  # the API reference's examples, run as a reader copies them
    _tier(config, items)
    _mark_nightly(items)
    rank = {}
    for item in items:
        path = Path(item.path).resolve()
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else ""
        if item.get_closest_marker("gpu") is not None and not _on_gpu():
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU: `python -m pytest -m gpu` on one"))
        rank[item] = LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank.__getitem__)  # stable: each file keeps its own order


def _nearest_kinds(item: pytest.Item) -> tuple[str, ...]:
    """The kind marks of the node nearest the test that has any: the test (its decorators and its
    parameters' marks), else its class, else its module."""
    for node in reversed(item.listchain()):
        kinds = sorted({mark.name for mark in node.own_markers if mark.name in KINDS})
        if kinds:
            return tuple(kinds)
    return ()


def _tier(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Gives every test its one kind and marks the system tier's tests ``system``. A test with no kind,
    two on its nearest marked node, or a ``system`` mark of its own is not run: it is a collection error
    of its file, as a module that fails to import is, so the run fails (without xdist it stops there)."""
    kinds = {item: _nearest_kinds(item) for item in items}
    wrong = {item: " and ".join(k) or "no kind" for item, k in kinds.items() if len(k) != 1}
    wrong.update(
        (item, "marks itself system (conftest.py derives it from the kind)")
        for item in items
        if item not in wrong and item.get_closest_marker("system") is not None
    )
    if wrong:
        by_file: dict[str, list[str]] = {}
        for item, why in wrong.items():
            by_file.setdefault(item.nodeid.split("::")[0], []).append(f"  {item.nodeid}: {why}")
        for path, lines in by_file.items():
            text = (
                f"{len(lines)} tests need exactly one kind mark ({', '.join(KINDS)}: pyproject.toml says"
                " what each means; a test's own kind mark replaces its file's, see conftest.py):\n"
            ) + "\n".join(lines)
            report = pytest.CollectReport(path, "failed", text, [])
            config.hook.pytest_collectreport(report=report)
        items[:] = [item for item in items if item not in wrong]
    # The nearest kind wins: only it stays, on the test itself, so that -m sees one kind per test.
    for item in items:
        for node in item.listchain()[:-1]:
            node.own_markers[:] = [mark for mark in node.own_markers if mark.name not in KINDS]
    seen = set()
    for item in items:
        (kind,) = kinds[item]
        item.own_markers[:] = [mark for mark in item.own_markers if mark.name not in KINDS]
        item.add_marker(kind)
        fast = kind in FAST_KINDS and not (kind == "property" and item.get_closest_marker("scale"))
        if fast and _later_case(item, seen):
            # a unit or property test's other cases (more dtypes, shapes, recipes): the system tier, in CI
            fast = False
            item.add_marker(pytest.mark.later_case)
        if not fast or item.get_closest_marker("nightly") is not None:  # nightly is part of the system tier
            item.add_marker(pytest.mark.system)


def _mark_nightly(items: list[pytest.Item]) -> None:
    """The nightly tier: every parametrization of a system-tier test after its first.

    CI's system tier (``-m "system and not nightly"``) runs each system test function once, with its
    first parameters, so every behaviour it checks is checked on every commit; the other parameters
    (more dtypes, optimizers, matrix cells, recipes) run with ``-m nightly``. A test whose parameters
    are different subjects (a docs page, a compile target, a dtype's own failure) is marked
    ``all_params``: all run in CI. A test marks itself ``nightly`` where it is one function that repeats
    what CI checks at a larger size (the benchmarks' dry runs, the demo's full-batch outcome)."""
    seen: set = set()
    for item in items:
        # a unit or property test's later cases all run in CI
        if item.get_closest_marker("system") and not item.get_closest_marker("later_case"):
            if _later_case(item, seen):
                item.add_marker(pytest.mark.nightly)


def _later_case(item: pytest.Item, seen: set) -> bool:
    """Whether ``item`` is a parametrization of its test function after the first one ``seen`` holds (an
    ``all_params`` test has none). The composition matrix has a first cell per column (its ``part``)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or item.get_closest_marker("all_params"):
        return False
    key = (item.path, item.cls, item.originalname, callspec.params.get("part"))
    later = key in seen
    seen.add(key)
    return later


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"
