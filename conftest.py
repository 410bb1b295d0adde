"""Gives the tests 8 CPU devices (before jax is imported) and marks the slow tests.

``python -m pytest -q`` runs everything (CI); ``python -m pytest -q -m "not slow"`` is the development loop.
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

ROOT = Path(__file__).resolve().parent
# Whole files (or single tests, "file::test") that build, lint, spawn processes or train: each takes
# more than about 10 s. tests/test_architecture.py checks that every entry still names a real test.
SLOW = {
    "tests/test_lint.py": "ruff over the whole repository",
    "tests/test_docs_build.py": "the Sphinx build",
    "tests/test_wheel.py": "builds the sdist and wheel, installs into a fresh venv",
    "tests/test_examples.py": "trains every example",
    "tests/test_demo.py": "runs the demo",
    "tests/test_benchmarks.py": "the GPU benchmark suite's CPU dry run",
    "tests/test_multihost.py": "two processes over jax.distributed",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.path).resolve()
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else ""
        name = getattr(item, "originalname", None) or item.name
        if rel in SLOW or f"{rel}::{name}" in SLOW:
            item.add_marker(pytest.mark.slow)
