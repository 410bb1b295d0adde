"""Gives the tests 8 CPU devices (before jax is imported), or the GPU under ``-m gpu``.

Tiers (marks live on the tests): ``python -m pytest -q -m "not slow"`` is the fast tier, the README's
test command; ``python -m pytest -q -m slow`` is the system tier (examples, demo, docs build, wheel,
benchmark dry runs, multihost, lint, long numerics); ``.ci/run`` runs the fast tier and the system tier
less its nightly part (``-m nightly``: each slow test's parameters after its first, see
``_mark_nightly``). ``python -m pytest -m gpu`` on a machine with an NVIDIA GPU runs the GPU tests
there, with no file to edit.
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


# The files that take longest (about a minute and more of one core each, `--durations`), handed to the
# two workers first: with whole files per worker (`--dist loadfile`), a long file last would leave one
# core idle at the end of the run.
LONGEST_FIRST = (
    "tests/test_compiled_targets.py",
    "tests/test_examples.py",
    "tests/test_quantized_state.py",
    "tests/test_composition_frontends.py",
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


# The docstring examples that compile for seconds (cold, 2 cores): doctests carry no marks of their own,
# so they join the system tier here.
SLOW_DOCTESTS = frozenset(
    f"jmp_lite.{name}"
    for name in (
        "doctor.suggest_rules",
        "doctor.precision_report",
        "doctor.PrecisionReport",
        "low_precision.low_precision_state",
        "low_precision.stochastic_rounding",
        "low_precision.QuantizedArray",
        "low_precision.dequantized",
        "fp8.update_fp8_state",
        "fp8.dot_general",
        "fp8.einsum",
        "_src.tools.fp8_report.fp8_report",
        "_src.tools.diagnostics.gradient_diagnostics",
        "losses.fused_linear_cross_entropy",
        "autocast.autocast",
        "attention.dot_product_attention",
        "flax.nnx.LossScaledOptimizer",
        "_src.flax.nnx_attention.attention",
    )
)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the nightly marks below must be seen by it
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.DoctestItem) and item.name in SLOW_DOCTESTS:
            item.add_marker(pytest.mark.slow)
    _mark_nightly(items)
    rank = {}
    for item in items:
        path = Path(item.path).resolve()
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else ""
        if item.get_closest_marker("gpu") is not None and not _on_gpu():
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU: `python -m pytest -m gpu` on one"))
        rank[item] = LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank.__getitem__)  # stable: each file keeps its own order


def _mark_nightly(items: list[pytest.Item]) -> None:
    """The nightly tier: every parametrization of a system-tier test after its first.

    CI's system tier (``-m "slow and not nightly"``) runs each slow test function once, with its first
    parameters, so every behaviour it checks is checked on every commit within CI's time; the other
    parameters (more dtypes, optimizers, matrix cells, recipes) run with ``-m nightly``. A test whose
    parameters are different subjects (a docs page, a compile target) is marked ``all_params``: all run in
    CI. A test marks itself ``nightly`` where it is one function that repeats what CI checks at a larger
    size (the benchmarks' dry runs, the demo's full-batch outcome)."""
    seen = set()
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or not item.get_closest_marker("slow") or item.get_closest_marker("all_params"):
            continue
        # the composition matrix trains its first cell of each column (front-end, model, mode) in CI
        key = (item.path, item.cls, item.originalname, callspec.params.get("part"))
        if key in seen:
            item.add_marker(pytest.mark.nightly)
        seen.add(key)


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"
