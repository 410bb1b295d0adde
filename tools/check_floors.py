"""Check that the declared dependency floors are versions jmp_lite runs on.

Builds a venv with every dependency pinned to the lower bound declared in pyproject.toml (jaxlib to
jax's), or jax, optax and flax to the versions given on the command line, then runs the core tests
against the source tree in that venv. Exit status is pytest's.

    nice -n 15 python tools/check_floors.py                  # the declared floors
    nice -n 15 python tools/check_floors.py --jax 0.9.2      # try another candidate floor

It downloads old wheels from PyPI, so it is a script rather than part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PINNED = ("jax", "optax", "flax")
CORE_TESTS = [
    "tests/test_policy.py",
    "tests/test_get_policy.py",
    "tests/test_loss_scale.py",
    "tests/test_optax_transform.py",
    "tests/test_diagnostics.py",
    "tests/test_flax_linen.py",
    "tests/test_flax_train_state.py",
    "tests/test_flax_nnx.py",
    "jmp_lite",
]
FLAX_PATHS = ("tests/test_flax", "jmp_lite/flax", "jmp_lite/_demo")
# What the core tests import besides the package itself.
TEST_DEPS = ["pytest>=8", "hypothesis>=6.100", "chex", "jmp==0.0.4"]


def _floors(deps: list[str]) -> dict[str, str]:
    floors = {}
    for dep in deps:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)\s*(?:,.*)?", dep)
        if m:
            floors[m.group(1).lower().replace("_", "-")] = m.group(2)
    return floors


def declared_floors() -> dict[str, str]:
    """Maps each dependency with a ``>=`` bound in pyproject.toml to that bound.

    jax, optax or flax declared only in an extra (flax as an optional dependency) count too.
    """
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = _floors(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        for name, floor in _floors(extra).items():
            if name in PINNED and name not in floors:
                floors[name] = floor
    return floors


def main() -> int:
    floors = declared_floors()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for name in PINNED:
        parser.add_argument(
            f"--{name}", default=floors.get(name), help=f"version to pin (default {floors.get(name)})"
        )
    parser.add_argument(
        "--without-flax",
        action="store_true",
        help="install no flax and run only the tests that do not need it (the jax floor of the core)",
    )
    parser.add_argument("--venv", default=os.environ.get("FLOORS_VENV", "/tmp/jmp_lite_floors"))
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()

    # Every declared lower bound is pinned (numpy, ml_dtypes, rich too), jax/optax/flax as given.
    pins = {**floors, **{name: getattr(args, name) for name in PINNED}}
    if args.without_flax:
        pins.pop("flax")
    missing = [n for n, v in pins.items() if not v]
    if missing:
        parser.error(f"no floor declared in pyproject.toml for {missing}; pass --NAME VERSION")
    env_dir = Path(args.venv)
    if not (env_dir / "bin" / "python").exists():
        venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    reqs = [f"{n}=={v}" for n, v in pins.items()] + [f"jaxlib=={pins['jax']}"]
    # Dependencies declared without a lower bound, as declared.
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d: re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower().replace("_", "-") for d in deps}
    reqs += [d for d, n in names.items() if n not in floors]
    tests = CORE_TESTS
    if args.without_flax:
        tests = [t for t in CORE_TESTS if not t.startswith(FLAX_PATHS)]
        tests += [f"--ignore={p}" for p in FLAX_PATHS if not p.startswith("tests")]
        subprocess.run([py, "-m", "pip", "uninstall", "-q", "-y", "flax"], check=False)
    print("installing:", " ".join(reqs), flush=True)
    subprocess.run([py, "-m", "pip", "install", "-q", *reqs, *TEST_DEPS], check=True)
    subprocess.run([py, "-m", "pip", "list"], check=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [py, "-m", "pytest", "-q", *tests, *args.pytest_args]
    print("running:", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
