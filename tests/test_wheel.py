"""The release: sdist and wheel build, ``twine check`` passes, and the wheel works installed in a fresh
venv (not editable, no repository on the path).

The fresh venv gets the already-installed dependencies of this environment through a ``.pth`` file
(a directory of links to them, without jmp_lite itself), so installing the wheel resolves its declared
dependencies with ``--no-index`` and downloads nothing; ``tools/check_floors.py`` checks the
declared lower bounds.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import jmp_lite

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("build", reason="the wheel test needs the dev extra: pip install -e '.[dev]'")

STEP = """
import sys, jax, jax.numpy as jnp, optax, jmp_lite
assert jmp_lite.__file__.startswith(sys.prefix), jmp_lite.__file__
print(jmp_lite.__file__)
tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(jnp.float32(2**10)))
params = {"w": jnp.ones(3, jnp.float16)}

@jax.jit
def step(params, state):
    loss_fn = lambda p: jmp_lite.get_loss_scale(state).scale(jnp.sum(p["w"].astype(jnp.float32) ** 2))
    grads = jax.grad(loss_fn)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

params, state = step(params, tx.init(params))
print(params["w"].dtype, params["w"].tolist(), bool(state.last_grads_finite))
"""


def _run(cmd, **kw):
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert res.returncode == 0, f"{cmd} failed:\n{res.stdout}\n{res.stderr}"
    return res.stdout


def _deps_dir(tmp: Path) -> Path:
    """Links to this environment's installed packages, minus jmp_lite and any .pth hooks."""
    deps = tmp / "deps"
    deps.mkdir()
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in Path(site).iterdir():
            name = entry.name.lower()
            if (
                "jmp_lite" in name
                or "jmp-lite" in name
                or name.endswith(".pth")
                or (deps / entry.name).exists()
            ):
                continue
            (deps / entry.name).symlink_to(entry)
    return deps


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    # Build from a copy, so the source tree gets no build/ or egg-info.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "CHANGELOG.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "jmp_lite", src / "jmp_lite", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    # Without isolation when the build backend is installed (fast, offline); isolated otherwise.
    no_isolation = ["--no-isolation"] if _setuptools_ok() else []
    _run([sys.executable, "-m", "build", *no_isolation, "--outdir", str(out), str(src)])
    return out


def _setuptools_ok() -> bool:
    """Whether the installed setuptools meets pyproject.toml's build-system requirement."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    import setuptools

    return int(setuptools.__version__.split(".")[0]) >= 77


def test_sdist_and_wheel_build_and_pass_twine_check(dist):
    version = jmp_lite.__version__
    assert sorted(p.name for p in dist.iterdir()) == [
        f"jmp_lite-{version}-py3-none-any.whl",
        f"jmp_lite-{version}.tar.gz",
    ]
    if importlib.util.find_spec("twine") is None:
        pytest.skip("twine is in the dev extra")
    out = _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.iterdir())])
    assert out.count("PASSED") == 2, out


def test_version_has_one_source_of_truth():
    text = (ROOT / "pyproject.toml").read_text()
    project = text.split("\n[project]\n")[1].split("\n[")[0]  # tomllib is Python 3.11+
    assert 'dynamic = ["version"]' in project and not re.search(r"^version\s*=", project, re.M)
    assert 'version = { attr = "jmp_lite.__version__" }' in text
    assert f"## [{jmp_lite.__version__}]" in (ROOT / "CHANGELOG.md").read_text()


def test_wheel_installs_and_runs_in_a_fresh_venv(dist, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    Path(purelib, "_test_deps.pth").write_text(str(_deps_dir(tmp_path)) + "\n")
    wheel = next(dist.glob("*.whl"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    _run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index", "-q", str(wheel)], env=env
    )
    work = tmp_path / "elsewhere"  # not the repository, so nothing imports from the source tree
    work.mkdir()
    out = _run([str(py), "-c", STEP], cwd=work, env=env)
    file, result = out.strip().splitlines()[-2:]
    assert Path(file).is_relative_to(venv), file
    # the float16 grad of the scaled loss is 2 * w * 2**10, unscaled to 2 * w: 1 - 0.1 * 2 = 0.8 in float16
    assert result == "float16 [0.7998046875, 0.7998046875, 0.7998046875] True", result
    help_text = _run([str(venv / "bin" / "jmp-lite"), "demo", "--help"], cwd=work, env=env)
    assert "usage: jmp-lite demo" in help_text
