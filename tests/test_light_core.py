"""``import jmp_lite`` stays light: jax, optax, numpy and ml_dtypes only."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.e2e


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_loads_neither_flax_rich_nor_matplotlib():
    loaded = _run(
        """
        import sys
        import jmp_lite, jmp_lite.cli, jmp_lite.distributed, jmp_lite.diagnostics
        print(sorted(m for m in ("flax", "rich", "matplotlib") if m in sys.modules))
        """
    )
    assert loaded == "[]"


def test_import_installs_no_import_hook_and_loads_no_flax():
    out = _run(
        """
        import sys
        import jax, ml_dtypes, numpy, optax  # absl (through optax) adds a finder of its own
        hooks = list(sys.meta_path)
        import jmp_lite, jmp_lite.step, jmp_lite.optax_transform, jmp_lite.loss_scale
        print(sys.meta_path == hooks, sorted(m for m in sys.modules if m.split(".")[0] == "flax"))
        """
    )
    assert out == "True []"


@pytest.mark.parametrize("flax_first", [False, True])
@pytest.mark.all_params  # two import orders, both in CI
def test_states_serialize_once_jmp_lite_flax_is_imported(flax_first):
    pytest.importorskip("flax")
    first, second = ("import flax.serialization", "import jmp_lite.flax") if flax_first else (
        "import jmp_lite", "import flax.serialization; import jmp_lite.flax"
    )  # fmt: skip
    out = _run(
        f"""
        {first}
        {second}
        import sys, jax.numpy as jnp
        from flax import serialization
        ls = jmp_lite.DynamicLossScale(2.0 ** 15, period=7, factor=4, min_loss_scale=4.0,
                                       max_loss_scale=2.0 ** 20)
        ls = ls.adjust(jnp.bool_(False)).adjust(jnp.bool_(True))  # scale and counter differ from the target's
        state = {{"ls": ls, "st": jmp_lite.StaticLossScale(8.0), "no": jmp_lite.NoOpLossScale()}}
        raw = serialization.to_bytes(state)
        # hyperparameters differ from the saved ones and from the defaults: they come from the target,
        # the arrays from the bytes
        target = {{"ls": jmp_lite.DynamicLossScale(1.0, period=3, factor=3, min_loss_scale=0.5,
                                                   max_loss_scale=2.0 ** 22),
                  "st": jmp_lite.StaticLossScale(1.0), "no": jmp_lite.NoOpLossScale()}}
        back = serialization.from_bytes(target, raw)
        print(float(back["ls"].loss_scale), int(back["ls"].counter), back["ls"].period,
              float(back["ls"].factor), float(back["ls"].min_loss_scale), float(back["ls"].max_loss_scale),
              float(back["st"].loss_scale), back["no"],
              serialization.to_state_dict(ls)["counter"])
        """
    )
    assert out == "8192.0 1 3 3.0 0.5 4194304.0 8.0 NoOpLossScale() 1"


def test_flax_serialization_without_jmp_lite_flax_fails_loudly():
    pytest.importorskip("flax")
    out = _run(
        """
        import jax.numpy as jnp, numpy as np, optax, jmp_lite
        from flax import serialization
        tx = jmp_lite.loss_scaling(optax.sgd(1.0), jmp_lite.DynamicLossScale(8.0))
        params = {"w": jnp.ones(2)}
        state = tx.init(params)
        try:
            serialization.to_bytes(state)
        except TypeError as e:
            print("save:", e)
        # bytes saved by a program that registered the scales, restored by one that did not
        saved = {"loss_scale": np.float32(8), "counter": np.int32(0)}
        saved = serialization.to_state_dict(state._replace(loss_scale=saved))
        restored = serialization.from_state_dict(state, saved)
        try:
            tx.update(params, restored, params)
        except TypeError as e:
            print("update:", e)
        """
    )
    save, update = out.splitlines()
    assert "can not serialize" in save and "DynamicLossScale" in save
    assert "`import jmp_lite.flax`" in update


@pytest.mark.unit
def test_demo_without_extras_says_what_to_install(monkeypatch, capsys):
    from jmp_lite.cli import main

    monkeypatch.setitem(sys.modules, "rich", None)  # makes `import rich` fail as if not installed
    with pytest.raises(SystemExit, match=r"missing: rich; install them with: pip install 'jmp-lite\[demo\]'"):
        main(["demo", "--steps", "1"])


def test_core_works_with_flax_rich_and_matplotlib_not_installed():
    out = _run(
        """
        import importlib.abc, sys

        class NotInstalled(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("flax", "rich", "matplotlib"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, NotInstalled())
        import jax.numpy as jnp, optax, jmp_lite
        from jmp_lite.cli import main

        tx = jmp_lite.loss_scaling(optax.sgd(1.0), jmp_lite.DynamicLossScale(2.0**15))
        params = {"w": jnp.ones(2)}
        updates, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, tx.init(params), params)
        print(int(state.skipped_total), float(jmp_lite.get_loss_scale(state).loss_scale))
        try:
            main(["demo", "--steps", "1"])
        except SystemExit as e:
            print(e)
        """
    )
    first, message = out.splitlines()
    assert first == "1 16384.0"
    assert "missing: flax, rich; install them with: pip install 'jmp-lite[demo]'" in message
